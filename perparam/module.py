"""``ShardedModule``: the mixin class ``fully_shard`` adds to a module, and its user-facing methods."""

from __future__ import annotations

from torch import nn

from .group import ParamGroup

_GROUP_ATTR = "_perparam_group"
_CLASS_CACHE: dict[type, type] = {}


class ShardedModule:
    """Mixed into every module passed to ``fully_shard``; ``isinstance(m, ShardedModule)`` tells.

    The methods act on the module's group (all modules of one ``fully_shard`` call share one group).
    """

    def unshard(self) -> None:
        """All-gather the group's parameters and register them as plain tensors, until ``reshard()`` or
        the end of the next forward (which reshards as usual)."""
        group = group_of(self)
        group.unshard()
        group.register_unsharded()

    def reshard(self) -> None:
        """Register the sharded DTensors again and free the unsharded storage (no communication)."""
        group_of(self).reshard()

    def reset(self) -> None:
        """Abandon an interrupted iteration (an exception in forward or backward) of the model this module
        belongs to: finish the collectives in flight and drop their results, drop gradients accumulated
        without sync, reshard everything and start clean. The next root forward does this by itself (with
        a warning) when it finds such a state. Sharded ``.grad``s already reduced are kept: call
        ``optimizer.zero_grad()`` to drop them too."""
        group = group_of(self)
        group.ctx.reset()

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the unsharded parameters gathered after backward until ``reshard()`` (or until a
        shard changes in place, e.g. an optimizer step, which the next unshard detects and all-gathers
        anew): no all-gather in the next forward of a gradient-accumulation micro-batch, and the
        parameters a second backward through a ``create_graph=True`` graph needs stay valid. A backward
        with ``create_graph=True`` keeps them until the end of the next backward by itself. Writes through
        ``.data`` are not detected: call ``reshard()`` after them."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"reshard_after_backward must be a bool, got {reshard_after_backward!r}")
        for group in _groups_below(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: keep accumulating unsharded gradients locally across micro-batches, with no
        communication; the next backward with sync on reduce-scatters the sum. ``recurse`` applies the
        setting to every sharded module below this one too."""
        for group in _groups_below(self, recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """``True`` frees the unsharded parameters after forward and all-gathers again in backward;
        ``False`` keeps them from forward to backward (more memory, one all-gather fewer)."""
        for group in _groups_below(self, recurse):
            group.reshard_after_forward = reshard_after_forward


def group_of(module: nn.Module) -> ParamGroup | None:
    return module.__dict__.get(_GROUP_ATTR)


def _groups_below(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    modules = module.modules() if recurse else [module]
    groups: dict[int, ParamGroup] = {}
    for m in modules:
        g = group_of(m)
        if g is not None:
            groups.setdefault(id(g), g)
    return list(groups.values())


def attach(module: nn.Module, group: ParamGroup) -> None:
    """Swap ``module``'s class, in place, for a subclass that also derives from ``ShardedModule``."""
    cls = type(module)
    sharded_cls = _CLASS_CACHE.get(cls)
    if sharded_cls is None:
        sharded_cls = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {"__module__": cls.__module__})
        _CLASS_CACHE[cls] = sharded_cls
    module.__class__ = sharded_cls
    module.__dict__[_GROUP_ATTR] = group
