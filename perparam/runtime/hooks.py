"""When the collectives run: forward pre/post hooks, pre-backward hooks, post-backward and the final callback.

Timeline of one training step for a group G (K ranks); the states are
``perparam.runtime.state.TrainingState``:

* pre-forward (IDLE -> FORWARD): all-gather G (one collective), register the unsharded tensors; when grad
  is enabled, pass G's inputs that require grad through an identity function whose backward marks the
  end of this call's backward (FSDP2 does the same).
* post-forward (FORWARD -> IDLE): register the sharded DTensors again; free the unsharded storage when
  G reshards after forward (a G of several modules: after the forward of the last one listed), or when
  no backward can follow (grad disabled). The root keeps its storage for the backward that immediately
  follows (no second all-gather), as FSDP2's does, unless ``reshard_after_forward=True`` was passed to its
  ``fully_shard`` or ``set_reshard_after_forward`` explicitly. Hooks on G's outputs wait for the gradient.
* pre-backward (IDLE -> PRE_BACKWARD), when the gradient reaches G's outputs, or a tensor G's forward saved
  for backward is read (``perparam.runtime.saved``), whichever comes first: the backward all-gathers
  are issued in a fixed order (the root, then the reverse forward order), up to G and one beyond (the
  prefetch); register the unsharded tensors, so a region recomputed inside G (activation checkpointing of
  a submodule) computes with them.
* post-backward (PRE_BACKWARD -> POST_BACKWARD), when the backward of every forward call of G has reached
  its inputs: register the sharded tensors and free. The reductions are issued in the reverse of the
  forward order as far as the groups' backwards are done on this rank: every trainable parameter in a
  fixed order, zeros where this rank had none (or, without gradient sync, the gradients are kept).
* the final callback (-> IDLE), queued on the autograd engine by the first pre-backward or gradient of
  the iteration: issue the all-gathers and reductions of the fixed orders that this rank's backward did
  not reach (a branch whose output this rank did not use), then, in module order, those of groups
  unsharded by hand and of groups that accumulated gradients without sync and are unused now; wait for
  every reduction in flight, before ``backward()`` returns.

Every rank therefore issues the same all-gathers in the same order, and the same reductions in the same
order, whatever its backward computed; the two sequences run on different process groups
(``perparam.comm.process_groups``), so how they interleave on a rank does not matter.

A gradient that reaches an unsharded parameter outside a backward the hooks saw (``unshard()`` then a
method other than ``forward``; a backward through a graph built with ``create_graph=True``) moves its group
to PRE_BACKWARD and queues the final callback, so every route reduces its gradients exactly once.

The *root* is the outermost group whose forward runs while no forward of its context is running; the
iteration's state lives in the root's ``IterationContext`` (``perparam.runtime.context``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.autograd import Variable

from . import config, prefetch, readers, saved
from .cast import cast_floating, replace_tensors, tensors_anywhere, tensors_in
from .context import IterationContext
from .entry_checks import TransformError, check_materialized, check_transforms  # noqa: F401 (re-exported)
from .group import ParamGroup, group_of
from .optim.registry import REGISTRY as OPTIMIZERS
from .state import TrainingState
from .untraced import untraced

IDLE, FORWARD = TrainingState.IDLE, TrainingState.FORWARD
PRE_BACKWARD, POST_BACKWARD = TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD


def tree_of(group: ParamGroup) -> list[ParamGroup]:
    """Every group in the module trees of ``group`` (itself first, then module order), computed once."""
    if group.tree is None:
        seen: dict[int, ParamGroup] = {id(group): group}
        for module in group.modules:
            for sub in module.modules():
                g = group_of(sub)
                if g is not None:
                    seen.setdefault(id(g), g)
        group.tree = list(seen.values())
    return group.tree


def _init_root(group: ParamGroup) -> None:
    """The first forward with ``group`` as root: one context for its whole tree."""
    tree = tree_of(group)
    ctx = IterationContext(tree)
    for i, module in enumerate(group.modules):
        prefix = f"{i}." if len(group.modules) > 1 else ""
        for name, sub in module.named_modules():
            g = group_of(sub)
            if g is not None and g.path is None:
                g.path = (prefix + name).rstrip(".") or type(module).__name__
    prefetch.check_targets(tree)
    for g in tree:
        if g.ctx.dirty():
            g.ctx.reset("a sharded submodule was left mid-iteration before its parent's first forward")
        ctx.take(g)


def _recomputing() -> bool:
    """A forward run inside backward: activation checkpointing recomputing a region."""
    return torch._C._current_graph_task_id() != -1


def _start_iteration(ctx: IterationContext, root: ParamGroup) -> None:
    """A new root forward: drop storage gathered for a backward that never came (it may be stale) unless
    the group leaves it gathered deliberately (``set_reshard_after_backward(False)`` now, or the last backward
    did: ``ctx.gathered_after_backward``, so the last micro-batch of FSDP2's ``set_reshard_after_backward(
    is_last)`` gathers nothing in forward), and index the last forward's order for prefetching. An optimizer
    step this thread left open (its step proper raised) is over (``perparam.runtime.optim.binding``)."""
    OPTIMIZERS.forward_began()
    grad_enabled = torch.is_grad_enabled()
    gathered, ctx.gathered_after_backward = ctx.gathered_after_backward, set()
    for g in ctx.groups:
        if g.registered_unsharded or not g.storage_alive or not g.reshard_after_backward or g in gathered:
            continue
        if grad_enabled or g.reshard_after_forward:  # kept by no_grad forwards until a training forward
            g.free()
    ctx.forward_order = []
    ctx.forward_seen = set()
    if ctx.grad_order_closed:  # a backward ended since: this forward starts the next reduction order
        ctx.grad_order = []
        ctx.backward_groups = []
        ctx.grad_order_closed = False
    last = ctx.last_forward.get(root, [])
    ctx.forward_next = {g: last[i + 1] for i, g in enumerate(last[:-1])}


def _prefetch(nxt: ParamGroup | None, done: set | None = None) -> None:
    """Issue ``nxt``'s all-gather (a target of ``prefetch.forward_targets``) if it has not started its
    backward yet (never a group that is done) and, in forward, has not run its forward in this iteration
    yet (``done``)."""
    if nxt is not None and nxt.state is IDLE and (done is None or nxt not in done):
        nxt.start_unshard()


@untraced
def pre_forward(group: ParamGroup, module: nn.Module, args, kwargs):
    check_transforms(group)
    if _recomputing():  # the iteration's state, order and prefetching stay as the real forward left them
        group.forward_depth += 1
        group.unshard()
        group.register_unsharded()
    else:
        if group.forward_depth == 0:
            group.check_slots()
        ctx = group.ctx
        if ctx.active_root is None:
            if group.tree is None and group.ctx.groups[0] is group:  # not yet adopted by a parent root
                _init_root(group)
                ctx = group.ctx
            if ctx.dirty():
                ctx.reset("the previous iteration did not finish (an exception in forward or backward?)")
            check_materialized(ctx)
            ctx.active_root = group
            _start_iteration(ctx, group)
        if group.forward_depth == 0:
            group.transition(FORWARD)
            if group not in ctx.forward_seen:
                ctx.forward_seen.add(group)
                ctx.forward_order.append(group)
            if torch.is_grad_enabled() and group not in ctx.grad_order:
                ctx.grad_order.append(group)
                # its backward may need its parameters on some rank: part of the fixed backward
                # all-gather order, unless it can have no backward anywhere (nothing trainable and no
                # floating-point input: e.g. a frozen embedding of token ids)
                if group.has_trainable() or any(t.is_floating_point() for t in tensors_in((args, kwargs))):
                    ctx.backward_groups.append(group)
        group.forward_depth += 1
        group.unshard()
        group.register_unsharded()
        for target in prefetch.forward_targets(group, ctx.forward_next.get(group), config.current().prefetch):
            _prefetch(target, ctx.forward_seen)
        if torch.is_grad_enabled():
            args, kwargs = _track_backward(group, args, kwargs)
    mp = group.mp_policy
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)
    frees = group.reshard_after_forward and not (group is group.ctx.active_root
                                                 and group.auto_reshard_after_forward)
    if frees and group.forward_depth == 1 and not _recomputing() and torch.is_grad_enabled():  # storage freed
        # after forward: its backward must gather; last, post_forward pops it
        saved.push(group, _saved_unpacked)
    return args, kwargs


@untraced
def post_forward(group: ParamGroup, module: nn.Module, args, kwargs, output):
    if output is None and sys.exc_info()[1] is not None:  # the forward raised (always_call hook)
        readers.note(sys.exc_info()[1], group)
    if group.forward_depth == 0:  # no pre-forward to close: it refused the call (and raised)
        return output
    group.forward_depth -= 1
    ctx = group.ctx
    recomputing = _recomputing()
    if group.forward_depth == 0 and not recomputing:
        saved.pop(group)
    if group.forward_depth == 0:
        grad_enabled = torch.is_grad_enabled()
        if recomputing:
            # a recomputed region's backward follows at once: keep the storage; a group already in its
            # backward keeps its unsharded parameters registered for the rest of it
            if group.state is not PRE_BACKWARD:
                group.register_sharded()
        else:
            group.register_sharded()
            # with grad the root keeps its parameters for the backward that follows, unless its
            # reshard_after_forward=True was asked for explicitly; without grad no backward follows, and
            # reshard_after_forward=False keeps them for the next forward; a group of several modules frees
            # after its last module's forward (as listed): one all-gather for all
            keep_as_root = group is ctx.active_root and grad_enabled and group.auto_reshard_after_forward
            if group.reshard_after_forward and not keep_as_root and module is group.modules[-1]:
                group.free(keep_secondary=grad_enabled)  # hpZ: a backward may follow
            group.transition(IDLE)
        if grad_enabled:
            _register_pre_backward(group, output)
    if not recomputing and ctx.active_root is group and group.forward_depth == 0:
        ctx.active_root = None
        ctx.last_forward[group] = ctx.forward_order
        for g in ctx.groups:  # prefetched for a forward that took another path this time: release
            if g.state is IDLE and g.pending_gather() is not None and g not in ctx.forward_seen:
                g.free()
    if group.mp_policy.output_dtype is not None:
        output = cast_floating(output, group.mp_policy.output_dtype)
    return output


class _PostBackward(torch.autograd.Function):
    """Identity on a group's inputs; its backward runs once the backward of that forward call has reached
    the inputs, i.e. the group's gradients for that call are computed."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        group.calls_pending -= 1
        if group.calls_pending == 0 and group.untracked_calls == 0 and group.state is PRE_BACKWARD:
            _post_backward(group)
        return (None, *grads)


def _track_backward(group: ParamGroup, args, kwargs):
    """Count this forward call; route its inputs that require grad through ``_PostBackward``. A call
    without such inputs cannot be tracked: the group's post-backward then runs in the final callback."""
    inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not inputs:
        group.untracked_calls += 1
        return args, kwargs
    group.calls_pending += 1
    outputs = dict(zip(map(id, inputs), _PostBackward.apply(group, *inputs)))
    return replace_tensors((args, kwargs), lambda t: outputs.get(id(t), t))


def _register_pre_backward(group: ParamGroup, output) -> None:
    """Hooks on the output tensors that need grad, wherever the output holds them (plain objects too;
    a leaf only where ``tensors_in`` finds it). The floor under them: ``saved.push``."""
    found = {id(t): t for t in tensors_in(output)}
    hooked = [t for t in tensors_anywhere(output)
              if t.requires_grad and (t.grad_fn is not None or id(t) in found)]
    for t in {id(t): t for t in hooked}.values():
        t.register_hook(lambda grad, g=group: _pre_backward(g))


def _saved_unpacked(group: ParamGroup) -> None:
    """A tensor saved in ``group``'s forward is read by a backward: the group's backward has begun, even
    where no output hook told it (an output perparam cannot see into)."""
    if group.state is IDLE and _recomputing():
        _pre_backward(group)


def _queue_final_callback(ctx: IterationContext) -> None:
    """At the first hook of a backward: fix this backward's reduction order and queue the final callback."""
    if not ctx.callback_queued:
        ctx.callback_queued = True
        # reductions: the groups with trainable parameters, in reverse forward order (the same on every
        # rank; whether a group's inputs require grad may differ between ranks, so it must not matter)
        ctx.reduce_order = [g for g in ctx.grad_order[::-1] if g.has_trainable()]
        ctx.reduce_cursor = 0
        # the root first (when it has a backward: a root without parameters has none), then the reverse
        # forward order (groups that may have a backward on some rank)
        hooked = ctx.backward_groups
        first = hooked[:1] if hooked and hooked[0] is ctx.groups[0] else []
        # each followed by its explicit backward prefetches (perparam.runtime.prefetch)
        ctx.backward_expected, ctx.gather_index, ctx.gather_stop = prefetch.backward_sequence(
            first + hooked[len(first):][::-1], config.current().prefetch)
        ctx.gather_cursor = 0
        for g in ctx.groups:
            g.reduced = False
        Variable._execution_engine.queue_callback(lambda c=ctx: _final_callback(c))


def _backward_gathers(ctx: IterationContext, group: ParamGroup) -> None:
    """Issue the backward all-gathers in a fixed order, the same on every rank: the root first (its output
    is the loss), then the groups in the reverse of their forward order. When ``group`` starts its
    backward, every group before it in that order that has not been gathered in this backward is
    gathered first (a group whose backward does not run on this rank still gets the all-gather its peers
    issue), then the one after it (the prefetch). Each group is gathered at most once per backward, so a
    group whose backward is done is never gathered again; a group that holds its storage issues nothing."""
    index = ctx.gather_index.get(group)
    if index is None:  # not forwarded with grad in this iteration (unsharded by hand): its own all-gather
        group.start_unshard()
        return
    order = ctx.backward_expected
    stop = ctx.gather_stop[group]
    while ctx.gather_cursor < stop:
        order[ctx.gather_cursor].start_unshard()
        ctx.gather_cursor += 1


@untraced
def _pre_backward(group: ParamGroup) -> None:
    if group.grad_gate is not None and group.state is not PRE_BACKWARD:
        group.grad_gate(group)  # before anything is issued: it may refuse
    ctx = group.ctx
    _queue_final_callback(ctx)
    if group.state is PRE_BACKWARD:
        return
    group.transition(PRE_BACKWARD)
    group.reduced = False
    if torch.is_grad_enabled():  # backward(create_graph=True): a backward through this graph may follow
        ctx.keep_gathered = True
    _backward_gathers(ctx, group)
    group.unshard()
    group.register_unsharded()


def grad_ready(group: ParamGroup, _param=None) -> None:
    """A gradient was accumulated into one of ``group``'s unsharded parameters (``_param``: which one, the
    hook's argument, unused). In the group's backward (every gradient but a late one) there is nothing to
    do: told here, before the runtime's untraced entry point, once per parameter per backward."""
    if group.state is not PRE_BACKWARD:
        _late_grad(group)


@untraced
def _late_grad(group: ParamGroup) -> None:
    # outside a backward the hooks saw (manual unshard, a graph built with create_graph), or after the
    # group's post-backward (a parameter also used before the group's forward): reduce at the final callback
    if group.grad_gate is not None:
        group.grad_gate(group)
    group.transition(PRE_BACKWARD)
    group.reduced = False
    _queue_final_callback(group.ctx)


def _post_backward(group: ParamGroup) -> None:
    """``group``'s backward is done on this rank: free its parameters, then issue whatever reductions the
    fixed order now allows."""
    _backward_done(group)
    _issue_reductions(group.ctx)


def _backward_done(group: ParamGroup) -> None:
    group.transition(POST_BACKWARD)
    group.register_sharded()
    if group.reshard_after_backward and not group.ctx.keep_gathered:
        group.free()


def _reduce(group: ParamGroup) -> None:
    ctx = group.ctx
    ctx.add_pending(group, group.reduce_grads(sync=group.requires_gradient_sync, defer=True))
    group.reduced = True


def _issue_reductions(ctx: IterationContext) -> None:
    """Issue the reductions of the groups whose forward ran with grad, in the reverse of their forward
    order (the same on every rank), as far as their backwards are done on this rank. A group whose
    backward does not run here (its output unused on this rank) holds the queue until the final
    callback: later reductions wait, but every rank issues the same collectives in the same order."""
    order = ctx.reduce_order
    while ctx.reduce_cursor < len(order):
        g = order[ctx.reduce_cursor]
        if not g.reduced:
            if g.state is not POST_BACKWARD:
                return
            _reduce(g)
        ctx.reduce_cursor += 1


@untraced
def _final_callback(ctx: IterationContext) -> None:
    for g in ctx.groups:
        if g.state is PRE_BACKWARD:
            _backward_done(g)
    while ctx.gather_cursor < len(ctx.backward_expected):  # the all-gathers peers issued for backwards
        ctx.backward_expected[ctx.gather_cursor].start_unshard()  # that did not run here
        ctx.gather_cursor += 1
    for g in ctx.reduce_order[ctx.reduce_cursor:]:  # the fixed order, whatever ran here
        if not g.reduced:
            _reduce(g)
    ctx.reduce_cursor = len(ctx.reduce_order)
    for g in ctx.groups:  # module order: the same on every rank
        if g.state is POST_BACKWARD and not g.reduced:  # unsharded by hand, or a late gradient
            _reduce(g)
        elif g.state is IDLE and g.unsynced and g.requires_gradient_sync and not g.reduced:
            _reduce(g)  # accumulated without sync earlier, unused in this synchronising backward
    ctx.finish_pending()
    for g in ctx.groups:
        g.register_sharded()
        if g.reshard_after_backward and not ctx.keep_gathered:
            g.free()
        g.force_state(IDLE)
    ctx.gathered_after_backward = {g for g in ctx.groups if g.storage_alive}
    ctx.grad_order_closed = True
    ctx.keep_gathered = False
    ctx.callback_queued = False
    ctx.run_grad_hooks()  # last: the model is IDLE and clean whatever a hook does (or raises)
