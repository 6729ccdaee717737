"""The owner path of whole-matrix optimizers (``ParamPolicy(update="owner")``): one rank steps each whole
parameter with the stock optimizer; the others skip it.

Gradients are reduce-scattered after backward as for every parameter. Then, inside the optimizer's step
(the ``OwnerRoute`` stage of its binding, ``perparam.runtime.optim``), for the parameters it holds under the
owner policy:

1. the owners come from ``perparam.sharding.owners.owner_plan`` over the optimizer's owner parameters of
   each shard axis, in the optimizer's parameter order (the same on every rank), planned when
   the ``Retarget`` stage first checks the optimizer (again when its parameters change: parameters
   planned before keep their owners, which hold their state, and new ones fill in by LPT);
2. per bucket (the parameters of one shard-axis process group and dtype, consecutive in that order, at
   most ``BUCKET_BYTES`` of whole gradient plus parameter), one all-to-all brings each rank's rows of the
   parameter, and of the reduced gradient where the owner does not hold it whole already (a stage-1
   gradient intact on every rank, a gradient reduced to the owner: ``owner_exchange``), to the owner,
   which assembles the whole tensors (``layout.local_piece`` of each source rank);
3. the owner runs the optimizer's own step function (the class's ``step`` without torch's hook wrapper) on
   that bucket's whole tensors alone (each group narrowed to them, their state re-keyed to them), while
   the next bucket's all-to-all is in flight; the other ranks skip the bucket. The owner's update is bit
   for bit the step the optimizer takes on one device from the same gradient and state;
4. one all-to-all per bucket sends each rank its rows of the updated parameters (each piece led by one
   element: 1 when the sender's step raised), posted right after the bucket's step and not waited for
   there: the next bucket's step runs while it is in flight, so a rank that finished a bucket early does
   not wait for the slowest owner of each bucket, only once, after the last (the plan balances the
   ranks' whole steps, not each bucket; what waiting per bucket cost: ``muon_step`` in
   ``benchmarks/README.md``). The bucket's whole tensors are dropped once its rows are in
   the send buffer. After the last bucket's step every scatter is waited for, every owner's flag read at
   once, and the rows copied into the shards in place (``owner_exchange.land``). The exchanges' send
   and receive buffers come from a ``BufferPool`` of its own kept with the plan (``perparam.comm.buffers``,
   smallest fit): touched once, reused by every later step (a fresh buffer page-faults in each time; its cost
   per step: ``muon_step`` in ``benchmarks/README.md``). The step proper then
   runs with the routed parameters left out of ``param_groups`` (put back by the post-hook). The state of
   an owner parameter stays whole, keyed by the sharded parameter, on the owner only (about 1/K of the
   matrices' momentum per rank; an empty entry elsewhere, ``owner_state``); the step is counted on the
   parameters as any step (``ShardedParam.optimizer_steps``), so stage-1/2 kept copies are refreshed.

A step that raises on an owner is raised on every rank of the axis (``OwnerStepRaised``, the owner's
exception its cause) after the exchange, the raising owner's rows not copied: the flags of all buckets are
read back once per step (``owner_exchange.land``).

Bytes on the wire per ``m x n`` matrix: ``(K-1)/K m n`` elements of parameter rows in, ``(K-1)/K m n``
out, and ``(K-1)/K m n`` of gradient rows in where they travel: ``3 (K-1)/K m n`` after a reduce-scatter,
``2 (K-1)/K m n`` when the owner holds the whole gradient (``owner_exchange``). Every rank issues the same
all-to-alls, in the same order, whatever it owns (a rank with empty shards sends empty pieces); a parameter
without a gradient (no rank used it: ``None`` on every rank alike) is left out of the exchange on every rank.

Memory: every bucket's scatter buffers (this rank's owned rows out, its own rows in: about ``2/K`` of the
matrices' bytes at the end of the step) are alive until the last bucket's step is done, and the pool keeps
what one step held at once between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm.buffers import BufferPool
from ..sharding.errors import ShardingError
from ..sharding.owners import NS_STEPS, ns_cost, owner_plan
from . import config, owner_exchange, owner_grads, registration, whole_matrix
from .optim import registry
from .optim.step import GradKind
from .owner_exchange import OwnerStepError

__all__ = ["BUCKET_BYTES", "OwnerStepError", "OwnerStepRaised", "WholeMatrixShardError", "check",
           "is_whole_matrix", "mixed_step_error", "owner_fix", "plan", "routing", "step_in", "step_out",
           "unrouted"]

#: at most this many bytes of whole gradient plus whole parameter per exchange (a larger parameter alone)
BUCKET_BYTES = 64 * 2**20



class OwnerStepRaised(RuntimeError):
    """The optimizer's own step raised on an owner rank: raised on every rank of that shard axis, naming the
    owner rank, the parameters it stepped and the exception (on the owner its ``__cause__``)."""


class WholeMatrixShardError(ShardingError, RuntimeError):
    """A whole-matrix optimizer (``is_whole_matrix``) holds a parameter sharded over more than one rank
    without ``ParamPolicy(update="owner")``: its step would be computed on row shards, silently wrong."""


#: the optimizers of ``torch.optim`` (2.13) whose update of a tensor reads the whole tensor, not each
#: element alone: Muon (Newton-Schulz on the matrix) and Adafactor (row and column means, the parameter's
#: and the update's norms). The others (SGD, Adam, AdamW, Adadelta, Adagrad, Adamax, ASGD, NAdam, RAdam,
#: RMSprop, Rprop, SparseAdam) are elementwise; LBFGS flattens every tensor (``adopt.FLATTENING_OPTIMIZERS``)
WHOLE_MATRIX_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name))

#: the class attribute a user's optimizer sets to declare its kind: ``True`` (its step reads whole
#: tensors: refused on sharded parameters unless they have ``update="owner"``), ``False`` (elementwise)
DECLARATION = "perparam_whole_matrix"


def is_whole_matrix(optimizer: torch.optim.Optimizer | type) -> bool:
    """Whether ``optimizer``'s step (an instance or its class) needs whole tensors: its class's
    ``perparam_whole_matrix`` when set, else whether it is one of ``WHOLE_MATRIX_OPTIMIZERS`` or of
    ``whole_matrix.KNOWN`` (or a subclass)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    declared = getattr(cls, DECLARATION, None)
    if declared is not None:
        return bool(declared)
    return issubclass(cls, WHOLE_MATRIX_OPTIMIZERS) or whole_matrix.known(cls)[0]


def unrouted(optimizer: torch.optim.Optimizer, held):
    """The first ``ShardedParam`` of ``held`` (in ``optimizer``'s order) a whole-matrix ``optimizer`` would
    step on a shard (sharded over more than one rank, not under the owner policy), or ``None``."""
    if not is_whole_matrix(optimizer):
        return None
    by_id = {id(sp.sharded): sp for sp in held}
    for group in optimizer.param_groups:
        if (getattr(type(optimizer), DECLARATION, None) is None
            and not whole_matrix.steps_whole(optimizer, group)):
            continue
        for sp in (by_id[id(p)] for p in group["params"] if id(p) in by_id):
            if sp.policy.update != "owner" and sp.layout.gathered and sp.layout.num_shards > 1:
                return sp
    return None


def owner_fix(sp) -> str:
    """The fix a refusal names for ``sp``: the owner policy (or an elementwise optimizer)."""
    return (f"Give it an owner rank that steps it whole: fully_shard(..., param_policy={{'{sp.fqn}': "
            "ParamPolicy(update='owner')}) (or a pattern such as '*.weight'), or step it with an elementwise "
            "optimizer (AdamW)")


def check(optimizer: torch.optim.Optimizer, held) -> None:
    """Raise ``WholeMatrixShardError`` for the first parameter (in ``optimizer``'s order) of ``held``
    (``ShardedParam``s) a whole-matrix ``optimizer`` would step on a shard: sharded over more than one rank,
    not under the owner policy. Decided from policies and mesh sizes, the same on every rank."""
    sp = unrouted(optimizer, held)
    if sp is None:
        return
    raise WholeMatrixShardError(
        f"{type(optimizer).__name__} computes each parameter's update from the whole tensor, and parameter "
        f"'{sp.path}' ({registration.class_name(sp.slots[0][0])}, shape {tuple(sp.global_shape)}) is sharded "
        f"over {sp.layout.num_shards} ranks: stepped on its shards the update is silently wrong. "
        f"{owner_fix(sp)}. A custom optimizer declares itself elementwise with the class attribute "
        f"{DECLARATION} = False")


def mixed_step_error(optimizer: torch.optim.Optimizer, sp, func,
                     error: BaseException) -> WholeMatrixShardError:
    """The error for ``optimizer``'s step raising DTensor's "got mixed torch.Tensor and DTensor" with
    ``sp`` (the parameter it was stepping, or the first sharded one it holds) sharded."""
    return WholeMatrixShardError(
        f"{type(optimizer).__name__}'s step failed on parameter '{sp.path}' ("
        f"{registration.class_name(sp.slots[0][0])}, shape {tuple(sp.global_shape)}), a DTensor over "
        f"{sp.layout.num_shards} rank(s): {getattr(func, '__name__', func)} got mixed torch.Tensor and "
        "DTensor (the step combines plain tensors with the parameter's shards, as an optimizer that reads "
        f"whole tensors does). {owner_fix(sp)}. A custom optimizer declares itself whole-matrix with the "
        f"class attribute {DECLARATION} = True (refused before its first step)")


@dataclass(frozen=True)
class Entry:
    sp: object  # the ShardedParam
    owner: int  # its owner's rank on the shard axis


@dataclass(frozen=True)
class Bucket:
    group: object  # the shard axis' ProcessGroup
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class Routing:
    buckets: tuple[Bucket, ...]
    by_id: dict  # id(sharded parameter) -> Entry
    loads: dict  # process group name -> per-rank Newton-Schulz cost (``OwnerPlan.loads``)
    #: the exchanges' send and receive buffers, kept from one step to the next (``perparam.comm.buffers``)
    staging: BufferPool = field(default_factory=lambda: BufferPool(min_bytes=0, smallest_fit=True),
                                compare=False)


def shard_group(sp):
    return sp.dp_mesh.get_group(sp.dp_mesh.ndim - 1)


def plan(optimizer: torch.optim.Optimizer, held, before: Routing | None) -> Routing | None:
    """The owners and buckets of ``optimizer``'s owner parameters (``held``: the ``ShardedParam``s whose
    sharded parameters it holds; ``before``: its plan so far, whose owners keep the parameters they hold
    state for); ``None`` when it holds none."""
    owned = {id(sp.sharded): sp for sp in held if sp.policy.update == "owner"}
    if not owned:
        return None
    order, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            sp = owned.get(id(p))
            if sp is not None and id(p) not in seen:
                seen.add(id(p))
                order.append((sp, group.get("ns_steps", NS_STEPS)))
    per_pg: dict = {}
    for sp, ns_steps in order:
        pg = shard_group(sp)
        per_pg.setdefault(id(pg), (pg, []))[1].append((sp, ns_steps))
    buckets, by_id, loads = [], {}, {}
    planned = before.by_id if before is not None else {}  # owners already holding state stay where they are
    for pg, items in per_pg.values():
        fixed = {i: planned[id(sp.sharded)].owner for i, (sp, _) in enumerate(items)
                 if id(sp.sharded) in planned and shard_group(planned[id(sp.sharded)].sp) is pg}
        result = owner_plan([ns_cost(sp.global_shape, ns) for sp, ns in items], pg.size(), fixed,
                            kinds=[tuple(sp.global_shape) for sp, _ in items])
        loads[pg.group_name] = result.loads
        entries = [Entry(sp, owner) for (sp, _), owner in zip(items, result.owners)]
        for e in entries:  # where the reduction to owners sends its gradient (paths.reduce_owner)
            e.sp.owner_rank = e.owner
        by_id.update((id(e.sp.sharded), e) for e in entries)
        open_: dict = {}  # dtype -> (entries, bytes) of the bucket being filled
        for e in entries:
            dtype = e.sp.sharded.dtype
            nbytes = 2 * e.sp.sharded.numel() * dtype.itemsize
            current, size = open_.get(dtype, ([], 0))
            if current and size + nbytes > BUCKET_BYTES:
                buckets.append(Bucket(pg, tuple(current)))
                current, size = [], 0
            open_[dtype] = (current + [e], size + nbytes)
        buckets.extend(Bucket(pg, tuple(current)) for current, _ in open_.values())
    return Routing(tuple(buckets), by_id, loads)


def routing(optimizer: torch.optim.Optimizer) -> Routing | None:
    """``optimizer``'s plan (``None``: it holds no owner parameter)."""
    return registry.routing(optimizer)


def step_in(optimizer: torch.optim.Optimizer, route: Routing | None, step, stepping_whole) -> list | None:
    """Before the stock step: per bucket of ``route``, gather the owners' whole tensors (the next bucket's
    gather posted before this one's step), run the optimizer's own step function on them alone on their
    owners (inside ``stepping_whole()``: perparam's hooks leave a hooked step it calls alone), send the rows
    back; then leave the routed parameters out of ``param_groups`` for the step itself. Returns what
    ``step_out`` puts back (``None``: nothing routed). ``step``: the step, which knows each gradient's
    kind."""
    if route is None:
        return None
    grads = step.grads()
    # per bucket with gradients: its entries with one, and whether each was reduced to its owner
    live, held = [], []
    for bucket in route.buckets:
        entries, reduced = [], []
        for e in bucket.entries:
            kind = grads[id(e.sp)][1]
            if kind is not GradKind.NONE:
                entries.append(e)
                reduced.append(kind is GradKind.HELD)
        if entries:
            live.append((bucket, entries))
            held.append(tuple(reduced))
    if not live:
        return None
    if step.closure:
        raise OwnerStepError(f"{type(optimizer).__name__}.step(closure) computes gradients inside the step, "
                             "after perparam has brought the update='owner' parameters' gradients to their "
                             "owners; call the closure (forward and backward) before step() and then step() "
                             "without it")
    stock = type(optimizer).step.__wrapped__  # the class's step without torch's hook wrapper
    groups = [(group, group["params"]) for group in optimizer.param_groups]
    routed = {id(e.sp.sharded) for _, es in live for e in es}
    scattered: list = []  # per bucket: (bucket, entries, its scatter in flight), landed after the last step
    mine = None  # the exception this rank's step raised: its later buckets travel unstepped
    keep = config.current().owner_grad == "owner"
    pool = route.staging
    try:  # each bucket's step narrows ``param_groups`` to its wholes; put back only where this raises
        with torch.no_grad():
            moves = owner_exchange.travels(*live[0], held[0])
            posted = owner_exchange.gather(*live[0], moves, held[0], pool)
            for i, (bucket, entries) in enumerate(live):
                wholes = owner_exchange.assemble(bucket, entries, moves, held[i], posted.wait())
                posted.release()
                if keep:  # the wholes assembled from rows: the next reduction to the owners adds onto them
                    owner_exchange.remember(entries, moves, wholes)
                if i + 1 < len(live):
                    moves = owner_exchange.travels(*live[i + 1], held[i + 1])
                    posted = owner_exchange.gather(*live[i + 1], moves, held[i + 1], pool)
                raised = None
                if wholes and mine is None:
                    try:
                        for e in entries:  # a .grad changed after a reduction to its owner: refused
                            if id(e.sp.sharded) in wholes:
                                owner_grads.check_untouched(e.sp)
                        with stepping_whole():
                            _step_whole(optimizer, groups, wholes, stock)
                    except Exception as e:  # noqa: BLE001 - raised again on every rank below, as the cause
                        raised = mine = e
                scattered.append((bucket, entries,
                                  owner_exchange.scatter(bucket, entries, wholes, raised is not None, pool)))
                del wholes
            flags = owner_exchange.land(scattered)
        failed = [(b, owner) for (b, _, _), per in zip(scattered, flags)
                  for owner, bad in enumerate(per) if bad]
        if failed:  # the flags: the owner path's one host read per step
            _raise_everywhere(optimizer, failed, mine)
    except BaseException:
        for group, params in groups:  # as they were: the step proper does not run
            group["params"] = params
        raise
    for group, params in groups:  # once, after the last bucket: the step proper steps the rest
        group["params"] = [p for p in params if id(p) not in routed]
    for pid in routed:  # an empty entry where this rank owns none (owner_state: DCP's empty-state test)
        optimizer.state.setdefault(route.by_id[pid].sp.sharded, {})
    return groups


def _step_whole(optimizer, groups, wholes: dict, stock) -> None:
    """The optimizer's own step on the whole tensors of ``wholes`` alone (each group of ``groups``, (group,
    its parameters), narrowed to its own ones, their state re-keyed to them and back); ``param_groups`` stay
    narrowed (``step_in`` sets them once, after the last bucket)."""
    for group, params in groups:
        group["params"] = [wholes[id(p)][1] for p in params if id(p) in wholes]
    for p, whole in wholes.values():
        state = optimizer.state.pop(p, None)
        if state is not None:
            optimizer.state[whole] = state
    try:
        stock(optimizer)
    finally:
        for p, whole in wholes.values():
            state = optimizer.state.pop(whole, None)
            if state is not None:
                optimizer.state[p] = state


def _raise_everywhere(optimizer, failed: list, mine: Exception | None) -> None:
    """Raise ``OwnerStepRaised`` on every rank of the axes of ``failed`` (``(bucket, owner rank)`` pairs,
    known alike on each axis' ranks from the flags): the owners share their exception's text (one object
    all-gather per failed bucket, ``owner_exchange.raised_texts``); the owner raises it from its own
    exception."""
    lines = []
    for bucket in dict.fromkeys(b for b, _ in failed):
        owners = [o for b, o in failed if b is bucket]
        me = bucket.group.rank()
        told = owner_exchange.raised_texts(bucket, f"{type(mine).__name__}: {mine}" if me in owners else None)
        for owner in owners:
            names = ", ".join(f"'{e.sp.path}' ({registration.class_name(e.sp.slots[0][0])}, shape "
                              f"{tuple(e.sp.global_shape)})" for e in bucket.entries
                              if e.owner == owner and e.sp.sharded.grad is not None)
            lines.append(f"on rank {owner} of its shard axis, the owner of parameters {names}: {told[owner]}")
    raise OwnerStepRaised(
        f"{type(optimizer).__name__}'s step on whole tensors raised " + "; ".join(lines)
        + ". Every rank of that "
        "axis raises this error; the raising owner's parameters keep their values from before the step (its "
        "optimizer state of them as the raising step left it), the step proper did not run") from mine


def step_out(groups: list | None) -> None:
    """After the stock step: the routed parameters back in ``param_groups`` (``groups``: what ``step_in``
    returned)."""
    for group, params in groups or ():
        group["params"] = params
