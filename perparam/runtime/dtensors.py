"""Tensors built without communicating, shared by the sharded parameter and the owner path's gradients:
a DTensor over a local tensor with its spec given (no checks, no collective), the spec itself, a contiguous
stride, and a digest of a tensor's bits (``rows_digest``)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a contiguous tensor of ``shape``, a size-0 dim counted as 1."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def dtensor_spec(mesh: DeviceMesh, placements, shape, dtype: torch.dtype) -> DTensorSpec:
    """The spec of a contiguous DTensor of global ``shape`` and ``dtype`` placed on ``mesh`` by
    ``placements``."""
    shape = tuple(shape)
    return DTensorSpec(mesh, tuple(placements),
                       tensor_meta=TensorMeta(torch.Size(shape), contiguous_stride(shape),
                                              dtype))


def local_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements, shape,
                  spec: DTensorSpec | None = None) -> DTensor:
    """A DTensor over ``local`` without copying or communicating (``DTensor.from_local`` with
    ``run_check=False``, minus its per-call argument handling: this runs once per parameter per step)."""
    return DTensor(local, spec or dtensor_spec(mesh, placements, shape, local.dtype), requires_grad=False)


def rows_digest(rows: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 digest of ``rows``' bits (the sum of its elements read as integers of their width, each
    weighted by its position mod 251 plus one, so a scaling, an edit or a swap of two values changes it):
    two equal digests mean the rows are, barring a collision, the same bits. One pass over the rows."""
    if rows.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=rows.device)
    bits = rows.contiguous().view(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        rows.element_size()])
    weights = torch.arange(bits.numel(), device=rows.device) % 251 + 1
    return (bits.to(torch.int64) * weights).sum()  # not torch.dot: CUDA has no integer dot
