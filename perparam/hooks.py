"""When the collectives run: forward pre/post hooks, pre-backward hooks, post-backward and the root's
final callback.

Timeline of one training step for a group G (K ranks):

* pre-forward: all-gather G (one collective), register the unsharded tensors.
* post-forward: register the sharded DTensors again; free the unsharded storage when G reshards after
  forward, or when no backward can follow (grad disabled). The root keeps its storage for the backward
  that immediately follows (no second all-gather), as FSDP2 does.
* pre-backward (a hook on G's forward outputs): all-gather again if the storage was freed.
* post-backward (when every trainable unsharded parameter of G has accumulated its gradient):
  reduce-scatter G's gradients into the sharded ``.grad``s (unless gradient sync is off) and free.
* the root's final callback (queued on the autograd engine): finish every group whose post-backward did
  not fire (unused parameters, frozen groups), then free everything, before ``backward()`` returns.

The *root* is the outermost group whose forward runs while no other group's forward is running.
"""

from __future__ import annotations

import threading
from collections import deque

import torch
from torch import nn
from torch.autograd import Variable

from .cast import cast_floating, replace_tensors, tensors_in
from .group import ParamGroup

_local = threading.local()

#: issue the next group's all-gather (in the last forward's order) before computing this one
PREFETCH = True


def _active_root() -> ParamGroup | None:
    return getattr(_local, "root", None)


def tree_of(group: ParamGroup) -> list[ParamGroup]:
    """Every group in the module trees of ``group`` (itself first), computed once."""
    if group.tree is None:
        from .module import group_of

        seen: dict[int, ParamGroup] = {id(group): group}
        for module in group.modules:
            for sub in module.modules():
                g = group_of(sub)
                if g is not None:
                    seen.setdefault(id(g), g)
        group.tree = list(seen.values())
    return group.tree


def _start_iteration(root: ParamGroup) -> None:
    """A new root forward: drop storage kept for a backward that never came (it may be stale), and keep
    the last forward's group order for prefetching."""
    for g in tree_of(root):
        if not g.registered_unsharded and g.storage_alive and not g.in_backward:
            g.free()
    if root.forward_order:
        root.prefetch_order = {g: i for i, g in enumerate(root.forward_order)}
        root.prefetch_list = root.forward_order
    root.forward_order = []


def _prefetch(root: ParamGroup, group: ParamGroup, step: int) -> None:
    """Issue the all-gather of the group expected to run next, so it overlaps this group's compute:
    ``step=+1`` the next group of the last forward, ``-1`` the next in backward (reverse order)."""
    index = root.prefetch_order.get(group)
    if index is None or not PREFETCH:
        return
    # backward runs the root first (its output is the loss), then the groups in reverse forward order:
    # after the root (index 0) comes the last group
    j = (index + step) % len(root.prefetch_list)
    if j != index:
        root.prefetch_list[j].start_unshard()


def _recomputing() -> bool:
    """A forward run inside backward: activation checkpointing recomputing a region."""
    return torch._C._current_graph_task_id() != -1


def pre_forward(group: ParamGroup, module: nn.Module, args, kwargs):
    if _recomputing():  # the iteration's root, order and prefetching stay as the real forward left them
        group.forward_depth += 1
        group.unshard()
        group.register_unsharded()
    else:
        if _active_root() is None:
            _local.root = group
            _start_iteration(group)
        root = group.root = _active_root()
        if group.forward_depth == 0 and group not in root.forward_order:
            root.forward_order.append(group)
        group.forward_depth += 1
        group.unshard()
        group.register_unsharded()
        _prefetch(root, group, +1)
        if torch.is_grad_enabled() and not group.trainable():
            args, kwargs = _free_after_backward(group, args, kwargs)
    mp = group.mp_policy
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)
    return args, kwargs


def post_forward(group: ParamGroup, module: nn.Module, args, kwargs, output):
    group.forward_depth -= 1
    root = _active_root()
    recomputing = _recomputing()
    if group.forward_depth == 0:
        group.register_sharded()
        grad_enabled = torch.is_grad_enabled()
        # a recomputed region's backward follows at once: keep its parameters
        if not grad_enabled or (group.reshard_after_forward and group is not root and not recomputing):
            group.free()
        if grad_enabled:
            _register_pre_backward(group, output)
            for p in group.trainable():
                p.ensure_post_accumulate_hook(lambda _p, g=group, q=p: _on_grad_ready(g, q))
    if root is group and group.forward_depth == 0 and not recomputing:
        _local.root = None
    if group.mp_policy.output_dtype is not None:
        output = cast_floating(output, group.mp_policy.output_dtype)
    return output


class _FrozenPostBackward(torch.autograd.Function):
    """Identity on a frozen group's inputs; its backward runs once the group's backward is done (the
    gradient w.r.t. its inputs is computed), so the group can free its parameters then."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        group.frozen_backwards += 1
        if group.frozen_backwards >= group.frozen_calls:  # every call's backward is done
            group.free()
        return (None, *grads)


def _free_after_backward(group: ParamGroup, args, kwargs):
    """A group without trainable parameters gets no gradient hooks; free it after its backward through
    an identity function on its inputs (when some input requires grad: else no backward passes)."""
    inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not inputs:
        return args, kwargs
    group.frozen_calls += 1
    outputs = dict(zip(map(id, inputs), _FrozenPostBackward.apply(group, *inputs)))
    return replace_tensors((args, kwargs), lambda t: outputs.get(id(t), t))


def _register_pre_backward(group: ParamGroup, output) -> None:
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    for t in tensors:
        t.register_hook(lambda grad, g=group: _pre_backward(g))


def _pre_backward(group: ParamGroup) -> None:
    root = group.root or group
    if not root.callback_queued:
        root.callback_queued = True
        Variable._execution_engine.queue_callback(lambda r=root: _final_callback(r))
    if group.in_backward:
        return
    group.in_backward = True
    group.post_backward_done = False
    group.grads_arrived.clear()
    group.num_trainable = len(group.trainable())
    group.unshard()
    _prefetch(root, group, -1)


def _on_grad_ready(group: ParamGroup, param) -> None:
    if not group.in_backward or group.post_backward_done:
        return
    group.grads_arrived.add(id(param))
    if len(group.grads_arrived) == group.num_trainable:
        _post_backward(group)


#: reduce-scatters left in flight while backward computes on; the oldest is finished past this many
MAX_REDUCES_IN_FLIGHT = 2
#: (group, PendingReduce) in flight, oldest first; the final callback of backward finishes them all
_pending_reduces: deque = deque()


def _post_backward(group: ParamGroup) -> None:
    for item in group.reduce_grads(sync=group.requires_gradient_sync, defer=True):
        _pending_reduces.append((group, item))
    while len(_pending_reduces) > MAX_REDUCES_IN_FLIGHT:
        g, item = _pending_reduces.popleft()
        g.finish_reduce(item)
    group.free()
    group.post_backward_done = True


def _final_callback(root: ParamGroup) -> None:
    for g in tree_of(root):
        if g.in_backward and not g.post_backward_done:
            _post_backward(g)
    while _pending_reduces:
        g, item = _pending_reduces.popleft()
        g.finish_reduce(item)
    for g in tree_of(root):
        g.reshard()
        g.frozen_calls = g.frozen_backwards = 0
        g.in_backward = False
        g.post_backward_done = False
        g.grads_arrived.clear()
    root.callback_queued = False
