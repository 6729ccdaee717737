"""One ``fully_shard`` call (``ParamGroup``): its modules, settings, state and iteration bookkeeping, and
its mesh parts (``perparam.runtime.part.MeshPart``: the call's mesh first, then one per other
``ParamPolicy.mesh``), which it drives from each entry point: one all-gather per mesh per unshard whatever
the mix of dtypes, quantizations and placements; one reduce-scatter per (mesh, reduce dtype, wire format).

The group owns the collectives; ``hooks.py`` decides when they run. Its ``TrainingState`` is in
``perparam.runtime.state``; its iteration context (``perparam.runtime.context``, which hands the group its
buffer pool) is above it. Beside that state: the padded unsharded storage is *alive* or *freed*; the module
has the *sharded* DTensors or the *unsharded* tensors registered.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.buffers import BufferPool
from ..comm.process_groups import next_group_index
from .meshes import split_by_mesh
from .param import ShardedParam
from .part import MeshPart
from .reduction import PendingReduce
from .state import ALLOWED, StateError, TrainingState

#: where ``fully_shard`` keeps a module's group (in its ``__dict__``)
GROUP_ATTR = "_perparam_group"


class ParamGroup:
    """The parameters of one ``fully_shard`` call over a 1D mesh (shard) or 2D mesh (replicate, shard).

    ``modules``: the module(s) given to the call; ``params``: every managed parameter of the call in
    registration order, *whatever its mesh*: what the operations on the modules walk (registering the
    sharded or unsharded tensors, the slot checks, ``trainable()``, gradient accumulation without sync).
    ``parts``: one ``MeshPart`` per mesh, the call's mesh's first (its ``mesh_params`` may be empty), the
    others in ``perparam.runtime.meshes``' fixed order; what one mesh's all-gather, version check and
    reduction walk is its part's. The settings (divide factor, hooks, custom collectives,
    ``requires_all_reduce``, the offload hook), the pool and the context are the call's alone.

    The all-gather runs over the shard axis; on a 2D mesh gradients are reduce-scattered over the shard
    axis and then all-reduced over the replicate axis (HSDP). Replicated parameters are never gathered;
    their gradients are all-reduced over every data-parallel rank.
    """

    def __init__(self, modules: list[nn.Module], params: list[ShardedParam], mesh: DeviceMesh,
                 reshard_after_forward: bool, mp_policy, gradient_divide_factor: float | None = None,
                 auto_reshard_after_forward: bool = False) -> None:
        self.modules = modules
        self.params = params
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        # left to the default (None): as root the group keeps its parameters into backward (FSDP2's rule)
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.gradient_divide_factor = gradient_divide_factor  # None: the mesh's size (``MeshPart.divisor``)
        self.all_reduce_hook = None  # set_all_reduce_hook: sees each reduction's sum before the division
        self.reshard_after_backward = True
        # explicit prefetch (ShardedModule.set_modules_to_*_prefetch): groups, or None for the recorded order
        self.forward_prefetch: list[ParamGroup] | None = None
        self.backward_prefetch: list[ParamGroup] | None = None
        self.requires_gradient_sync = True
        # HSDP: False holds the reduce-scattered gradients until a reduction that all-reduces (partial.py)
        self.requires_all_reduce = True
        # perparam.InvariantUnits: reduce in the units' tree order (paths/reduce_invariant)
        self.invariant = False
        #: ``gate(group)`` before a backward reaches the group (perparam.InvariantUnits: refuses outside a
        #: unit)
        self.grad_gate = None
        # custom collectives: ShardedModule.set_custom_all_gather / _reduce_scatter
        self.all_gather_comm = None
        self.reduce_scatter_comm = None
        #: ``hook(read_ahead)`` from ``perparam.offload.tier.attach``: reads disk-tier shards in before an
        #: all-gather of any mesh packs them (``RuntimeConfig.gather_read_ahead`` groups ahead too)
        self.offload_hook = None
        self.registered_unsharded = False
        self.name = ", ".join(type(m).__name__ for m in modules)
        # per-iteration bookkeeping, driven by hooks.py (see perparam.runtime.state for the states)
        self.state = TrainingState.IDLE
        # its IterationContext (perparam.runtime.context): its own, then its root's from its first forward
        self.ctx = None
        self.pool = BufferPool(0)  # the context's pool, handed over by IterationContext.take
        self.forward_depth = 0
        self.saved_hooks: list = []  # perparam.runtime.saved: the saved-tensor hooks of a forward running
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
        mine, others = split_by_mesh(params, mesh)
        self.parts = [MeshPart(self, mesh, mine, self.index),
                      *(MeshPart(self, other, members, next_group_index()) for other, members in others)]
        #: the part of the call's own mesh (``parts[0]``), which the face, the benchmarks and the tests read
        #: as the call's (``own.num_shards``, ``own.gathered``, ``own.layout``, ``own.hpz``, its name in
        #: collectives and errors ``own._what``)
        self.own = self.parts[0]

    def transition(self, new: TrainingState) -> None:
        """Move to state ``new``; raises ``StateError`` for a transition ``perparam.runtime.state`` does not
        allow."""
        if new is not self.state and new not in ALLOWED[self.state]:
            raise StateError(f"perparam: group [{self.name}] cannot go from {self.state.value} to "
                             f"{new.value}; call module.reset() after an interrupted step, or report this as "
                             "a bug")
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

    def stale(self) -> bool:
        """The gathered storage may no longer match the shards: a ``torch.optim`` optimizer holding perparam
        parameters stepped (foreach updates do not bump a DTensor's version), a write to a sharded parameter
        was seen (``ShardedParam.writes``: ``torch._foreach_*``, ``.data``, ``runtime/writes.py``) or an
        in-place update bumped a sharded parameter's or its local shard's version since the all-gather."""
        return any(part._alive and part._versions() != part._gathered_versions for part in self.parts)

    def pool_bytes(self) -> int:
        """Bytes of CPU buffers one unshard and one reduction of this group take from the pool at most
        (``perparam.comm.buffers``): the all-gather's send row and the K - 1 rows it receives (plus K - 1
        copies of the send row for K > 2; none for a zero-copy all-gather, ``paths/gather_zero_copy.py``), and
        per reduce dtype the ``[K, n]`` reduce-scatter input and, for K > 2, its ``[K, n]`` receive buffer
        (``n``: padded local elements plus used flags; for K = 2 the peer's piece arrives in the output,
        ``perparam.comm.collectives``); a zero-copy reduce-scatter (``paths/reduce_zero_copy.py``) has no
        input buffer and for K > 2 one ``[K, n]`` staging buffer. Counts every sharded parameter, trainable or
        not (an upper bound). With parameters on several meshes: the sum over the meshes."""
        return sum(part._pool_bytes() for part in self.parts)

    def trainable(self) -> list[ShardedParam]:
        """The trainable parameters of every mesh (``params``), and those holding gradients accumulated
        without sync (``held_unsynced``); ``MeshPart.trainable()``: of one mesh."""
        held = self.held_unsynced
        return [p for p in self.params if p.sharded.requires_grad or (held and id(p) in held)]

    @property
    def unsynced(self) -> bool:
        """Gradients accumulated without sync wait for the next synchronising backward."""
        return bool(self.held_unsynced)

    def has_trainable(self) -> bool:
        """Some parameter of some mesh is trainable (``trainable()`` is not empty), told at the first one."""
        return bool(self.held_unsynced) or any(p.sharded.requires_grad for p in self.params)

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

    @torch.no_grad()
    def wait_unshard(self) -> None:
        """Wait for the all-gathers in flight and copy their rows out, rank by rank: straight into the padded
        buffers of plain parameters, through scratch pieces (dequantized) for quantized ones."""
        for part in self.parts:
            part._wait_unshard()

    def free(self, keep_secondary: bool = False) -> None:
        """Release the unsharded storage (no communication; an all-gather in flight is finished first).
        ``keep_secondary``: after a forward with grad, keep hpZ's secondary shard for the backward."""
        for part in self.parts:
            part.free(keep_secondary)

    def kept_unsharded(self) -> list[torch.Tensor]:
        """The unsharded buffers its stage-1/2 parameters keep across steps, where their storage is alive
        (``MeshPart.kept_unsharded``), mesh after mesh."""
        return [t for part in self.parts for t in part.kept_unsharded()]

    def relayout(self) -> None:
        """Derive the all-gather layouts and the plans again after parameters changed dtype
        (``ShardedParam.recast``, ``perparam.runtime.recast``), on every mesh's part
        (``MeshPart.relayout``)."""
        for part in self.parts:
            part.relayout()

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
        by ``MeshPart.divisor`` (the gradient divide factor; by default the mesh's size, i.e. the mean) and
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
        each reduction knowing its mesh's part (``PendingReduce.part``).
        """
        if not sync:
            trainable = self.trainable()
            for p in trainable:
                p.take_unsharded_grad(keep=True)
            self.held_unsynced.update(id(p) for p in trainable)
            return []
        pending = [item for part in self.parts for item in part._reduce(part.trainable())]
        self.held_unsynced = set()
        if not defer:
            for item in pending:
                self.finish_reduce(item)
            return []
        return pending

    @torch.no_grad()
    def advance_reduce(self, item: PendingReduce, block: bool) -> bool:
        """Move a reduction on: once its reduce-scatter has finished, issue the all-reduce over the
        replicate axis (HSDP, asynchronously); once that has finished, run the all-reduce hook (if any),
        divide by ``MeshPart.divisor`` and accumulate each parameter's piece into its sharded ``.grad``
        (when some rank had a gradient). ``block=False`` never waits (a reduction a peer has not issued yet
        must not stall this rank's backward) and leaves reductions with an all-reduce hook to a blocking call;
        returns whether the reduction is complete. Callers advance reductions in the order they were
        issued, so the all-reduces are issued in the same order on every rank. A reduction is advanced by
        the part of the mesh it runs on (``item.part``)."""
        return item.part._advance(item, block)

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
