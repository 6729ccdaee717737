"""Checkpoints of the optimizer state of ``ParamPolicy(update="owner")`` parameters.

Between steps that state is whole and lives on the parameter's owner only (``owner_step``). A checkpoint
stores it in the form every other parameter's state has, so that it loads on any world size and under
any owner plan: a tensor of the parameter's shape (Muon's momentum) as a DTensor sharded like the
parameter, any other tensor (Adafactor's step count and row/column factors) as a plain tensor that every
rank holds, any other value as it is. ``sharded_state`` makes that form from the owners' state (the owner
sends each rank its rows, or the whole tensor); ``own_state`` turns a loaded one back (each rank sends its
rows to the parameter's owner under the current plan, the others drop the state). Both are collectives over
each bucket's shard axis, issued in the plan's order on every rank.

``install`` puts the same conversions into the optimizer's own ``state_dict()`` and ``load_state_dict()``
(torch's post-hooks), so ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and
``set_optimizer_state_dict`` (sharded or ``full_state_dict=True``) give and take an owner parameter's
state as every other parameter's: ``state_dict()`` is then a collective over the shard axes while an owner
is planned (call it on every rank, as DCP does; a call on some ranks only raises ``CollectiveTimeoutError``
after the group's timeout, ``comm.sequence.enter_together``, instead of leaving gloo's collective to time
out and break the group). A rank that owns none of an optimizer's parameters keeps an
empty state entry for each routed one (``owner_step``), so DCP's "initialise the state by a step with zero
gradients when it is empty" is decided alike on every rank. An optimizer's plan comes from its binding
(``perparam.runtime.optim.registry.routing``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..comm.collectives import all_gather_objects, exchange_uneven
from ..comm.peers import lost_peers
from ..comm.sequence import enter_together
from .optim.registry import routing


def _rows_from_owner(pg, e, whole: torch.Tensor | None, dtype: torch.dtype, device) -> torch.Tensor:
    """This rank's rows of the owner's ``whole`` (``None`` on the other ranks), a new tensor."""
    k, me, lay = pg.size(), pg.rank(), e.sp.layout
    send_splits = [lay.local_numel(r) if e.owner == me else 0 for r in range(k)]
    pieces = [lay.local_piece(whole, r).reshape(-1) for r in range(k)] if e.owner == me else []
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    recv_splits = [lay.local_numel(me) if r == e.owner else 0 for r in range(k)]
    work, recv = exchange_uneven(send, send_splits, recv_splits, pg, e.sp.sharded.numel() * dtype.itemsize,
                                 f"owner state rows of {e.sp.fqn}", async_op=False)
    return recv.view(lay.local_shape(me)).clone()


def _whole_from_owner(pg, e, whole: torch.Tensor | None, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The owner's ``whole`` on every rank."""
    k, me, n = pg.size(), pg.rank(), int(torch.Size(shape).numel())
    send = whole.reshape(-1).repeat(k) if e.owner == me else torch.empty(0, dtype=dtype, device=device)
    send_splits = [n if e.owner == me else 0 for _ in range(k)]
    recv_splits = [n if r == e.owner else 0 for r in range(k)]
    work, recv = exchange_uneven(send, send_splits, recv_splits, pg, n * dtype.itemsize,
                                 f"owner state of {e.sp.fqn}", async_op=False)
    return recv.view(shape).clone()


def _rows_to_owner(pg, e, local: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor from every rank's rows ``local``, on the owner (``None`` elsewhere)."""
    k, me, lay = pg.size(), pg.rank(), e.sp.layout
    send_splits = [local.numel() if r == e.owner else 0 for r in range(k)]
    recv_splits = [lay.local_numel(r) if e.owner == me else 0 for r in range(k)]
    work, recv = exchange_uneven(local.reshape(-1), send_splits, recv_splits, pg,
                                 e.sp.sharded.numel() * local.element_size(),
                                 f"owner state rows of {e.sp.fqn}", async_op=False)
    if e.owner != me:
        return None
    whole = torch.empty(e.sp.sharded.shape, dtype=local.dtype, device=local.device)
    offset = 0
    for r in range(k):
        n = lay.local_numel(r)
        lay.local_piece(whole, r).copy_(recv[offset:offset + n].view(lay.local_shape(r)))
        offset += n
    return whole


def sharded_state(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """id(sharded parameter) -> its state in checkpoint form, for ``optimizer``'s owner parameters, the
    same keys on every rank (a collective; empty when it routes none)."""
    route = routing(optimizer)
    out: dict[int, dict] = {}
    if route is None:
        return out
    for bucket in route.buckets:
        pg = bucket.group
        me = pg.rank()
        mine = {}
        for i, e in enumerate(bucket.entries):
            if e.owner == me:
                shape = tuple(e.sp.sharded.shape)
                mine[i] = {k: (("rows" if tuple(v.shape) == shape else "whole"), tuple(v.shape), v.dtype)
                           if isinstance(v, torch.Tensor) else ("value", v)
                           for k, v in optimizer.state.get(e.sp.sharded, {}).items()}
        described: dict = {}
        for theirs in all_gather_objects(mine, pg):
            described.update(theirs)
        for i, e in enumerate(bucket.entries):
            p = e.sp.sharded
            held = optimizer.state.get(p, {}) if e.owner == me else {}
            state = {}
            for key in sorted(described.get(i, {})):
                kind, *rest = described[i][key]
                if kind == "value":
                    state[key] = rest[0]
                    continue
                shape, dtype = rest
                device = p._local_tensor.device
                if kind == "rows":
                    local = _rows_from_owner(pg, e, held.get(key), dtype, device)
                    spec = DTensorSpec(p.device_mesh, p.placements,
                                       tensor_meta=TensorMeta(p.shape, p.stride(), dtype))
                    state[key] = DTensor(local, spec, requires_grad=False)
                else:
                    state[key] = _whole_from_owner(pg, e, held.get(key), shape, dtype, device)
            out[id(p)] = state
    return out


def own_state(optimizer: torch.optim.Optimizer, restore: list[tuple[torch.Tensor, dict]]) -> None:
    """Turn the loaded checkpoint-form states of ``restore`` (``(sharded parameter, state)`` pairs, the same
    keys on every rank) of ``optimizer``'s owner parameters into owner form, in place: whole on the
    owner under the current plan, empty elsewhere (a collective)."""
    route = routing(optimizer)
    if route is None:
        return
    states = {id(p): state for p, state in restore}
    for bucket in route.buckets:
        pg = bucket.group
        for e in bucket.entries:
            state = states.get(id(e.sp.sharded))
            if state is None:
                continue
            mine = e.owner == pg.rank()
            for key in sorted(state):
                value = state[key]
                if isinstance(value, DTensor):
                    state[key] = _rows_to_owner(pg, e, value._local_tensor)
            if not mine:
                state.clear()


def install(optimizer: torch.optim.Optimizer) -> None:
    """Called once per optimizer that routes owner parameters (by its binding, ``perparam.runtime.optim``):
    its ``state_dict()`` gives their state in checkpoint form (``sharded_state``), its ``load_state_dict()``
    turns a loaded checkpoint-form state back onto the owners (``own_state``)."""
    # their exchanges are collectives: a peer gone meanwhile raises PeerLostError
    optimizer.register_state_dict_post_hook(lost_peers("optimizer.state_dict()")(_state_dict_post))
    optimizer.register_load_state_dict_pre_hook(
        lost_peers("optimizer.load_state_dict()")(_load_state_dict_pre))
    optimizer.register_load_state_dict_post_hook(
        lost_peers("optimizer.load_state_dict()")(_load_state_dict_post))


def _state_dict_post(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict["state"]`` (keyed by the parameters' indices in ``param_groups`` order) with each owner
    parameter's entry in checkpoint form, the same keys on every rank (none where no rank holds state)."""
    route = routing(optimizer)
    if route is None:
        return state_dict
    _enter_together(route, "optimizer.state_dict()",
                    "call optimizer.state_dict() on every rank (then save it "
                    "on one: sd = opt.state_dict(); if rank == 0: torch.save(sd, path)), as DCP's "
                    "get_optimizer_state_dict does; its owner parameters' state is gathered from their "
                    "owners")
    index: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    state = state_dict["state"]
    for pid, form in sharded_state(optimizer).items():
        if form:
            state[index[pid]] = form
        else:
            state.pop(index[pid], None)
    # in index order: DCP gathers the DTensors in the dict's order, which must be the same on every rank
    state_dict["state"] = {i: state[i] for i in sorted(state, key=lambda k: (0, k, "") if isinstance(k, int)
                                                       else (1, 0, str(k)))}
    return state_dict


def _load_state_dict_pre(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Before ``load_state_dict`` changes anything: every rank is loading (a call on some ranks only raises
    ``CollectiveTimeoutError`` there with the optimizer as it was, instead of a state half in checkpoint
    form that the next step would trip over)."""
    route = routing(optimizer)
    if route is not None:
        _enter_together(route, "optimizer.load_state_dict()",
                        "call optimizer.load_state_dict() on every rank "
                        "with the same state dict; its owner parameters' state is sent to their owners")


def _load_state_dict_post(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` (every rank reached it: ``_load_state_dict_pre``): the owner parameters'
    loaded states (checkpoint form: DTensors sharded like the parameter, whole tensors on every rank) whole
    on their owners, empty elsewhere."""
    route = routing(optimizer)
    if route is None:
        return
    restore = [(e.sp.sharded, optimizer.state[e.sp.sharded]) for b in route.buckets for e in b.entries
               if e.sp.sharded in optimizer.state]
    own_state(optimizer, restore)


def _enter_together(route, what: str, fix: str) -> None:
    """Every rank of each bucket's shard axis reached ``what`` (in bucket order, as the collectives go)."""
    seen = []
    for bucket in route.buckets:
        if all(bucket.group is not g for g in seen):
            seen.append(bucket.group)
            enter_together(bucket.group, what, fix)


def routed_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """id() of the sharded parameters ``optimizer`` routes to owners (empty when none)."""
    route = routing(optimizer)
    return set(route.by_id) if route is not None else set()
