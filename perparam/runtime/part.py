"""One mesh's part of a ``fully_shard`` call (``MeshPart``): the parameters on that mesh, their layouts and
plans, the all-gather in flight, the held partial sums and hpZ's rows. The call (``ParamGroup``,
``perparam.runtime.group``) holds the settings, the state and the iteration bookkeeping, and drives its
parts (its own mesh's first, then one per other ``ParamPolicy.mesh``) from each entry point; a part reads
the settings from its ``call`` and has none of its own. The ways its bytes move are paths
(``perparam.runtime.paths``): a part asks the chooser, once per parameter set and facts, and keeps the
answer in its plans. Its reductions: its trainable parameters split into the sets reduced together, each
issued through its path, and the common tail of every path, in one place: the HSDP all-reduce over the
replicate axis, the partial hold (``set_requires_all_reduce(False)``), the all-reduce hook, the division and
the accumulation into the sharded ``.grad``s.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..comm import collectives
from ..comm.buffers import BufferPool
from ..comm.process_groups import reduce_group
from ..sharding.layout import GroupLayout
from . import config, partial, registration, shard_view, zero
from .param import ShardedParam
from .paths import choose
from .paths.gather import GatherFacts
from .paths.reduce import ReduceFacts
from .reduction import PendingReduce, ReducePlan, reduce_plan
from .state import TrainingState

if TYPE_CHECKING:
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


class MeshPart:
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
        # stage 1/2: unsharded across steps (runtime/zero.py)
        self.kept = [p for p in self.gathered if p.kept]
        self._layouts: dict[tuple[int, ...], GroupLayout] = {}  # all-gathers of some of ``gathered``
        # id(layout) of ``layout``/``_layouts`` -> its ``_gather_plan``
        self._plans: dict[int, _GatherPlan] = {}
        self._reduce_plans: dict = {}  # a reduction's params -> its ``ReducePlan``
        # what ``_versions`` reads (``kept`` is fixed)
        self._versioned = [p for p in mesh_params if not p.kept]
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
        mesh (another mesh's part), the parameters (the index tells apart groups of equal classes and shapes
        in debug mode). Built again only when the path is set or a parameter moved (``registration.move``
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
        # pool: the packed paths
        for (whole, dtype, wire, _), params in self._reduce_sets(self.gathered).items():
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
        if (self.hpz is not None and self.call.state is TrainingState.FORWARD
            and not any(p.kept for p in members)):
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

    # -- reductions: the sets reduced together, each through its path, the common tail of every path ----
    def trainable(self) -> list[ShardedParam]:
        """The trainable parameters of this mesh (``mesh_params``), and those holding gradients accumulated
        without sync (the call's ``held_unsynced``); ``ParamGroup.trainable()``: of every mesh."""
        held = self.call.held_unsynced
        return [p for p in self.mesh_params if p.sharded.requires_grad or (held and id(p) in held)]

    @property
    def divisor(self) -> float | int:
        """What a reduced gradient (the sum over this mesh's ranks) is divided by: the call's gradient divide
        factor, by default the call's mesh size (its own mesh part's ``num_shards * num_replicas``), also for
        the parameters on another mesh: the number of ranks whose losses are averaged."""
        factor = self.call.gradient_divide_factor
        own = self.call.parts[0]
        return own.num_shards * own.num_replicas if factor is None else factor

    def predivisor(self, dtype: torch.dtype) -> float:
        """What gradients reduced in ``dtype`` are divided by before the reduction, the rest of ``divisor``
        after it: for a dtype of narrow range (not fp32/bf16: fp16), about the square root of ``divisor``
        (its largest power-of-two factor ``f`` with ``f * f < divisor``, as FSDP2's), so neither the sum nor
        the gradients over-/underflow; 1 otherwise, and under ``InvariantUnits`` (its own division)."""
        divisor, pre = self.divisor, 1
        if dtype in (torch.float32, torch.bfloat16) or self.call.invariant:
            return 1
        while divisor % pre == 0 and divisor / pre > pre:
            pre *= 2
        return pre

    def _reduce_sets(self, params) -> dict[tuple, list[ShardedParam]]:
        """``params`` split into the sets reduced together, in order: keyed (whole, reduce dtype, wire
        format, apart); whole gradients (replicated, stage 1) all-reduced, the others one reduce-scatter
        per (reduce dtype, ``grad_quant``; none on one rank: nothing on the wire to quantize), and the
        parameters a path takes apart (``choose.apart``) one reduction of their own."""
        sets: dict[tuple, list] = defaultdict(list)
        apart = choose.apart(self)
        for p in params:
            whole = not p.layout.gathered or p.policy.whole_grad
            wire = None if whole or self.num_shards == 1 else p.policy.grad_quant
            sets[whole, p.policy.reduce_dtype, wire, apart is not None and apart(p, whole, wire)].append(p)
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
        for (whole, dtype, wire, apart), members in sets:
            params = tuple(members)
            tensors, used = zip(*(grads[id(p)] for p in params))
            pre = self.predivisor(dtype)
            if pre != 1:  # (the zeros of an unused gradient stay zeros)
                torch._foreach_div_([t for t, u in zip(tensors, used) if u], pre)
            plan = None if whole else self._reduce_plan(params, wire)
            path = self._reduce_path(plan, whole, wire, all(t.is_cpu for t in tensors), apart)
            item = path.issue(self, params, tensors, used, dtype, plan)
            item.part, item.predivided = self, pre
            pending.append(item)
        return pending

    def _reduce_path(self, plan: ReducePlan | None, whole: bool, wire, cpu: bool, apart: bool = False):
        """The reduction path of ``plan``'s parameter set now (``paths.choose``), chosen once per facts."""
        facts = ReduceFacts(**(plan.facts if plan is not None else {}), whole=whole, wire=wire,
                            custom=self.call.reduce_scatter_comm is not None,
                            algorithm=config.current().gloo_reduce_scatter, hpz=self.hpz is not None, cpu=cpu,
                            invariant=self.call.invariant, to_owner=apart, pair=self.num_shards == 2)
        return choose.reduce_path(facts, None if plan is None else plan.paths)

    def _reduce_plan(self, params: tuple[ShardedParam, ...], wire=None) -> ReducePlan:
        """What never changes for a reduction of ``params`` (a sub-tuple of ``mesh_params``, in order; one
        reduce dtype): offsets, this rank's views of the output, the set's facts the paths' rules read
        (``choose.reduce_set_facts``) and what a path works out once for it. Built once per parameter set
        (the trainable set may change between steps: another key); the layouts, shard ranks, placements and
        the mesh's process group are fixed at ``fully_shard``. What may change is read at each reduction
        instead, as for ``_gather_plan``: the settings (``config``, a custom reduce-scatter, hpZ) and the
        gradients' device (``to_empty``, ``.to``, a ``.data`` swap)."""
        plan = self._reduce_plans.get(params)
        if plan is None:
            facts = choose.reduce_set_facts(self, params)
            plan = self._reduce_plans[params] = reduce_plan(params, facts, wire)
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
                # set_requires_all_reduce(False): all-reduced by a later reduction
                if partial.hold(self, item):
                    item.stage = 2
                    return True
                partial.merge(self, item)
                if self.call.invariant:  # perparam.invariant: the replicas' subtree sums added in tree order
                    item.recv = collectives.tree_all_reduce_sum(item.recv, self.reduce_replicate_pg,
                                                                what=f"{self._what} invariant "
                                                                     f"[{item.recv.dtype}]")
                else:
                    item.work = collectives.all_reduce_sum(item.recv, self.reduce_replicate_pg, async_op=True,
                                                           what=f"{self._what} [{item.recv.dtype}]")
            item.stage = 1
        if item.work is not None:
            if not (block or item.work.is_completed()):
                return False
            item.work.wait()
            item.work = None
        if item.stage == 1 and not item.discard:
            if self.call.all_reduce_hook is not None and not block:
                # a user hook may issue collectives: it runs in the final callback, in issue order
                return False
            self._accumulate(item)
        item.stage = 2
        return True

    def _accumulate(self, item: PendingReduce) -> None:
        """Divide the summed gradients by ``divisor`` (after the all-reduce hook, if any) and add each
        parameter's piece to its sharded ``.grad``; a parameter some rank had a gradient for is queued for
        its post-accumulate-grad hooks (``IterationContext.run_grad_hooks``, at the end of backward); an
        offloaded one starts its optimizer state's read-ahead at once (``offload.grad_ready()``)."""
        recv, n = item.recv, len(item.params)
        flags = item.summed_flags()  # before any hook or division; read back only where this rank lacked one
        # flags are not divided: they only tell > 0
        grads = recv.narrow(0, 0, recv.numel() - item.flag_rows * n)
        if self.call.all_reduce_hook is not None:
            self.call.all_reduce_hook(grads)
        divisor = self.divisor / item.predivided
        divisor = None if divisor == 1 else divisor  # (1: a sum, or one rank: no division pass)
        if item.tail.accumulate(self, item, grads, flags, divisor):  # a path that accumulates its own way
            return
        if item.replicated:  # every whole gradient (replicated and stage-1 parameters), in order
            if divisor is not None:
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
            if fresh and divisor is not None:
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
            if p.offload is not None:
                p.offload.grad_ready()  # its optimizer state's read-ahead starts now, while backward goes on
            due.append((item.seq, i, p))
