"""A ``torch.distributed.checkpoint`` storage reader over in-memory snapshots: DCP reslices them onto the
current mesh, whatever the number of ranks that took them.

Each snapshot is one rank's shards (``description.Description``) and its payload (a uint8 tensor over the
mapped slot, or bytes received from the rank that holds it). Every shard is a chunk of its global tensor in
DCP's metadata; an HSDP replica's chunks, the same on every replica, are listed once. ``read_data`` copies
each requested piece from the payload straight into DCP's target (no file, no unpickling of tensors).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .description import Description, Entry


def _tensor(payload: torch.Tensor, base: int, entry: Entry) -> torch.Tensor:
    dtype = getattr(torch, entry.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return payload[base + entry.at: base + entry.at + entry.nbytes].view(dtype).view(entry.shape)


class SnapshotReader(StorageReader):
    """DCP storage over ``snapshots``: ``[(description, payload)]``, one per rank of the run that took
    them."""

    def __init__(self, snapshots: list[tuple[Description, torch.Tensor]]) -> None:
        super().__init__()
        self.sources: dict[MetadataIndex, tuple[torch.Tensor, int, Entry]] = {}
        sizes: dict[str, TensorStorageMetadata] = {}
        for description, payload in snapshots:
            for entry in description.entries:
                index = MetadataIndex(entry.key, torch.Size(entry.offsets))
                if index in self.sources:  # a replica's copy of the same chunk (HSDP, a plain tensor)
                    continue
                self.sources[index] = (payload, description.tensors_at, entry)
                md = sizes.setdefault(entry.key, TensorStorageMetadata(
                    TensorProperties(dtype=getattr(torch, entry.dtype)), torch.Size(entry.global_shape), []))
                md.chunks.append(ChunkStorageMetadata(torch.Size(entry.offsets), torch.Size(entry.shape)))
        self.metadata = Metadata(state_dict_metadata=dict(sizes), storage_data=self.sources,
                                 storage_meta=StorageMeta())

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for req in plan.items:
            payload, base, entry = self.sources[req.storage_index]
            piece = _tensor(payload, base, entry)
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                piece = piece.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            target.copy_(piece)
            planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False
