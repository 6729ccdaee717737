"""Gradients reduced straight to their owner (``paths.reduce_owner``, ``configure(owner_grad="owner")``): what
each rank's sharded ``.grad`` holds between backward and the optimizer step.

On the owner, the whole reduced gradient (the parameter's shape, its stored dtype, storage of its own), and
``.grad`` a DTensor over this rank's rows of it (a view, as stage 1's). On every other rank of the shard
axis, ``.grad`` is a DTensor of its rows' shape filled with NaN: those rows were never reduced there, and
NaN makes anything that reads them (a norm, a clip through torch) loudly wrong instead of silently.
``perparam.clip_grad_norm_`` counts and scales the owner's whole gradient instead (``clip_view``, then
``refresh``); any other change of the owner's rows before the step is refused there (``check_untouched``).
Each such ``.grad`` is recorded by identity, so a ``.grad`` set to ``None`` or replaced is no longer one.

Accumulation over backwards without ``zero_grad`` adds into the owner's whole gradient; a
``zero_grad(set_to_none=False)`` zeroes only the owner's rows, so when those are all zero and differ from
what the reduction wrote (``rows_digest``), the whole gradient is zeroed first (as stage 1's).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..sharding.errors import ShardingError
from .param_grads import _dtensor, _spec, rows_digest


class OwnerStepError(ShardingError, RuntimeError):
    """A step the owner path cannot route (a ``step(closure)``, a gradient of another dtype, placement or
    kind)."""


#: sharded ``.grad`` DTensor -> [whole gradient on the owner or None elsewhere, digest of the owner's rows,
#: the owner's rank it was reduced to]
_HELD: WeakIdKeyDictionary = WeakIdKeyDictionary()


def at_owner(sp) -> bool:
    """``sp``'s current ``.grad`` came from a reduction to its owner (the same answer on every rank)."""
    grad = sp.sharded.grad
    return grad is not None and grad in _HELD


def whole(sp) -> torch.Tensor | None:
    """On ``sp``'s owner, the whole reduced gradient it holds (``None`` elsewhere, or when none is held)."""
    grad = sp.sharded.grad
    entry = _HELD.get(grad) if grad is not None else None
    return entry[0] if entry is not None else None


def reduced_to(sp) -> int:
    """The rank ``sp``'s held gradient was reduced to (``at_owner(sp)`` must hold)."""
    return _HELD[sp.sharded.grad][2]


def clip_view(grad) -> torch.Tensor | None:
    """For ``perparam.clip_grad_norm_``: ``None`` when ``grad`` (a sharded ``.grad``) is not one reduced to its
    owner; else the tensor whose elements count for the norm and are scaled, the whole gradient on the
    owner and an empty tensor elsewhere."""
    entry = _HELD.get(grad)
    if entry is None:
        return None
    return entry[0] if entry[0] is not None else grad._local_tensor.new_empty(0)


def refresh(grad) -> None:
    """After ``perparam.clip_grad_norm_`` scaled the whole gradient held for ``grad`` (``clip_view``): record
    the owner's rows as they are now, so ``check_untouched`` accepts them."""
    entry = _HELD.get(grad)
    if entry is not None and entry[0] is not None:
        entry[1] = rows_digest(grad._local_tensor)


def check_untouched(sp) -> None:
    """On ``sp``'s owner, before its step: raise ``OwnerStepError`` when the owner's rows of ``.grad`` were
    changed since the reduction wrote them (``torch.nn.utils.clip_grad_norm_``, a GradScaler-style unscale,
    ``p.grad.mul_``, a post-accumulate-grad hook writing it): that changed only the owner's rows, not the
    whole gradient the step reads, and on the other ranks the rows are NaN. Rows all zero
    (``zero_grad(set_to_none=False)``) zero the whole gradient instead. The owner step raises it on every
    rank of the axis (``OwnerStepRaised``)."""
    grad = sp.sharded.grad
    entry = _HELD.get(grad) if grad is not None else None
    if entry is None or entry[0] is None:
        return
    rows = grad._local_tensor
    if torch.equal(rows_digest(rows), entry[1]):
        return
    if not rows.any():
        entry[0].zero_()
        entry[1] = rows_digest(rows)
        return
    raise OwnerStepError(f"parameter '{sp.fqn}': its .grad was changed after backward (torch.nn.utils."
                         "clip_grad_norm_, a GradScaler unscale, p.grad.mul_, a hook?), but under "
                         "perparam.configure(owner_grad='owner') .grad holds only the owner's rows of the whole "
                         "gradient (NaN on the other ranks) and the step reads the whole; clip with "
                         "perparam.clip_grad_norm_ (it scales the whole), or keep configure(owner_grad='rows') "
                         "to read or scale .grad before the step")


def accumulate(sp, reduced: torch.Tensor | None) -> None:
    """Add the reduction's result into ``sp``'s gradient: ``reduced`` the whole summed and divided gradient in
    wire order (a view of the reduction's buffer) on the owner, ``None`` on the others. Raises
    ``OwnerStepError`` (on every rank alike) when ``.grad`` holds a gradient of another kind (one
    reduce-scattered before the owners were planned, or the user's)."""
    lay, p = sp.layout, sp.sharded
    grad = p.grad
    entry = _HELD.get(grad) if grad is not None else None
    if grad is not None and entry is None:
        raise OwnerStepError(f"parameter '{sp.fqn}' has its gradient reduced to its owner (configure(owner_grad="
                             "'owner')) but its .grad holds a gradient of another kind (reduce-scattered before its "
                             "owner was planned at the optimizer's first step, or assigned); call zero_grad() "
                             "after each step")
    if reduced is not None:
        reduced = lay.from_wire(reduced.view(lay.rule.wire_shape(lay.global_shape)))
    if entry is not None:
        held = entry[0]
        if held is None:
            grad._local_tensor.fill_(float("nan"))
            return
        rows = lay.local_piece(held, sp.shard_rank)
        if not torch.equal(rows_digest(rows), entry[1]) and not rows.any():
            held.zero_()  # zero_grad(set_to_none=False) zeroed the owner's rows: the others' too
        held.add_(reduced)
        entry[1] = rows_digest(rows)
        return
    if sp._grad_spec is None:
        sp._grad_spec = _spec(sp.mesh, sp.placements, sp.global_shape, p.dtype)
    if reduced is not None:
        held = torch.empty(lay.global_shape, dtype=p.dtype, device=reduced.device)
        held.copy_(reduced)  # its own storage: ``reduced`` views the reduction's buffer
        rows = lay.local_piece(held, sp.shard_rank)
    else:
        held = None
        rows = torch.full(lay.local_shape(sp.shard_rank), float("nan"), dtype=p.dtype, device=p._local_tensor.device)
    p.grad = _dtensor(rows, sp.mesh, sp.placements, sp.global_shape, sp._grad_spec)
    _HELD[p.grad] = [held, rows_digest(rows) if held is not None else None, sp.owner_rank]
