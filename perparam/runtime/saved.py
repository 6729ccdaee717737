"""A group's backward found through what its forward saved for backward, not through its outputs.

The pre-backward hooks sit on the tensors ``cast.tensors_in`` finds in a forward's output. An output it
cannot see into (an instance of a plain class, a closure) carries none, and a group that frees its
parameters after forward would then run its backward on freed storage. Every backward computation that
reads a tensor of the forward, a parameter included, reads it through autograd's saved tensors: while the
forward of a group that frees after it runs with grad (not a root keeping its storage, nor
``reshard_after_forward=False``: their backward reads live storage), ``push`` wraps each tensor saved for
backward (a saved-tensor hook pair, ``torch.autograd.graph.saved_tensors_hooks``), and unpacking it in
backward first calls the group's ``on_unpack`` (its pre-backward, which all-gathers in the fixed order every
rank follows). The output hooks usually fire first; the saved tensors are the floor under them, whatever the
output is.

Hooks already active when the forward starts (activation checkpointing around the module, offload of
activations) keep doing their work: each tensor goes through them and the result is kept, and unpacking
calls theirs after ``on_unpack``. A region checkpointed *inside* the forward saves through its own hooks
(the innermost pair wins); it recomputes from the registered parameters, so the output hooks remain its
trigger (``hooks.output_tensors`` looks inside plain objects for them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import saved_tensors_hooks

_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)


def push(group, on_unpack: Callable) -> None:
    """From now until ``pop(group)``, every tensor saved for backward is tagged with ``group``; its unpack
    calls ``on_unpack(group)`` first. Pairs with ``pop``; nothing is pushed where torch has disabled
    saved-tensor hooks (a tracing context), and ``pop`` then pops nothing."""
    if not _enabled():
        group.saved_hooks.append(None)
        return
    outer = _top(False) if _top is not None else None
    if outer is None:
        def pack(t):
            return t.detach()  # the tensor itself would make a cycle with its grad_fn (a saved output)

        def unpack(t):
            on_unpack(group)
            return t
    else:
        outer_pack, outer_unpack = outer

        def pack(t):
            return outer_pack(t)

        def unpack(packed):
            on_unpack(group)
            return outer_unpack(packed)
    hooks = saved_tensors_hooks(pack, unpack)
    hooks.__enter__()
    group.saved_hooks.append(hooks)


def pop(group) -> None:
    """Undo the last ``push(group)`` (no-op when there is none)."""
    if group.saved_hooks:
        hooks = group.saved_hooks.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
