"""One mesh's part of a ``fully_shard`` call (``MeshPart``): the parameters on that mesh, their layouts and
plans, the all-gather in flight, the held partial sums and hpZ's rows. The call (``ParamGroup``,
``perparam.runtime.group``) holds the settings, the state and the iteration bookkeeping, and drives its
parts (its own mesh's first, then one per other ``ParamPolicy.mesh``) from each entry point; a part reads
the settings from its ``call`` and has none of its own. The ways its bytes move are paths
(``perparam.runtime.paths``): a part asks the chooser, once per parameter set and facts, and keeps the
answer in its plans. The reduction side is ``part_reduce.Reductions``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..comm.buffers import BufferPool
from ..comm.process_groups import reduce_group
from ..sharding.layout import GroupLayout
from . import config, registration, shard_view, zero
from .param import ShardedParam
from .part_reduce import Reductions
from .paths import choose
from .paths.gather import GatherFacts
from .state import TrainingState

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


class _GatherPlan(NamedTuple):
    """What never changes for an all-gather of one set of parameters (``MeshPart._gather_plan``)."""

    facts: dict  # the set's facts the paths' rules read (``paths.choose.gather_set_facts``)
    sizes: list[int]  # bytes of each piece, in ``GroupLayout.order``
    scattered: list[bool]  # per member: plain ``Shard(d > 0)``, copied into slices of the unsharded tensor
    any_scattered: bool
    quantized: bool  # some member's pieces are quantized (not ``ShardedParam.plain``)
    #: the path chosen for this member set (``paths.choose.gather_path``), per ``GatherFacts`` of an unshard
    #: (with the rules' version it was chosen at)
    paths: dict


class MeshPart(Reductions):
    """The parameters of one call on one mesh (1D: shard; 2D: replicate, shard), ``mesh_params`` (in the
    call's registration order; ``gathered``, ``replicated`` and ``kept`` are sub-lists of it): what one
    all-gather, version check and reduction walk. ``call``: the ``ParamGroup`` it belongs to; ``index``:
    the call's for its own mesh's part, a creation index of its own for another mesh's."""

    def __init__(self, call, mesh: DeviceMesh, mesh_params: list[ShardedParam], index: int) -> None:
        self.call = call
        self.mesh = mesh
        self.index = index
        self.mesh_params = mesh_params
        self.num_shards = mesh.size(mesh.ndim - 1)
        self.num_replicas = mesh.size(0) if mesh.ndim == 2 else 1
        self.gathered = [p for p in mesh_params if p.layout.gathered]
        self.replicated = [p for p in mesh_params if not p.layout.gathered]
        self.layout = GroupLayout(tuple(p.pieces for p in self.gathered), self.num_shards)
        self.kept = [p for p in self.gathered if p.kept]  # stage 1/2: unsharded across steps (runtime/zero.py)
        self._layouts: dict[tuple[int, ...], GroupLayout] = {}  # all-gathers of some of ``gathered``
        self._plans: dict[int, _GatherPlan] = {}  # id(layout) of ``layout``/``_layouts`` -> its ``_gather_plan``
        self._reduce_plans: dict = {}  # a reduction's params -> its ``ReducePlan``
        self._versioned = [p for p in mesh_params if not p.kept]  # what ``_versions`` reads (``kept`` is fixed)
        self._what_cache: tuple | None = None  # ((path, registration generation), ``_what``)
        # HSDP: the reduce-scattered sums held until a reduction that all-reduces (partial.py)
        self.partial_reduce: dict = {}
        self._alive = False  # the unsharded storage holds the gathered parameters
        self._gathered_versions: tuple[int, ...] = ()  # the sharded parameters' versions when gathered
        self._pending_gather = None  # paths.gather.Gather: the all-gather in flight
        #: hpz.Secondary: the secondary partition ``fully_shard(reshard_after_forward=int)`` made for this
        #: mesh, and the one in use (``use_secondary``: ``set_reshard_after_forward`` turns it off and on)
        self.secondary = None
        self.hpz = None
        self._hpz_layout: GroupLayout | None = None  # the layout of the all-gather the hpZ rows came from

    # The call's iteration context and buffer pool (``IterationContext.take`` hands them to the call).
    @property
    def ctx(self):
        return self.call.ctx

    @property
    def pool(self) -> BufferPool:
        return self.call.pool

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
        """How collectives and errors name the part: the call's index, path below the root and classes, the
        mesh (another mesh's part), the parameters (the index tells apart groups of equal classes and shapes in
        debug mode). Built again only when the path is set or a parameter moved (``registration.move``
        renames it and bumps the registration generation): every collective names its group."""
        call = self.call
        key = (call.path, registration.generation())
        if self._what_cache is not None and self._what_cache[0] == key:
            return self._what_cache[1]
        where = f" '{call.path}'" if call.path else ""
        on = "" if self.index == call.index else f" on mesh {self.mesh.mesh.tolist()} of group #{call.index}"
        what = f"group #{self.index}{where} [{call.name}]{on} ({', '.join(p.fqn for p in self.mesh_params)})"
        self._what_cache = (key, what)
        return what

    def _versions(self) -> tuple[int, ...]:
        versions = []
        for p in self._versioned:  # the wrapper (DTensor in-place ops), the local shard (to_local().sub_())
            # and the steps of the optimizers holding it (foreach updates bump neither version); kept copies
            # (stage 1/2) are refreshed by step and load counts only (runtime/zero.py)
            sharded = p.sharded
            versions += (sharded._version, sharded._local_tensor._version, p.optimizer_steps, p.writes)
        return tuple(versions)

    def _pool_bytes(self) -> int:
        if self.num_shards == 1:
            return 0
        gather = 0
        if self.gathered:  # the path the forward all-gather of every member takes
            plan = self._gather_plan(self.gathered, self.layout)
            gather = self._gather_path(plan, False).pool_bytes(self, self.gathered, self.layout)
        cpu = all(p.local_shard().device.type == "cpu" for p in self.gathered)
        reduce = 0
        for (whole, dtype, wire, _), params in self._reduce_sets(self.gathered).items():  # pool: the packed paths
            plan = None if whole else self._reduce_plan(tuple(params), wire)
            reduce += self._reduce_path(plan, whole, wire, cpu).pool_bytes(self, params, dtype, wire)
        return gather + reduce

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
        if path.reads_shards and self.call.offload_hook is not None:
            self.call.offload_hook(config.current().gather_read_ahead)
        self._pending_gather = path.start(self, members, layout)

    def _gather_path(self, plan: _GatherPlan, secondary: bool):
        """The all-gather path of ``plan``'s member set now (``paths.choose``), chosen once per facts."""
        facts = GatherFacts(**plan.facts, secondary=secondary, custom=self.call.all_gather_comm is not None,
                            algorithm=config.current().gloo_all_gather, hpz=self.hpz is not None,
                            quantized=plan.quantized)
        return choose.gather_path(facts, plan.paths)

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
        if self.hpz is not None and self.call.state is TrainingState.FORWARD and not any(p.kept for p in members):
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
        for p in refresh:  # a shard swapped since (to_empty, a cast, ...) becomes the copy's rows again
            shard_view.link(p)
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

    def _gather_plan(self, members: list[ShardedParam], layout: GroupLayout) -> _GatherPlan:
        """What never changes for an all-gather of ``members`` (a sub-list of ``gathered``; ``layout`` from
        ``_layout_for``, one object per member set): built once per member set, as the layouts are. The
        member sets, their placements and quantization and the mesh's process group are fixed at
        ``fully_shard``; what may change between unshards is read at each one instead: the settings
        (``config``, a custom all-gather, hpZ) and the local shards' device (``to_empty``, ``.to``, a
        ``.data`` swap: ``gather_zero_copy.ZeroCopyGather.start``)."""
        plan = self._plans.get(id(layout))
        if plan is None:
            scattered = [p.plain and not p.layout.wire_is_layout for p in members]
            plan = self._plans[id(layout)] = _GatherPlan(
                choose.gather_set_facts(self, members), [layout.pieces[i][j].nbytes for i, j in layout.order],
                scattered, any(scattered), any(not p.plain for p in members), {})
        return plan

    def use_secondary(self, on: bool) -> None:
        """hpZ on (the secondary partition ``fully_shard`` made, if any) or off; the rows kept of the one in
        use are dropped."""
        if self.hpz is not None:
            self.hpz.drop(self.pool)
        self.hpz = self.secondary if on else None

    def relayout(self) -> None:
        """Derive the all-gather layouts and the plans again after parameters changed dtype
        (``ShardedParam.recast``, ``perparam.runtime.recast``); hpZ rows are dropped."""
        self.layout = GroupLayout(tuple(p.pieces for p in self.gathered), self.num_shards)
        self._layouts, self._plans, self._reduce_plans, self._hpz_layout = {}, {}, {}, None
        if self.hpz is not None:
            self.hpz.drop(self.pool)

    def kept_unsharded(self) -> list[torch.Tensor]:
        """The unsharded buffers this mesh's stage-1/2 parameters keep across steps, where their storage is
        alive."""
        return [p._padded for p in self.kept if p.storage_alive]

    def free(self, keep_secondary: bool = False) -> None:
        """Release this mesh's unsharded storage (no communication; an all-gather in flight is finished
        first). ``keep_secondary``: after a forward with grad, keep hpZ's secondary shard for the backward."""
        if self._pending_gather is not None:
            self._wait_unshard()
        if self.hpz is not None and not keep_secondary:
            self.hpz.drop(self.pool)
        for p in self.mesh_params:
            if not p.kept:  # stage 1/2 keep theirs across steps
                p.free()
        self._alive = False


class OwnPartViews:
    """What a ``fully_shard`` call (``ParamGroup``, which derives from this) shows of its own mesh's part
    (``parts[0]``) as its own, for the face, the benchmarks and the tests: the mesh's sizes, what it gathers,
    its layout and reduction plans, its stage-1/2 copies, hpZ in use, its name in collectives and errors."""

    parts: list[MeshPart]

    @property
    def num_shards(self) -> int:
        return self.parts[0].num_shards

    @property
    def num_replicas(self) -> int:
        return self.parts[0].num_replicas

    @property
    def gathered(self) -> list[ShardedParam]:
        return self.parts[0].gathered

    @property
    def kept(self) -> list[ShardedParam]:
        return self.parts[0].kept

    @property
    def layout(self) -> GroupLayout:
        return self.parts[0].layout

    @property
    def _reduce_plans(self) -> dict:
        return self.parts[0]._reduce_plans

    @property
    def hpz(self):
        return self.parts[0].hpz

    @property
    def divisor(self) -> float | int:  # every part's (``MeshPart.divisor``)
        return self.parts[0].divisor

    @property
    def _what(self) -> str:
        return self.parts[0]._what
