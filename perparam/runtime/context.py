"""Per-root state of one iteration: ``IterationContext``, above the groups it drives.

Everything that lives for one iteration (the root running now, the order in which groups ran forward and
backward, the reduce-scatters in flight, whether the final callback is queued, the buffer pool) belongs to
the context of the root whose tree the group is in, never to module globals: two models in one process (or
one thread each) never see each other's in-flight state. Every group starts in a context of its own
(``fully_shard``); the first forward in which a group acts as root hands its context to every group below
it (FSDP2 does the same in its lazy init). A context hands each group it takes its ``BufferPool``; the group
never imports this module.
"""

from __future__ import annotations

import warnings
from collections import deque
from operator import itemgetter

from ..comm.buffers import IN_FLIGHT_GROUPS, BufferPool
from .group import ParamGroup
from .reduction import PendingReduce
from .state import TrainingState

#: reductions left in flight while backward computes on before the queue is polled (finished ones are
#: accumulated; unfinished ones stay: a rank never waits for a reduction during backward)
MAX_REDUCES_IN_FLIGHT = 2


class IterationContext:
    """Per-root state of one iteration (forward + backward) of a tree of groups.

    ``groups``: every group of the tree, the root first, in module order (the order the final callback
    walks, the same on every rank). ``active_root``: the group whose forward is the outermost one running
    now (``None`` between forwards). ``forward_order``: the groups in the order their pre-forward ran this
    iteration; the last forward's order drives forward prefetching.
    Backward all-gathers and reductions follow orders derived from the forward only (the same on every
    rank), never the order in which this rank's backward happened to run.
    ``pending``: reduce-scatters in flight, oldest first. ``keep_gathered``: this backward builds a graph
    (``create_graph=True``), so parameters stay gathered for the backward through that graph.
    """

    def __init__(self, groups: list[ParamGroup]) -> None:
        self.groups = groups
        self.active_root: ParamGroup | None = None
        self.forward_order: list[ParamGroup] = []
        #: groups whose forward ran with grad since the last backward ended, in first-call order; reversed,
        #: the order in which every rank issues their reductions (``hooks._issue_reductions``)
        self.grad_order: list[ParamGroup] = []
        self.backward_groups: list[ParamGroup] = []  # of those, the ones a backward may need on some rank
        self.grad_order_closed = False  # a backward ended: the next root forward starts a new list
        self.reduce_order: list[ParamGroup] = []
        self.reduce_cursor = 0
        self.forward_seen: set[ParamGroup] = set()
        self.forward_next: dict[ParamGroup, ParamGroup] = {}  # the last forward's successor of each group
        # root -> its last forward order (the group, not id(): a key reused by another group would hand it
        # this order)
        self.last_forward: dict[ParamGroup, list[ParamGroup]] = {}
        #: this backward's expected order (root, then reverse forward order) and how far its all-gathers
        #: have been issued (``hooks._backward_gathers``)
        self.backward_expected: list[ParamGroup] = []
        self.gather_index: dict[ParamGroup, int] = {}
        self.gather_stop: dict[ParamGroup, int] = {}  # how far a group's pre-backward issues (prefetch.py)
        self.gather_cursor = 0
        self.pending: deque[tuple[ParamGroup, PendingReduce]] = deque()
        self.callback_queued = False
        self.keep_gathered = False
        #: groups whose unsharded storage the last backward left gathered
        #: (``set_reshard_after_backward(False)`` then, or ``create_graph=True``): the next root forward
        #: leaves it so whatever the setting says by then, as FSDP2 does (``hooks._start_iteration``); a
        #: shard changed since (an optimizer step) is gathered anew
        self.gathered_after_backward: set[ParamGroup] = set()
        #: (reduction's issue number, position in it, parameter) for each parameter whose sharded ``.grad``
        #: received a reduced gradient in this backward: their post-accumulate-grad hooks run at the end of
        #: the final callback (``run_grad_hooks``)
        self.grad_hooks_due: list = []
        self.issued = 0  # reductions issued through this context (``PendingReduce.seq``)
        self.pool = BufferPool(IN_FLIGHT_GROUPS * max((g.pool_bytes() for g in groups), default=0))

    def take(self, group: ParamGroup) -> None:
        """``group`` joins this context: its iteration state is this one and its collectives take their
        transient buffers from this context's pool."""
        group.ctx = self
        group.pool = self.pool

    # -- in-flight state -----------------------------------------------------------------------------
    def dirty(self) -> bool:
        """Something of an earlier iteration is still in flight (a backward that raised, or never ran its
        final callback)."""
        return (self.callback_queued or bool(self.pending)
                or any(g.state is not TrainingState.IDLE for g in self.groups))

    def add_pending(self, group: ParamGroup, items: list[PendingReduce]) -> None:
        """Queue reductions just issued and move the queue on without waiting: in backward a rank must
        never block on a reduction, since a peer may issue it only at its final callback (a branch whose
        output it did not use) while waiting on an all-gather this rank has yet to issue."""
        for item in items:
            item.seq = self.issued
            self.issued += 1
            self.pending.append((group, item))
        if len(self.pending) > MAX_REDUCES_IN_FLIGHT:
            self.poll_pending()

    def poll_pending(self) -> None:
        """Advance queued reductions in issue order as far as they have finished, without waiting."""
        for g, item in self.pending:
            if item.stage == 0 and not g.advance_reduce(item, block=False) and item.stage == 0:
                break  # the next all-reduces must wait for this one's: same order on every rank
        while self.pending and self.pending[0][1].stage == 2:
            self.pending.popleft()
        while self.pending and self.pending[0][0].advance_reduce(self.pending[0][1], block=False):
            self.pending.popleft()

    def finish_pending(self) -> None:
        while self.pending:
            g, item = self.pending.popleft()
            g.finish_reduce(item)

    def run_grad_hooks(self) -> None:
        """Run the post-accumulate-grad hooks users registered on the sharded parameters
        (``p.register_post_accumulate_grad_hook(fn)``, called as ``fn(p)``), once per reduced gradient, in
        the reductions' issue order, then the group's parameter order (the same on every rank, whatever
        order the reductions finished in). Called at the end of the final callback, when every reduction
        of the backward has finished and the model is back to IDLE: a hook that steps an optimizer
        (optimizer in backward) or issues collectives cannot change what this backward all-gathers."""
        due, self.grad_hooks_due = sorted(self.grad_hooks_due, key=itemgetter(0, 1)), []  # (seq, index)
        for _, _, p in due:
            hooks = p.sharded._post_accumulate_grad_hooks
            if hooks:
                for hook in tuple(hooks.values()):
                    hook(p.sharded)

    def reset(self, reason: str | None = None) -> None:
        """Drop whatever an interrupted iteration left: wait for the collectives in flight and discard their
        results, drop unsharded and locally accumulated gradients, register the sharded parameters, free
        the unsharded storage and put every group back to IDLE. Sharded ``.grad``s that earlier groups of
        the interrupted backward already received are kept (call ``optimizer.zero_grad()``)."""
        if reason:
            warnings.warn(f"perparam: {reason}; resetting the sharded model: collectives in flight are "
                          "finished and their results dropped, gradients accumulated without sync are "
                          "dropped", RuntimeWarning, stacklevel=3)
        while self.pending:
            g, item = self.pending.popleft()
            g.discard_reduce(item)
        for g in self.groups:
            g.drop_unsharded_grads()
            g.reshard()
            g.force_state(TrainingState.IDLE)
        self.active_root = None
        self.forward_order = []
        self.grad_order = []
        self.backward_groups = []
        self.reduce_order = []
        self.reduce_cursor = 0
        self.callback_queued = False
        self.keep_gathered = False
        self.gathered_after_backward = set()
        self.grad_hooks_due = []
