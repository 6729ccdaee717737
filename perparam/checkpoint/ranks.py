"""What the checkpoint files share about the ranks and the model: this rank, a barrier, a value from rank 0
(each a no-op without a process group), DCP's single-process warning silenced, the model's state dict (meta
tensors refused), and the keys of DTensors that are a different tensor on different ranks' meshes."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from ..full_state import per_rank_keys


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes one process when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore",
                                message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def from_rank0(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    meta = [k for k, v in state.items() if v.is_meta]
    if meta:
        raise CheckpointError(f"'{meta[0]}' (and {len(meta) - 1} more) of the model are on the meta device: "
                              "materialise it first with model.to_empty(device=...), then recompute its "
                              "non-persistent buffers, which no checkpoint holds (perparam.full_state."
                              "load_full_state_dict does both, for a full state dict held by rank 0)")
    return state


def mesh_renames(state: dict, model: nn.Module) -> dict[str, str]:
    """Key -> the key DCP stores it under, for each DTensor that is a different tensor on different ranks
    (``perparam.full_state.per_rank_keys``: experts of expert parallelism, each rank's on its own mesh
    given by ``ParamPolicy(mesh=...)``). DCP would take them for one tensor and keep one rank's copy; each
    is stored as ``<key>@ranks=<its mesh's ranks>`` instead, so a load with the same layout reads each back
    (another layout finds no such key: an error, never another rank's values). A collective on every rank;
    ``{}`` on one process."""
    return {k: f"{k}@ranks={'-'.join(map(str, ranks))}" for k, ranks in per_rank_keys(state, model).items()}


def per_mesh_keys(state: dict, model: nn.Module) -> dict:
    """``state`` with the keys of per-rank-mesh DTensors renamed (``_mesh_renames``): the same tensors."""
    renames = mesh_renames(state, model)
    return {renames.get(k, k): v for k, v in state.items()}
