"""A ``ShardedParam``'s gradients (``ParamGradients``, its base): the unsharded gradient moved into the
reduce dtype and accumulated over micro-batches without sync, the zeros a rank without a gradient
reduces, and the reduced pieces accumulated into the sharded (or, stage 1, whole) ``.grad``, the division
fused where it is exact; plus the DTensor helpers both use."""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def _power_of_two(x: float) -> bool:
    """``x`` is ``2**m`` for an integer ``m`` (dividing by it is exact, barring subnormal results)."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _spec(mesh: DeviceMesh, placements, shape, dtype: torch.dtype) -> DTensorSpec:
    shape = tuple(shape)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), contiguous_stride(shape),
                                                                       dtype))


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, placements, shape, spec: DTensorSpec | None = None) -> DTensor:
    """A DTensor over ``local`` without copying or communicating (``DTensor.from_local`` with
    ``run_check=False``, minus its per-call argument handling: this runs once per parameter per step)."""
    return DTensor(local, spec or _spec(mesh, placements, shape, local.dtype), requires_grad=False)


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


class ParamGradients:
    """The gradient side of ``perparam.runtime.param.ShardedParam`` (its fields: ``sharded``, ``unsharded``,
    ``policy``, ``layout``, ``mesh``, ``placements``, ``grad_acc``, ``offload``, ...)."""

    # -- gradients --------------------------------------------------------------------------------------
    def take_unsharded_grad(self, keep: bool) -> torch.Tensor | None:
        """Move the unsharded gradient into the reduce dtype, summed with what earlier micro-batches left.

        ``keep``: hold it for the next micro-batch (gradient sync off) and return ``None``; otherwise
        return it (shard dim first, for packing) and hold nothing.
        """
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is not None:
            self.unsharded.grad = None
            # cast first, reduce after: reduce_dtype governs every reduction the gradient goes through,
            # the tp one included (a Partial gradient of a parameter replicated on the tp axis is summed
            # over the tp ranks by the redistribute below)
            if grad.dtype != self.policy.reduce_dtype:
                grad = grad.to(self.policy.reduce_dtype)
            if isinstance(grad, DTensor):  # tp: e.g. Partial -> the parameter's own tp placements
                if tuple(grad.placements) != self.tp.tp_placements:
                    grad = grad.redistribute(self.tp.tp_mesh, self.tp.tp_placements)
                grad = grad.to_local()
        if self.grad_acc is not None:
            grad = self.grad_acc if grad is None else self.grad_acc.add_(grad)
            self.grad_acc = None
        if keep:
            self.grad_acc = grad
            return None
        if grad is None or self.layout.wire_is_layout:  # wire order is the parameter's (to_wire: itself)
            return grad
        return self.layout.to_wire(grad)

    def zero_grad_for_reduce(self) -> torch.Tensor:
        """Zeros in the reduce dtype, shaped like ``take_unsharded_grad``'s result (shard dim first): what a
        rank without a gradient for this parameter contributes to the group's reduction."""
        shape = self.layout.rule.wire_shape(self.layout.global_shape)
        return torch.zeros(shape, dtype=self.policy.reduce_dtype, device=self.local_shard().device)

    def _whole_grad(self) -> torch.Tensor | None:
        """Stage 1: the whole gradient (dp shape, stored dtype) whose rows the sharded ``.grad`` views, or
        ``None`` when ``.grad`` is not such a view (``None``, or replaced by the user)."""
        grad = self.sharded.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else None
        base = local._base if local is not None else None
        if base is None or base.dtype != local.dtype or tuple(base.shape) != self.layout.global_shape:
            return None
        rows = self.layout.local_piece(base, self.shard_rank)
        same = (rows.data_ptr() == local.data_ptr() and rows.shape == local.shape
                and rows.stride() == local.stride())
        return base if same else None

    def accumulate_whole_grad(self, whole: torch.Tensor) -> None:
        """Stage 1: add the all-reduced whole gradient (wire order: shard dim first, e.g. a piece of the
        all-reduce buffer) into the whole gradient kept on this rank, whose rows (this rank's shard, a view)
        are the sharded ``.grad``. Per rank: the dp shape's elements in the stored dtype.

        ``zero_grad(set_to_none=False)`` (the optimizer's or the module's) zeroes ``.grad``, i.e. this rank's
        rows only: when ``.grad`` changed in place since perparam last wrote the whole gradient (the
        DTensor's version counter; under ``update="owner"`` also the rows' digest, since a foreach zeroing
        moves no counter: a local decision, no collective depends on it) and this rank's rows are
        all zero (none, for an empty shard), the whole gradient is zeroed before the sum is added, so every
        row holds this backward's gradient, not earlier steps'. (Not seen: a foreach zeroing on an owner whose
        rows are empty or were zero already.) Rows changed in place to anything else
        (scaled by the user) leave the other rows as perparam wrote them."""
        whole = self.layout.from_wire(whole.view(self.layout.rule.wire_shape(self.layout.global_shape)))
        kept = self._whole_grad()
        if kept is not None:
            grad = self.sharded.grad  # an in-place op on it bumps its own counter (not the local tensor's)
            rows = grad._local_tensor
            if grad._version != self._whole_version:
                if not rows.any():
                    kept.zero_()  # zeroed through .grad: the rows of the other ranks too
                kept.add_(whole)
            elif self._whole_digest is not None:  # update="owner": its whole may be stepped, so a foreach
                # zeroing (``torch._foreach_zero_`` moves no DTensor's counter) is told by the rows' digest,
                # on the device: all zero now and not what perparam wrote
                zero = (rows.count_nonzero() == 0) & (rows_digest(rows) != self._whole_digest)
                kept.add_(whole)
                torch.where(zero, whole if whole.dtype == kept.dtype else whole.to(kept.dtype), kept, out=kept)
            else:
                kept.add_(whole)
            self._whole_version = grad._version
            self._note_whole(kept)
            return
        grad = self.sharded.grad
        if grad is not None:  # a .grad of the user's: add this rank's rows to it
            grad._local_tensor.add_(self.layout.local_piece(whole, self.shard_rank))
            return
        kept = torch.empty(self.layout.global_shape, dtype=self.sharded.dtype, device=whole.device)
        kept.copy_(whole)  # its own storage: ``whole`` may view the reduction's buffer
        if self._grad_spec is None:
            self._grad_spec = _spec(self.mesh, self.placements, self.global_shape, self.sharded.dtype)
        rows = self.layout.local_piece(kept, self.shard_rank)
        self.sharded.grad = _dtensor(rows, self.mesh, self.placements, self.global_shape, self._grad_spec)
        self._whole_version = self.sharded.grad._version
        self._note_whole(kept)

    def _note_whole(self, kept: torch.Tensor) -> None:
        """Under ``update="owner"``: the digest of this rank's rows of the whole gradient just written."""
        if self.policy.update == "owner":
            self._whole_digest = rows_digest(self.layout.local_piece(kept, self.shard_rank))

    def grad_is_own(self, grad) -> bool:
        """``grad`` (the sharded ``.grad``) is one perparam built (``accumulate_sharded_grad`` or
        ``accumulate_whole_grad``, then changed in place or not): a DTensor of this parameter's mesh,
        placements and stored dtype whose local tensor has the local shard's shape. Told by its spec, the
        object perparam gives every gradient of this parameter (a DTensor op's result gets a new one)."""
        return self._grad_spec is not None and getattr(grad, "_spec", None) is self._grad_spec

    def accumulate_sharded_grad(self, local_grad: torch.Tensor, divisor: float | None = None) -> None:
        """Add this rank's reduced gradient (shard dim first) into the sharded ``.grad``; ``divisor``: divide
        it by that first (``None``: divided already), bit for bit as a division followed by a cast to the
        stored dtype and an addition, in fewer passes: the cast in the division's pass (``out=``), and
        for a power-of-two divisor added to an existing ``.grad`` of the reduce dtype as ``alpha=1/divisor``
        (``x / 2**m == x * 2**-m`` exactly; fused with the addition it equals dividing first unless
        ``x / 2**m`` is subnormal). ``local_grad`` may be overwritten (it is the reduction's buffer)."""
        if not self.layout.wire_is_layout:  # (else from_wire is the tensor itself)
            local_grad = self.layout.from_wire(local_grad, contiguous=True)
        dtype = self.sharded.dtype
        grad = self.sharded.grad
        tier = self.offload
        if grad is not None and tier is not None:
            tier.grad_in()  # an evicted gradient shard read back before adding to it
        if grad is not None and divisor is not None and local_grad.dtype == dtype and _power_of_two(divisor):
            grad._local_tensor.add_(local_grad, alpha=1.0 / divisor)  # one pass: divide and add
            divisor = local_grad = None
        elif divisor is not None:  # one pass: divide and cast
            out = local_grad if local_grad.dtype == dtype else torch.empty_like(local_grad, dtype=dtype)
            local_grad = torch.div(local_grad, divisor, out=out)
        elif local_grad.dtype != dtype:
            local_grad = local_grad.to(dtype)
        if grad is None:
            if self._grad_spec is None:
                self._grad_spec = _spec(self.mesh, self.placements, self.global_shape, self.sharded.dtype)
            if tier is not None:
                local_grad = tier.grad_new(local_grad)  # in the gradient shard's file, when it has one
            self.sharded.grad = _dtensor(local_grad, self.mesh, self.placements, self.global_shape, self._grad_spec)
        elif local_grad is not None:
            grad._local_tensor.add_(local_grad)
        if tier is not None:
            tier.grad_out()  # written out and dropped until the step's read-ahead
