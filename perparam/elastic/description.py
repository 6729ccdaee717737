"""What one rank's snapshot holds, and where in its slot's payload each tensor lies.

The tensors are those of ``perparam.checkpoint.capture`` (the model's state dict and every optimizer's state,
by parameter name), each as this rank's local shard with the place of that shard in the global tensor
(DCP's chunk: offsets and sizes, from ``DTensor.__create_chunk_list__``); a plain tensor is one chunk at
offset 0. With the manifest, that is what ``torch.distributed.checkpoint`` needs to reslice the state onto
any other number of ranks (``reader.SnapshotReader``).

The description is pickled at the front of the payload; the tensors follow, 64-byte aligned, in state-dict
order.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .errors import SnapshotError
from .slots import align


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]  # the local shard's
    offsets: tuple[int, ...]  # of the shard in the global tensor
    global_shape: tuple[int, ...]
    at: int  # byte offset in the payload
    nbytes: int


@dataclass
class Description:
    rank: int
    world_size: int
    manifest: dict
    extra: bytes  # pickled: step, scheduler, RNG, user state
    entries: list[Entry]
    tensors_at: int = 0  # where the first tensor starts in the payload

    def dumps(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)


def loads(raw: bytes) -> Description:
    value = pickle.loads(raw)
    if not isinstance(value, Description):
        raise SnapshotError("a snapshot slot holds something that is not a perparam snapshot description")
    return value


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _chunk(key: str, t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, global shape)`` of this rank's shard of ``t``."""
    if not isinstance(t, DTensor):
        return (0,) * t.dim(), tuple(t.shape)
    chunks = t.__create_chunk_list__()
    local = t.to_local()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise SnapshotError(f"'{key}' is a DTensor whose local shard is not one block of the global tensor "
                            f"(placements {t.placements}: tensor parallelism's strided shards): in-memory "
                            "snapshots cannot hold it; train without tensor parallelism, or save with "
                            "perparam.checkpoint")
    return tuple(chunks[0].offsets), tuple(t.shape)


class Layout:
    """The entries of a state dict, computed once per set of keys, shapes and dtypes (``entries`` reuses
    them while they stay the same: a step changes values, not layouts)."""

    def __init__(self) -> None:
        self._signature: tuple | None = None
        self._entries: list[Entry] = []
        self._tensor_bytes = 0

    def entries(self, state: dict[str, torch.Tensor]) -> tuple[list[Entry], int]:
        """The entries (offsets from the first tensor) and the tensors' total bytes."""
        signature = tuple((k, tuple(local_of(v).shape), v.dtype, type(v) is DTensor)
                          for k, v in state.items())
        if signature != self._signature:
            entries, at = [], 0
            for key, value in state.items():
                offsets, global_shape = _chunk(key, value)
                local = local_of(value)
                nbytes = local.numel() * local.element_size()
                entries.append(Entry(key, str(value.dtype).removeprefix("torch."), tuple(local.shape),
                                     offsets, global_shape, at, nbytes))
                at = align(at + nbytes)
            self._signature, self._entries, self._tensor_bytes = signature, entries, at
        return self._entries, self._tensor_bytes
