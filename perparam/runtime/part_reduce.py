"""A mesh part's reductions (``Reductions``, a base of ``MeshPart``): its trainable parameters split into
the sets reduced together, each issued through its path (``perparam.runtime.paths``), and the common
tail of every path, in one place: the HSDP all-reduce over the replicate axis, the partial hold
(``set_requires_all_reduce(False)``), the all-reduce hook, the division and the accumulation into the
sharded ``.grad``s."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..comm import collectives
from . import config, partial
from .param import ShardedParam
from .paths import choose
from .paths.reduce import ReduceFacts
from .reduction import PendingReduce, ReducePlan, reduce_plan


class Reductions:
    """The reduction side of a ``MeshPart`` (its fields: ``mesh_params``, ``num_shards``, ``hpz``,
    ``_reduce_plans``, ``partial_reduce``, the process groups, ``call``)."""

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
                if partial.hold(self, item):  # set_requires_all_reduce(False): all-reduced by a later reduction
                    item.stage = 2
                    return True
                partial.merge(self, item)
                if self.call.invariant:  # perparam.invariant: the replicas' subtree sums added in tree order
                    item.recv = collectives.tree_all_reduce_sum(item.recv, self.reduce_replicate_pg,
                                                                what=f"{self._what} invariant [{item.recv.dtype}]")
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
                return False  # a user hook may issue collectives: it runs in the final callback, in issue order
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
        grads = recv.narrow(0, 0, recv.numel() - item.flag_rows * n)  # flags are not divided: they only tell > 0
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
