"""Gradients reduced straight to their owner (``paths.reduce_owner``, ``configure(owner_grad="owner")``): what
each rank's sharded ``.grad`` holds between backward and the optimizer step.

On the owner, the whole reduced gradient (the parameter's shape, its stored dtype, storage of its own), and
``.grad`` a DTensor over this rank's rows of it (a view, as stage 1's). On every other rank of the shard
axis, ``.grad`` is a DTensor of its rows' shape filled with NaN: those rows were never reduced there, and
NaN makes anything that reads them (a norm, a clip through torch) loudly wrong instead of silently.
``perparam.clip_grad_norm_`` counts and scales the owner's whole gradient instead (``clip_view``, then
``refresh``); any other change of the owner's rows before the step is refused there (``check_untouched``).
Each such ``.grad`` is recorded by identity, so a ``.grad`` set to ``None`` or replaced is no longer one.

Accumulation over backwards without ``zero_grad`` adds into the owner's whole gradient. A
``zero_grad(set_to_none=False)`` zeroes each rank's rows of ``.grad`` only, not the owner's whole gradient,
and the owner alone cannot always tell (its rows may be empty or zero already; ``torch._foreach_zero_``, an
optimizer's ``foreach`` zeroing, bumps no version counter of a DTensor). So every rank witnesses its own
rows (``zeroed``: all zero, and changed since perparam wrote them, by version or digest), the reduction to
the owners carries one flag per parameter from each rank (``paths.reduce_owner``), and the owner takes the
reduced gradient alone, not added, where any rank's flag is set: decided from the same summed flags on
every rank, on the device (no host read), bit for bit a fresh gradient.

The first step of an optimizer (the one that plans the owners) steps gradients reduce-scattered as rows;
``remember`` keeps the owner's whole gradient assembled for that step, so the next reduction to the owner
adds onto it (accumulation over the step) or, zeroed in place, replaces it, as for a held one.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..sharding.errors import ShardingError
from .dtensors import dtensor_spec, local_dtensor, rows_digest


class OwnerStepError(ShardingError, RuntimeError):
    """A step the owner path cannot route (a ``step(closure)``, a gradient of another dtype, placement or
    kind)."""


class HeldGrad:
    """What a sharded ``.grad`` of an owner parameter stands for: ``whole``, the whole gradient on the owner
    (``None`` elsewhere); ``digest``, of this rank's rows when perparam wrote them (``None``: rows filled with
    NaN by perparam, which are never all zero unless empty); ``owner``, the rank it was reduced to;
    ``version``, the ``.grad`` DTensor's version counter then (an in-place op through it bumps it; a foreach
    op does not)."""

    __slots__ = ("whole", "digest", "owner", "version", "intact")

    def __init__(self, whole, digest, owner: int, version: int) -> None:
        self.whole, self.digest, self.owner, self.version = whole, digest, owner, version
        self.intact = None  # between clip_view and refresh: the rows' bits were perparam's (0-dim bool)


class OwnerGradRecords:
    """The gradients of one ``update="owner"`` parameter that perparam wrote, by identity and weakly (nothing
    here keeps a gradient alive; a ``.grad`` set to ``None`` or replaced is no longer one): ``held``, sharded
    ``.grad`` DTensor -> ``HeldGrad`` of a gradient reduced to its owner; ``prior``, sharded ``.grad`` (rows,
    reduce-scattered) -> ``HeldGrad`` of its whole as assembled on the owner for a step (``remember``), which
    the next reduction to the owner accumulates onto. Owned by the parameter (``ShardedParam.owner_grads``),
    made at its first such gradient."""

    __slots__ = ("held", "prior")

    def __init__(self) -> None:
        self.held: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.prior: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _records(sp) -> OwnerGradRecords:
    records = sp.owner_grads
    if records is None:
        records = sp.owner_grads = OwnerGradRecords()
    return records


def _held(sp, grad) -> HeldGrad | None:
    """The record of ``grad`` (``sp``'s sharded ``.grad`` or ``None``) as a gradient reduced to its owner."""
    records = sp.owner_grads
    return None if grad is None or records is None else records.held.get(grad)


_READ = object()


def at_owner(sp, grad=_READ) -> bool:
    """``sp``'s current ``.grad`` (``grad``, when the caller read it already) came from a reduction to its
    owner (the same answer on every rank)."""
    if grad is _READ:
        grad = sp.sharded.grad
    records = sp.owner_grads  # (``_held`` inline: asked once per owner parameter per step)
    return grad is not None and records is not None and grad in records.held


def whole(sp) -> torch.Tensor | None:
    """On ``sp``'s owner, the whole reduced gradient it holds (``None`` elsewhere, or when none is held)."""
    entry = _held(sp, sp.sharded.grad)
    return entry.whole if entry is not None else None


def reduced_to(sp) -> int:
    """The rank ``sp``'s held gradient was reduced to (``at_owner(sp)`` must hold)."""
    return sp.owner_grads.held[sp.sharded.grad].owner


def clip_view(sp, grad) -> torch.Tensor | None:
    """For ``perparam.clip_grad_norm_``: ``None`` when ``grad`` (``sp``'s sharded ``.grad``) is not one
    reduced to its owner; else the tensor whose elements count for the norm and are scaled, the whole
    gradient on the owner and an empty tensor elsewhere."""
    entry = _held(sp, grad)
    if entry is None:
        return None
    if entry.whole is None:
        return grad._local_tensor.new_empty(0)
    entry.intact = rows_digest(grad._local_tensor) == entry.digest  # before the clip scales (``refresh``)
    return entry.whole


def refresh(sp, grad) -> None:
    """After ``perparam.clip_grad_norm_`` scaled the whole gradient held for ``grad`` (``clip_view``): record
    the owner's rows as they are now, so ``check_untouched`` accepts them, unless they had been changed
    before the clip (an unscale, torch's clip: ``clip_view`` compared them): then the record stays one they
    cannot match, and the step refuses (on the device, no host read)."""
    entry = _held(sp, grad)
    if entry is not None and entry.whole is not None:
        now = rows_digest(grad._local_tensor)
        entry.digest = now if entry.intact is None else torch.where(entry.intact, now, now + 1)
        entry.intact = None


def check_untouched(sp) -> None:
    """On ``sp``'s owner, before its step: raise ``OwnerStepError`` when the owner's rows of ``.grad`` were
    changed since the reduction wrote them (``torch.nn.utils.clip_grad_norm_``, a GradScaler-style unscale,
    ``p.grad.mul_``, a post-accumulate-grad hook writing it): that changed only the owner's rows, not the
    whole gradient the step reads, and on the other ranks the rows are NaN. Rows all zero
    (``zero_grad(set_to_none=False)`` between backward and the step) zero the whole gradient instead. The
    owner step raises it on every rank of the axis (``OwnerStepRaised``)."""
    grad, records = sp.sharded.grad, sp.owner_grads
    entry = None if grad is None or records is None else records.held.get(grad)  # (``_held`` inline)
    if entry is None or entry.whole is None:
        return
    rows = grad._local_tensor
    if torch.equal(rows_digest(rows), entry.digest):
        return
    if not rows.any():
        entry.whole.zero_()
        entry.digest = rows_digest(rows)
        return
    raise OwnerStepError(f"parameter '{sp.path}': its .grad was changed after backward (torch.nn.utils."
                         "clip_grad_norm_, a GradScaler unscale, p.grad.mul_, a hook?), but under "
                         "perparam.configure(owner_grad='owner') .grad holds only the owner's rows of the "
                         "whole gradient (NaN on the other ranks) and the step reads the whole; clip with "
                         "perparam.clip_grad_norm_ (it scales the whole), or keep "
                         "configure(owner_grad='rows') to read or scale .grad before the step")


def remember(sp, whole_grad: torch.Tensor | None) -> None:
    """At an optimizer step whose gradient rows of ``sp`` travelled to the owner (reduce-scattered: the step
    that planned the owners): keep ``whole_grad`` (the whole gradient the owner assembled; ``None`` on the
    other ranks) for ``sp``'s current ``.grad``, so a later reduction to the owner accumulates onto it
    (``accumulate``). Called on every rank alike; nothing visible changes."""
    grad = sp.sharded.grad
    records = _records(sp)
    if grad is None or grad in records.held:
        return
    records.prior[grad] = HeldGrad(whole_grad, rows_digest(grad._local_tensor), sp.owner_rank, grad._version)


def _zeroed(grad, entry: HeldGrad) -> torch.Tensor | None:
    """This rank's witness that ``grad`` (standing for ``entry``) was zeroed in place since perparam wrote it:
    its rows all zero (none: an empty shard) and changed (its version, or its digest, or NaN rows now not
    NaN); a 0-dim bool on the device, ``None`` for no."""
    rows = grad._local_tensor
    zero = rows.count_nonzero() == 0
    if grad._version != entry.version:
        return zero
    if entry.digest is None:  # perparam's NaN rows: all zero only where a write zeroed them
        return zero if rows.numel() else None
    return zero & (rows_digest(rows) != entry.digest)


def witness(sp, dtype: torch.dtype) -> torch.Tensor:
    """``[1]`` of ``dtype``: 1 where this rank sees that the held ``.grad`` of ``sp`` (``at_owner(sp)``) was
    zeroed in place since the reduction to its owner wrote it (``_zeroed``: its rows all zero and changed),
    else 0; sent to the owner in the step's gather (``owner_exchange.gather``), so an owner holding no rows of
    the matrix learns of a zeroing between backward and the step from its peers. On the device."""
    grad = sp.sharded.grad
    seen = _zeroed(grad, sp.owner_grads.held[grad])
    if seen is None:
        return torch.zeros(1, dtype=dtype, device=grad._local_tensor.device)
    return seen.reshape(1).to(dtype)


def zero_if_witnessed(sp, witnessed: torch.Tensor) -> None:
    """On ``sp``'s owner, with ``witnessed`` the peers' ``witness`` flags summed (0-dim, on the device): the
    held whole gradient becomes zero where a peer saw its rows zeroed in place, selected on the device."""
    held = sp.owner_grads.held[sp.sharded.grad].whole
    held.masked_fill_((witnessed > 0).reshape([1] * held.dim()), 0)


def zeroed_flags(params, dtype: torch.dtype, device) -> torch.Tensor | None:
    """``[len(params)]`` of ``dtype``: 1 where this rank witnesses that the ``.grad`` of a parameter of
    ``params`` (reduced to its owner) was zeroed in place since perparam wrote it (``zeroed``), else 0, for
    the reduction to the owners to sum over the ranks; ``None`` when none is (all zeros)."""
    flags = []
    for sp in params:
        grad, records = sp.sharded.grad, sp.owner_grads
        entry = None if grad is None or records is None else records.held.get(grad, records.prior.get(grad))
        flags.append(None if entry is None else _zeroed(grad, entry))
    if all(f is None for f in flags):
        return None
    no = torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([no if f is None else f for f in flags]).to(dtype)


def _add(held: torch.Tensor, reduced: torch.Tensor, zeroed: torch.Tensor | None) -> None:
    """``held += reduced``, or ``held = reduced`` where ``zeroed`` (a summed flag on the device) is > 0:
    selected on the device, bit for bit a fresh gradient."""
    if reduced.dtype != held.dtype:
        reduced = reduced.to(held.dtype)
    held.add_(reduced)
    if zeroed is not None:
        torch.where(zeroed > 0, reduced, held, out=held)


def accumulate(sp, reduced: torch.Tensor | None, zeroed: torch.Tensor | None = None) -> None:
    """Add the reduction's result into ``sp``'s gradient: ``reduced`` the whole summed and divided gradient in
    wire order (a view of the reduction's buffer) on the owner, ``None`` on the others; ``zeroed`` the
    reduction's summed flag that some rank's ``.grad`` was zeroed in place (``zeroed_flags``): the owner then
    takes ``reduced`` alone. A ``.grad`` kept for a step (``remember``) is accumulated onto. Raises
    ``OwnerStepError`` (on every rank alike) when ``.grad`` holds a gradient of another kind (the user's)."""
    lay, p = sp.layout, sp.sharded
    grad, records = p.grad, _records(sp)
    entry = records.held.get(grad) if grad is not None else None
    prior = records.prior.pop(grad, None) if grad is not None and entry is None else None
    if grad is not None and entry is None and prior is None:
        raise OwnerStepError(f"parameter '{sp.path}' has its gradient reduced to its owner "
                             "(configure(owner_grad='owner')) but its .grad holds a gradient of another kind "
                             "(assigned, or reduce-scattered and never stepped by the optimizer that planned "
                             "its owner); call zero_grad() after each step")
    if reduced is not None:
        reduced = lay.from_wire(reduced.view(lay.rule.wire_shape(lay.global_shape)))
    if entry is not None:
        if entry.whole is None:
            grad._local_tensor.fill_(float("nan"))
        else:
            _add(entry.whole, reduced, zeroed)
            entry.digest = rows_digest(grad._local_tensor)
        entry.version = grad._version
        return
    if sp._grad_spec is None:
        sp._grad_spec = dtensor_spec(sp.mesh, sp.placements, sp.global_shape, p.dtype)
    if reduced is not None and prior is not None and prior.whole is not None:
        held = prior.whole  # the whole the step assembled (its own storage): accumulated onto, or replaced
        _add(held, reduced, zeroed)
        rows = lay.local_piece(held, sp.shard_rank)
    elif reduced is not None:
        held = torch.empty(lay.global_shape, dtype=p.dtype, device=reduced.device)
        held.copy_(reduced)  # its own storage: ``reduced`` views the reduction's buffer
        rows = lay.local_piece(held, sp.shard_rank)
    else:
        held = None
        rows = torch.full(lay.local_shape(sp.shard_rank), float("nan"), dtype=p.dtype,
                          device=p._local_tensor.device)
    p.grad = local_dtensor(rows, sp.mesh, sp.placements, sp.global_shape, sp._grad_spec)
    digest = rows_digest(rows) if held is not None else None
    records.held[p.grad] = HeldGrad(held, digest, sp.owner_rank, p.grad._version)
