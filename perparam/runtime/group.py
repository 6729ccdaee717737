"""One ``fully_shard`` call's parameters: one all-gather per mesh per unshard whatever the mix of dtypes,
quantizations and placements; one reduce-scatter per (mesh, reduce dtype).

The group owns the collectives; ``hooks.py`` decides when they run. Its ``TrainingState`` is in
``perparam.runtime.state``; its iteration context (``perparam.runtime.context``, which hands the group its buffer pool) is
above it. Beside that state: the padded unsharded storage is *alive* or *freed*; the module has the
*sharded* DTensors or the *unsharded* tensors registered.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm import collectives
from ..comm.buffers import BufferPool
from ..comm.process_groups import next_group_index, reduce_group
from ..sharding.layout import GroupLayout
from . import config, partial, registration, zero, zero_copy, zero_copy_reduce
from .meshes import split_by_mesh
from .param import ShardedParam
from .paths import choose
from .paths.gather import GatherFacts
from .paths.reduce import ReduceFacts
from .reduction import PendingReduce, ReducePlan, reduce_plan
from .state import ALLOWED, StateError, TrainingState

#: where ``fully_shard`` keeps a module's group (in its ``__dict__``)
GROUP_ATTR = "_perparam_group"


class _GatherPlan(NamedTuple):
    """What never changes for an all-gather of one set of parameters (``ParamGroup._gather_plan``)."""

    zero_copy: bool  # ``zero_copy.eligible``: K > 1 on gloo, every member plain ``Shard(0)``
    sizes: list[int]  # bytes of each piece, in ``GroupLayout.order``
    scattered: list[bool]  # per member: plain ``Shard(d > 0)``, copied into slices of the unsharded tensor
    any_scattered: bool
    quantized: bool  # some member's pieces are quantized (not ``ShardedParam.plain``)
    #: the path chosen for this member set (``paths.choose.gather_path``), per ``GatherFacts`` of an unshard
    paths: dict


class ParamGroup:
    """The parameters of one ``fully_shard`` call over a 1D mesh (shard) or 2D mesh (replicate, shard).

    ``modules``: the module(s) given to the call. Two lists of parameters, not to be mixed up:

    * ``params``: every managed parameter of the call in registration order, *whatever its mesh* (on a
      companion, below: its mesh's). What the operations on the modules walk: registering the sharded
      or unsharded tensors, the slot checks, ``trainable()``, gradient accumulation without sync.
    * ``mesh_params``: the parameters on *this group's* ``mesh`` (a sub-list of ``params``; ``gathered``,
      ``replicated`` and ``kept`` are sub-lists of it), the ones its own collectives carry; the other
      meshes' are their companions' ``mesh_params``. What one mesh's all-gather, version check and
      reduction (``trainable_mesh_params()``) walk.

    The all-gather runs over the shard axis; on a 2D mesh gradients are reduce-scattered over the shard
    axis and then all-reduced over the replicate axis (HSDP). Replicated parameters are never gathered;
    their gradients are all-reduced over every data-parallel rank.

    Parameters on another mesh (``ParamPolicy.mesh``) belong to a *companion* group per mesh
    (``companions``, in ``perparam.runtime.meshes``' fixed order), which this group drives from each entry
    point (``start_unshard``, ``wait_unshard``, ``free``, ``reduce_grads``, ``advance_reduce``, ``stale``,
    ``pool_bytes``, ...): one all-gather per mesh, one reduce-scatter per (mesh, reduce dtype). A
    companion's ``driver`` is this group, whose settings (divide factor, hooks, custom collectives,
    ``requires_all_reduce``), pool and context it uses.
    """

    def __init__(self, modules: list[nn.Module], params: list[ShardedParam], mesh: DeviceMesh,
                 reshard_after_forward: bool, mp_policy, gradient_divide_factor: float | None = None,
                 auto_reshard_after_forward: bool = False, driver: ParamGroup | None = None) -> None:
        self.modules = modules
        self.params = params
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.driver = driver or self
        own, others = split_by_mesh(params, mesh)
        self.mesh_params = own  # this mesh's parameters: the ones this group's own collectives carry
        self.num_shards = mesh.size(mesh.ndim - 1)
        self.num_replicas = mesh.size(0) if mesh.ndim == 2 else 1
        self.gathered = [p for p in own if p.layout.gathered]
        self.replicated = [p for p in own if not p.layout.gathered]
        self.layout = GroupLayout(tuple(p.pieces for p in self.gathered), self.num_shards)
        self.kept = [p for p in self.gathered if p.kept]  # stage 1/2: unsharded across steps (runtime/zero.py)
        self._layouts: dict[tuple[int, ...], GroupLayout] = {}  # all-gathers of some of ``gathered``
        self._plans: dict[int, _GatherPlan] = {}  # id(layout) of ``layout``/``_layouts`` -> its ``_gather_plan``
        self._reduce_plans: dict[tuple[ShardedParam, ...], ReducePlan] = {}  # a reduction's params -> its plan
        self._versioned = [p for p in own if not p.kept]  # what ``_versions`` reads (``kept`` is fixed)
        self._what_cache: tuple | None = None  # ((path, registration generation), ``_what``)
        self.reshard_after_forward = reshard_after_forward
        # left to the default (None): as root the group keeps its parameters into backward (FSDP2's rule)
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.gradient_divide_factor = gradient_divide_factor  # None: divide by the mesh's size (``divisor``)
        self.all_reduce_hook = None  # set_all_reduce_hook: sees each reduction's sum before the division
        self.reshard_after_backward = True
        # explicit prefetch (ShardedModule.set_modules_to_*_prefetch): groups, or None for the recorded order
        self.forward_prefetch: list[ParamGroup] | None = None
        self.backward_prefetch: list[ParamGroup] | None = None
        self.requires_gradient_sync = True
        # HSDP: False holds the reduce-scattered gradients until a reduction that all-reduces (partial.py)
        self.requires_all_reduce = True
        self.partial_reduce: dict[tuple, torch.Tensor] = {}
        self.all_gather_comm = None  # custom collectives: ShardedModule.set_custom_all_gather / _reduce_scatter
        self.offload_hook = None  # perparam.offload.tier: reads disk-tier shards in before an all-gather packs them
        self.reduce_scatter_comm = None
        self.registered_unsharded = False
        self._alive = False  # the unsharded storage holds the gathered parameters
        self._gathered_versions: tuple[int, ...] = ()  # the sharded parameters' versions when gathered
        self._pending_gather = None  # (send buffer, collectives.GatheredRows) of an all-gather in flight
        self.hpz = None  # hpz.Secondary: the secondary partition kept after forward (reshard_after_forward=int)
        self._hpz_layout: GroupLayout | None = None  # the layout of the all-gather the hpZ rows came from
        self.hpz_given = None  # the one fully_shard made (set_reshard_after_forward(None) restores it)
        self.name = ", ".join(type(m).__name__ for m in modules)
        # per-iteration bookkeeping, driven by hooks.py (see perparam.runtime.state for the states)
        self.state = TrainingState.IDLE
        self._ctx = None  # its IterationContext (perparam.runtime.context): its own, then its root's from its first forward
        self._pool = BufferPool(0)  # the context's pool, handed over by IterationContext.take
        self.forward_depth = 0
        self.tree: list[ParamGroup] | None = None  # set on a group when it first acts as root
        self.islands: list = []  # perparam.runtime.islands.Island: modules computing in their own dtype
        self.calls_pending = 0  # forwards whose backward has not reached their inputs yet ...
        self.untracked_calls = 0  # ... and forwards whose inputs need no grad (post-backward at the end)
        #: ids of the parameters (every mesh) whose gradients were accumulated without sync since the last
        #: synchronising reduction: reduced then even if frozen since (requires_grad_(False) between
        #: micro-batches), as one process steps the .grad they already hold; the same set on every rank
        self.held_unsynced: set[int] = set()
        self.reduced = False  # this backward's reduction of the group has been issued
        self.index = next_group_index()  # creation order: the same on every rank that builds the same model
        self.path: str | None = None  # the module path below the root, set at the root's first forward
        self.companions = [ParamGroup(modules, members, other, reshard_after_forward, mp_policy, driver=self)
                           for other, members in others]
        self.parts = [self, *self.companions]  # every mesh's group, in the fixed order

    @property
    def call(self) -> ParamGroup:
        """The ``fully_shard`` call's group, whose settings every mesh's part reads."""
        return self.driver

    # A companion uses its driver's context and pool (``IterationContext.take`` hands them to the driver).
    @property
    def ctx(self):
        return self.driver._ctx

    @ctx.setter
    def ctx(self, value) -> None:
        self._ctx = value

    @property
    def pool(self) -> BufferPool:
        return self.driver._pool

    @pool.setter
    def pool(self, value: BufferPool) -> None:
        self._pool = value

    # The process groups are looked up in the mesh each time, never stored: a ProcessGroup kept alive past
    # destroy_process_group() (the module tree holds groups until interpreter exit) was seen to abort the
    # process at exit ("terminate called without an active exception").
    @property
    def shard_pg(self):
        return self.mesh.get_group(self.mesh.ndim - 1)

    @property
    def replicate_pg(self):
        return self.mesh.get_group(0) if self.mesh.ndim == 2 else None

    # Gradient reductions run on process groups of their own (``perparam.comm.process_groups``): their order
    # on every rank then never depends on how they interleave with the all-gathers.
    @property
    def reduce_shard_pg(self):
        return reduce_group(self.shard_pg)

    @property
    def reduce_replicate_pg(self):
        return reduce_group(self.replicate_pg)

    @property
    def _what(self) -> str:
        """How collectives and errors name the group: creation index, path below the root, classes,
        parameters (the index tells apart groups of equal classes and shapes in debug mode). Built again
        only when the path is set or a parameter moved (``registration.move`` renames it and bumps the
        registration generation): every collective names its group."""
        key = (self.path, registration.generation())
        if self._what_cache is not None and self._what_cache[0] == key:
            return self._what_cache[1]
        where = f" '{self.path}'" if self.path else ""
        on = "" if self.driver is self else f" on mesh {self.mesh.mesh.tolist()} of group #{self.driver.index}"
        what = f"group #{self.index}{where} [{self.name}]{on} ({', '.join(p.fqn for p in self.mesh_params)})"
        self._what_cache = (key, what)
        return what

    def transition(self, new: TrainingState) -> None:
        """Move to state ``new``; raises ``StateError`` for a transition ``perparam.runtime.state`` does not allow."""
        if new is not self.state and new not in ALLOWED[self.state]:
            raise StateError(f"perparam: group [{self.name}] cannot go from {self.state.value} to {new.value}; "
                             "call module.reset() after an interrupted step, or report this as a bug")
        self.state = new

    def force_state(self, new: TrainingState) -> None:
        self.state = new
        self.forward_depth = 0
        self.calls_pending = self.untracked_calls = 0

    def manages(self, tensor: torch.Tensor) -> bool:
        return any(tensor is p.sharded for p in self.params)

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"ParamGroup({names}: {len(self.params)} params)"

    # -- unshard / reshard ------------------------------------------------------------------------------
    @property
    def storage_alive(self) -> bool:
        """The unsharded storage is filled (or being filled by an all-gather in flight), on any mesh."""
        return any(part._alive or part._pending_gather is not None for part in self.parts)

    def pending_gather(self):
        """The all-gather in flight (an opaque token: the first mesh's in flight), or ``None``."""
        return next((part._pending_gather for part in self.parts if part._pending_gather is not None), None)

    def _versions(self) -> tuple[int, ...]:
        versions = []
        for p in self._versioned:  # the wrapper (DTensor in-place ops), the local shard (to_local().sub_())
            # and the steps of the optimizers holding it (foreach updates bump neither version); kept copies
            # (stage 1/2) are refreshed by step and load counts only (runtime/zero.py)
            sharded = p.sharded
            versions += (sharded._version, sharded._local_tensor._version, p.optimizer_steps)
        return tuple(versions)

    def stale(self) -> bool:
        """The gathered storage may no longer match the shards: a ``torch.optim`` optimizer holding perparam
        parameters stepped (foreach updates do not bump a DTensor's version) or an in-place update
        bumped a sharded parameter's or its local shard's version since the all-gather. Not detected:
        ``torch._foreach_*`` called by hand on DTensors and writes through ``.data``."""
        return any(part._alive and part._versions() != part._gathered_versions for part in self.parts)

    def pool_bytes(self) -> int:
        """Bytes of CPU buffers one unshard and one reduction of this group take from the pool at most
        (``perparam.comm.buffers``): the all-gather's send row and the K - 1 rows it receives (plus K - 1 copies
        of the send row for K > 2; none for a zero-copy all-gather, ``runtime/zero_copy.py``), and per reduce
        dtype the ``[K, n]`` reduce-scatter input and, for K > 2, its ``[K, n]`` receive buffer (``n``: padded
        local elements plus used flags; for K = 2 the peer's piece arrives in the output,
        ``perparam.comm.collectives``); a zero-copy reduce-scatter (``runtime/zero_copy_reduce.py``) has no
        input buffer and for K > 2 one ``[K, n]`` staging buffer. Counts every sharded parameter,
        trainable or not (an upper bound). With parameters on several meshes: the sum over the meshes."""
        return sum(part._pool_bytes() for part in self.parts)

    def _pool_bytes(self) -> int:
        if self.num_shards == 1:
            return 0
        gather = 0
        if self.gathered:  # the path the forward all-gather of every member takes
            plan = self._gather_plan(self.gathered, self.layout)
            gather = self._gather_path(plan, False).pool_bytes(self, self.gathered, self.layout)
        cpu = all(p.local_shard().device.type == "cpu" for p in self.gathered)
        reduce = 0
        for (whole, dtype, wire), params in self._reduce_sets(self.gathered).items():
            plan = None if whole else self._reduce_plan(tuple(params), wire)
            reduce += self._reduce_path(plan, whole, wire, cpu).pool_bytes(self, params, dtype, wire)
        return gather + reduce

    def trainable(self) -> list[ShardedParam]:
        """The trainable parameters of every mesh (``params``), and those holding gradients accumulated
        without sync (``held_unsynced``); ``trainable_mesh_params()``: of this mesh."""
        held = self.held_unsynced
        return [p for p in self.params if p.sharded.requires_grad or (held and id(p) in held)]

    @property
    def unsynced(self) -> bool:
        """Gradients accumulated without sync wait for the next synchronising backward."""
        return bool(self.held_unsynced)

    def has_trainable(self) -> bool:
        """Some parameter of some mesh is trainable (``trainable()`` is not empty), told at the first one."""
        return bool(self.held_unsynced) or any(p.sharded.requires_grad for p in self.params)

    @property
    def divisor(self) -> float | int:
        """What a reduced gradient (the sum over the mesh's ranks) is divided by: the gradient divide factor,
        by default the call's mesh size (``num_shards * num_replicas`` of the driver), also for the
        parameters on another mesh: the number of ranks whose losses are averaged."""
        driver = self.driver
        factor = driver.gradient_divide_factor
        return driver.num_shards * driver.num_replicas if factor is None else factor

    @torch.no_grad()
    def unshard(self) -> None:
        """All-gather every sharded parameter of the group in one collective into its padded unsharded
        buffer (and copy replicated ones); waits for it. No-op when the storage is already alive.

        Bytes gathered: ``layout.all_gather_bytes`` (recorded by ``CommCounter``).
        """
        self.start_unshard()
        self.wait_unshard()

    @torch.no_grad()
    def start_unshard(self) -> None:
        """Issue the group's all-gathers (one per mesh, in the fixed order) without waiting for them (a
        prefetch); ``wait_unshard`` finishes them."""
        for part in self.parts:
            part._start_unshard()

    def _start_unshard(self) -> None:
        if not self.mesh_params or self._pending_gather is not None:
            return
        versions = self._versions()  # one pass over the parameters per unshard
        fresh = versions == self._gathered_versions  # the shards unchanged since last gathered
        members = self._gather_members(versions, fresh)
        if members is None:
            return
        if not members:
            self._alive = True
            return
        layout = self._layout_for(members)
        # hpZ: the rows kept after forward serve only an all-gather of the same members (same layout)
        secondary = self.hpz is not None and self.hpz.usable(fresh and layout is self._hpz_layout, self.pool)
        path = self._gather_path(self._gather_plan(members, layout), secondary)
        if path.reads_shards and self.offload_hook is not None:
            self.offload_hook()
        self._pending_gather = path.start(self, members, layout)

    def _gather_path(self, plan: _GatherPlan, secondary: bool):
        """The all-gather path of ``plan``'s member set now (``paths.choose``), chosen once per facts."""
        facts = GatherFacts(secondary, self.call.all_gather_comm is not None, config.current().gloo_all_gather,
                            self.hpz is not None, plan.zero_copy, plan.quantized)
        path = plan.paths.get(facts)
        if path is None:
            path = plan.paths[facts] = choose.gather_path(facts)
        return path

    @torch.no_grad()
    def wait_unshard(self) -> None:
        """Wait for the all-gathers in flight and copy their rows out, rank by rank: straight into the padded
        buffers of plain parameters, through scratch pieces (dequantized) for quantized ones."""
        for part in self.parts:
            part._wait_unshard()

    def _wait_unshard(self) -> None:
        if self._pending_gather is None:
            return
        gather, self._pending_gather = self._pending_gather, None
        gather.path.finish(self, gather)
        self._alive = True

    def keep_secondary(self, rows, members: list[ShardedParam], layout: GroupLayout) -> None:
        """hpZ: keep this rank's secondary rows of a finished forward all-gather (``rows``), for the backward
        all-gather; useless when the gather refreshed stage-1/2 copies (the backward's members, the stage-3
        ones, then have another layout)."""
        if self.hpz is not None and self.state is TrainingState.FORWARD and not any(p.kept for p in members):
            self.hpz.keep(rows.segments, self.pool)
            self._hpz_layout = layout

    # -- which parameters an all-gather carries (ZeRO stages, perparam/runtime/zero.py) ----------------------
    def _gather_members(self, versions: tuple[int, ...], fresh: bool) -> list[ShardedParam] | None:
        """The parameters the next all-gather carries, in group order: the stage-3 ones unless their
        storage is alive and ``fresh`` (``versions``, the parameters' versions now, equal those when last
        gathered; else the replicated ones are copied again too), plus the stage-1/2
        ones whose kept copy needs a refresh (``zero.needs_refresh``: decided by counts every rank shares,
        so every rank gathers the same set). ``None``: nothing to do. Marks the kept copies refreshed.
        Storage kept as it is whose shard was written since (``zero.check_unwritten``) is compared with it
        first."""
        refresh = [p for p in self.kept if zero.needs_refresh(p)]
        refreshed = {id(p) for p in refresh}
        current = self._alive and fresh
        for p in self.gathered:  # storage kept as it is: written since by a route that does not refresh it?
            if p.write_sig is not None and (id(p) not in refreshed if p.kept else current):
                zero.check_unwritten(p)  # raises before anything is issued, never computes on a stale copy
        if current and not refresh:
            return None
        if not current:
            self._alive = False
            self._gathered_versions = versions
            for p in self.replicated:
                p.fill_replicated()
        if refresh:  # (stage 3 alone: no kept copy, no count to read)
            zero.mark_gathered(refresh)
        members = refresh if current else [p for p in self.gathered if not p.kept or id(p) in refreshed]
        zero.note_gathered(members)
        return members

    def _layout_for(self, members: list[ShardedParam]) -> GroupLayout:
        """The packed all-gather layout of ``members`` (a sub-list of ``gathered``), built once per set."""
        if len(members) == len(self.gathered):
            return self.layout
        index = {id(p): i for i, p in enumerate(self.gathered)}
        key = tuple(index[id(p)] for p in members)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = GroupLayout(tuple(p.pieces for p in members), self.num_shards)
        return layout

    def relayout(self) -> None:
        """Derive the all-gather layouts and the plans again after parameters changed dtype
        (``ShardedParam.recast``, ``perparam.runtime.recast``), on every mesh's part; hpZ rows are dropped."""
        for part in self.parts:
            part.layout = GroupLayout(tuple(p.pieces for p in part.gathered), part.num_shards)
            part._layouts, part._plans, part._reduce_plans, part._hpz_layout = {}, {}, {}, None
            if part.hpz is not None:
                part.hpz.drop(part.pool)

    def _gather_plan(self, members: list[ShardedParam], layout: GroupLayout) -> _GatherPlan:
        """What never changes for an all-gather of ``members`` (a sub-list of ``gathered``; ``layout`` from
        ``_layout_for``, one object per member set): built once per member set, as the layouts are. The
        member sets, their placements and quantization and the mesh's process group are fixed at
        ``fully_shard``; what may change between unshards is read at each one instead: the settings
        (``config``, a custom all-gather, hpZ: ``zero_copy.wanted``) and the local shards' device
        (``to_empty``, ``.to``, a ``.data`` swap: ``zero_copy.start``)."""
        plan = self._plans.get(id(layout))
        if plan is None:
            scattered = [p.plain and not p.layout.wire_is_layout for p in members]
            plan = self._plans[id(layout)] = _GatherPlan(
                zero_copy.eligible(members, self.shard_pg), [layout.pieces[i][j].nbytes for i, j in layout.order],
                scattered, any(scattered), any(not p.plain for p in members), {})
        return plan

    def free(self, keep_secondary: bool = False) -> None:
        """Release the unsharded storage (no communication; an all-gather in flight is finished first).
        ``keep_secondary``: after a forward with grad, keep hpZ's secondary shard for the backward."""
        for part in self.parts:
            if part._pending_gather is not None:
                part._wait_unshard()
            if part.hpz is not None and not keep_secondary:
                part.hpz.drop(part.pool)
            for p in part.mesh_params:
                if not p.kept:  # stage 1/2 keep theirs across steps
                    p.free()
            part._alive = False

    def check_slots(self) -> None:
        """Raise ``ReplacedAfterShardingError`` naming the first parameter whose slot holds an object perparam
        did not register (``ShardedParam.check_slots``)."""
        for p in self.params:  # the check of ``check_slots``, inline: once per parameter per forward
            sharded, unsharded = p.sharded, p.unsharded
            for module, name in p.slots:
                current = module._parameters.get(name)
                if current is None or (current is not sharded and current is not unsharded):
                    p.check_slots()  # raises, with the message

    def register_unsharded(self) -> None:
        for p in self.params:
            p.register_unsharded()
        self.registered_unsharded = True

    def register_sharded(self) -> None:
        for p in self.params:
            p.register_sharded()
        self.registered_unsharded = False

    def reshard(self) -> None:
        self.register_sharded()
        self.free()

    # -- gradients --------------------------------------------------------------------------------------
    def drop_unsharded_grads(self) -> None:
        """Forget unsharded gradients and gradients accumulated without sync (``reset``)."""
        for p in self.params:
            if p.unsharded is not None:
                p.unsharded.grad = None
            p.grad_acc = None
        self.held_unsynced = set()
        for part in self.parts:
            part.partial_reduce.clear()

    @torch.no_grad()
    def reduce_grads(self, sync: bool = True, defer: bool = False) -> list[PendingReduce]:
        """Reduce the unsharded gradients into the sharded ``.grad``s: summed over the mesh's ranks, divided
        by ``divisor`` (the gradient divide factor; by default the mesh's size, i.e. the mean) and
        accumulated into existing sharded gradients.

        The collectives depend on the group alone, never on which gradients this rank computed: every
        trainable parameter of the group is packed, in the group's fixed order, into one reduce-scatter
        per distinct reduce dtype (then, on HSDP, one all-reduce of its output over the replicate axis); a
        parameter without a gradient on this rank contributes zeros. Each rank's piece ends with one
        *used* flag per parameter (1 where this rank had a gradient), summed by the same collective, so
        a parameter that no rank used keeps its ``.grad`` unchanged (``None`` after ``zero_grad()``) on
        every rank, as in an unsharded model. Replicated parameters: one all-reduce per reduce dtype over
        each mesh axis, flags likewise, queued with the reduce-scatters (never waited for in backward;
        the replicate-axis all-reduce follows from the queue, in issue order). ``sync=False`` only moves
        the gradients into the reduce-dtype accumulators (gradient accumulation without communication).
        ``defer=True`` returns the reductions still in flight, for ``finish_reduce``; otherwise they are
        finished here. Parameters on other meshes: the same per mesh, mesh after mesh in the fixed order,
        each reduction knowing its mesh's group (``PendingReduce.part``).
        """
        if not sync:
            trainable = self.trainable()
            for p in trainable:
                p.take_unsharded_grad(keep=True)
            self.held_unsynced.update(id(p) for p in trainable)
            return []
        pending = [item for part in self.parts for item in part._reduce(part.trainable_mesh_params())]
        self.held_unsynced = set()
        if not defer:
            for item in pending:
                self.finish_reduce(item)
            return []
        return pending

    def trainable_mesh_params(self) -> list[ShardedParam]:
        """The trainable parameters of this group's mesh (``mesh_params``), and those holding gradients
        accumulated without sync (the driver's ``held_unsynced``); ``trainable()``: of every mesh."""
        held = self.driver.held_unsynced
        return [p for p in self.mesh_params if p.sharded.requires_grad or (held and id(p) in held)]

    def _reduce_sets(self, params) -> dict[tuple, list[ShardedParam]]:
        """``params`` split into the sets reduced together, in order: keyed (whole, reduce dtype, wire
        format); whole gradients (replicated, stage 1) all-reduced, the others one reduce-scatter per
        (reduce dtype, ``grad_quant``; none on one rank: nothing on the wire to quantize)."""
        sets: dict[tuple, list] = defaultdict(list)
        for p in params:
            whole = not p.layout.gathered or p.policy.whole_grad
            wire = None if whole or self.num_shards == 1 else p.policy.grad_quant
            sets[whole, p.policy.reduce_dtype, wire].append(p)
        return sets

    def _reduce(self, trainable: list[ShardedParam]) -> list[PendingReduce]:
        """Issue this mesh's reductions of ``trainable`` (see ``reduce_grads``): the reduce-scatters first,
        then the whole-gradient all-reduces, each through its path (``paths.choose``)."""
        grads = {}
        for p in trainable:
            grad = p.take_unsharded_grad(keep=False)
            grads[id(p)] = (grad, True) if grad is not None else (p.zero_grad_for_reduce(), False)
        sets = sorted(self._reduce_sets(trainable).items(), key=lambda item: item[0][0])  # stable: whole last
        pending = []
        for (whole, dtype, wire), members in sets:
            params = tuple(members)
            tensors, used = zip(*(grads[id(p)] for p in params))
            plan = None if whole else self._reduce_plan(params, wire)
            path = self._reduce_path(plan, whole, wire, zero_copy_reduce.on_cpu(tensors))
            item = path.issue(self, params, tensors, used, dtype, plan)
            item.part = self
            pending.append(item)
        return pending

    def _reduce_path(self, plan: ReducePlan | None, whole: bool, wire, cpu: bool):
        """The reduction path of ``plan``'s parameter set now (``paths.choose``), chosen once per facts."""
        facts = ReduceFacts(whole, wire, self.call.reduce_scatter_comm is not None,
                            config.current().gloo_reduce_scatter, self.hpz is not None,
                            plan is not None and plan.zero_copy, cpu)
        if plan is None:
            return choose.reduce_path(facts)
        path = plan.paths.get(facts)
        if path is None:
            path = plan.paths[facts] = choose.reduce_path(facts)
        return path

    @torch.no_grad()
    def advance_reduce(self, item: PendingReduce, block: bool) -> bool:
        """Move a reduction on: once its reduce-scatter has finished, issue the all-reduce over the
        replicate axis (HSDP, asynchronously); once that has finished, run the all-reduce hook (if any),
        divide by ``divisor`` and accumulate each parameter's piece into its sharded ``.grad`` (when some
        rank had a gradient). ``block=False`` never waits (a reduction a peer has not issued yet must not
        stall this rank's backward) and leaves reductions with an all-reduce hook to a blocking call;
        returns whether the reduction is complete. Callers advance reductions in the order they were
        issued, so the all-reduces are issued in the same order on every rank. A reduction of another mesh
        is advanced by that mesh's group (``item.part``)."""
        part = item.part if item.part is not None else self
        return part._advance(item, block)

    def _reduce_plan(self, params: tuple[ShardedParam, ...], wire=None) -> ReducePlan:
        """What never changes for a reduction of ``params`` (a sub-tuple of ``mesh_params``, in order; one
        reduce dtype): offsets, this rank's views of the output, zero-copy eligibility and per-rank row
        sizes. Built once per parameter set (the trainable set may change between steps: another key); the
        layouts, shard ranks, placements and the mesh's process group are fixed at ``fully_shard``. What
        may change is read at each reduction instead, as for ``_gather_plan``: the settings (``config``, a
        custom reduce-scatter, hpZ: ``zero_copy_reduce.wanted``) and the gradients' device (``to_empty``,
        ``.to``, a ``.data`` swap: ``zero_copy_reduce.on_cpu``)."""
        plan = self._reduce_plans.get(params)
        if plan is None:
            zero = self.num_shards > 1 and zero_copy_reduce.eligible(params, self.reduce_shard_pg)
            plan = self._reduce_plans[params] = reduce_plan(params, zero, collectives.zero_gaps, wire)
        return plan

    def _advance(self, item: PendingReduce, block: bool) -> bool:
        if item.stage == 0:
            if item.work is not None and not (block or item.work.is_completed()):
                return False
            if item.work is not None:
                item.work.wait()
            if item.send is not None:
                self.pool.give_back(item.send)
            item.work = None
            if self.replicate_pg is not None:
                if partial.hold(self, item):  # set_requires_all_reduce(False): all-reduced by a later reduction
                    item.stage = 2
                    return True
                partial.merge(self, item)
                item.work = collectives.all_reduce_sum(item.recv, self.reduce_replicate_pg, async_op=True,
                                                       what=f"{self._what} [{item.recv.dtype}]")
            item.stage = 1
        if item.work is not None:
            if not (block or item.work.is_completed()):
                return False
            item.work.wait()
            item.work = None
        if item.stage == 1 and not item.discard:
            if self.driver.all_reduce_hook is not None and not block:
                return False  # a user hook may issue collectives: it runs in the final callback, in issue order
            self._accumulate(item)
        item.stage = 2
        return True

    def _accumulate(self, item: PendingReduce) -> None:
        """Divide the summed gradients by ``divisor`` (after the all-reduce hook, if any) and add each
        parameter's piece to its sharded ``.grad``; a parameter some rank had a gradient for is queued for
        its post-accumulate-grad hooks (``IterationContext.run_grad_hooks``, at the end of backward)."""
        recv, n = item.recv, len(item.params)
        flags = item.summed_flags()  # before any hook or division; read back only where this rank lacked one
        grads = recv.narrow(0, 0, recv.numel() - n)  # the flags are not divided: they only tell > 0
        if self.driver.all_reduce_hook is not None:
            self.driver.all_reduce_hook(grads)
        divisor = self.divisor
        if item.replicated:  # every whole gradient (replicated and stage-1 parameters), in order
            grads.div_(divisor)
            divided = range(n)
            pieces = grads.split([p.layout.numel for p in item.params])
            targets = [piece if p.policy.whole_grad else piece.view(p.layout.global_shape)  # (tp-local)
                       for p, piece in zip(item.params, pieces)]
        else:
            targets = self._reduce_plan(item.params).targets(recv)
            # divided on the way into .grad, only where some rank had a gradient: pieces that become a new
            # .grad of their own dtype in one foreach division here, the rest in their accumulation's pass
            fresh = [i for i, (p, flag) in enumerate(zip(item.params, flags))
                     if flag > 0 and p.sharded.grad is None and p.sharded.dtype == recv.dtype]
            if fresh:
                torch._foreach_div_([targets[i] for i in fresh], divisor)
            divided = set(fresh)
        due = self.ctx.grad_hooks_due
        for i, (p, local, flag) in enumerate(zip(item.params, targets, flags)):
            if flag <= 0:  # no rank had a gradient for it
                continue
            if p.policy.whole_grad:
                p.accumulate_whole_grad(local)
            else:
                p.accumulate_sharded_grad(local, None if i in divided else divisor)
            due.append((item.seq, i, p))

    def finish_reduce(self, item: PendingReduce) -> None:
        """Wait for a reduction and accumulate its result."""
        self.advance_reduce(item, block=True)

    def discard_reduce(self, item: PendingReduce) -> None:
        """Finish a reduction of an interrupted backward (every collective it involves, as on the peers)
        and drop its result."""
        item.discard = True
        self.advance_reduce(item, block=True)


def group_of(module: nn.Module) -> ParamGroup | None:
    """The group of a module ``fully_shard`` was applied to, or ``None``."""
    return module.__dict__.get(GROUP_ATTR)
