"""``ShardedModule``: the mixin class ``fully_shard`` adds to a module, and its user-facing methods."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn.utils import parametrize

from .group import ParamGroup

_GROUP_ATTR = "_perparam_group"
_CLASS_CACHE: dict[type, type] = {}


class StoredDtypeChangeError(TypeError):
    """``module.to(dtype)`` / ``.half()`` / ``.double()`` ... on a sharded module: refused."""


class UnshardedApplyError(RuntimeError):
    """``module.to(device)`` / ``to_empty`` ... while the unsharded parameters are registered: refused."""


class ShardedModule:
    """Mixed into every module passed to ``fully_shard``; ``isinstance(m, ShardedModule)`` tells.

    The methods act on the module's group (all modules of one ``fully_shard`` call share one group).
    """

    def _apply(self, fn, recurse=True):
        """``nn.Module.to``, ``.half()``, ``.cuda()``, ``to_empty`` ... all come here. A change of device
        (or ``to_empty``) is applied to the shards as usual; a change of the stored dtype is refused,
        before anything changes, with ``StoredDtypeChangeError``: the compute dtype, the all-gather
        layout and the reduce dtype were resolved from the stored dtypes at ``fully_shard``. Any change
        while the unsharded parameters are registered (after ``unshard()``) is refused likewise: it would
        reach the gathered copies and not the shards."""
        _refuse_dtype_change(self, fn)
        return super()._apply(fn, recurse)

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeError as e:  # the error path only: nothing is added to a call that succeeds
            explained = e.__dict__.pop("_perparam_explained", None)  # readers.note, from the post-forward hook
            if explained is None:
                raise
            raise explained from e

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the group's parameters and register them as plain tensors, until ``reshard()``, the
        end of the next forward (which reshards as usual) or the end of a backward through them.

        ``async_op=True`` issues the all-gather and returns an ``UnshardHandle`` at once (as FSDP2's):
        its ``wait()`` finishes the all-gather and registers the parameters; a forward also waits for it.
        """
        group = group_of(self)
        group.check_slots()
        group.start_unshard()
        handle = UnshardHandle(group)
        if async_op and handle.pending:
            return handle
        handle.wait()
        return UnshardHandle(None) if async_op else None

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
        ``.data`` and ``torch._foreach_*`` called by hand on the DTensors are not detected: call
        ``reshard()`` after them."""
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
        ``False`` keeps them from forward to backward (more memory, one all-gather fewer), and after a
        forward without grad (``torch.no_grad()``, evaluation or generation) until ``reshard()`` or the
        next forward with grad, so several evaluation forwards all-gather once. (FSDP2's root also keeps
        its parameters after a forward, to save the backward's all-gather; under no_grad it frees them.)"""
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for group in _groups_below(self, recurse):
            group.reshard_after_forward = reshard_after_forward


class UnshardHandle:
    """The all-gather of ``module.unshard(async_op=True)``; ``wait()`` finishes it and registers the
    unsharded parameters. Idempotent, and a no-op once something else finished that all-gather (a forward,
    ``reshard()``), as FSDP2's: it never registers parameters freed since."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group
        self._token = group.pending_gather() if group is not None else None

    @property
    def pending(self) -> bool:
        return self._token is not None

    def wait(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        if self._token is None:  # nothing was in flight: the parameters were gathered already
            if group.storage_alive:
                group.register_unsharded()
        elif group.pending_gather() is self._token:
            group.wait_unshard()
            group.register_unsharded()


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unshard/reshard hooks of ``module`` (sharded by ``fully_shard``) around
    ``module.<method_name>`` as around ``forward`` (FSDP2's ``register_fsdp_forward_method``): e.g.
    ``generate``, whose forwards inside then find the parameters gathered and issue no all-gather.

    Raises ``ValueError`` for a module ``fully_shard`` was not applied to or a method it does not have.
    """
    from . import hooks

    group = group_of(module)
    if group is None:
        raise ValueError(f"register_forward_method: {type(module).__name__} was not passed to fully_shard; "
                         "call it on the module fully_shard was applied to")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_forward_method: {type(module).__name__} has no method '{method_name}'")

    def wrapped(*args, **kwargs):
        args, kwargs = hooks.pre_forward(group, module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException as e:  # as forward's always_call hooks: a method that raises still reshards
            hooks.post_forward(group, module, args, kwargs, None)
            explained = e.__dict__.pop("_perparam_explained", None)  # perparam.readers.note
            if explained is None:
                raise
            raise explained from e
        return hooks.post_forward(group, module, args, kwargs, output)

    object.__setattr__(module, method_name, wrapped)


OWNED_ATTR = "_perparam_owned"


def guard_stored_dtypes(params) -> None:
    """Refuse stored-dtype changes on every module that registers one of ``params``, not only on the
    modules given to ``fully_shard``: ``model.layer.half()`` comes through the child's own ``_apply``."""
    for sp in params:
        for module, _ in sp.slots:
            module.__dict__.setdefault(OWNED_ATTR, []).append(sp)
            if not isinstance(module, ShardedModule) and "_apply" not in module.__dict__:
                module.__dict__["_apply"] = types.MethodType(_guarded_apply, module)


def _guarded_apply(self, fn, recurse=True):
    _refuse_dtype_change(self, fn)
    return type(self)._apply(self, fn, recurse)


def _refuse_dtype_change(module: nn.Module, fn) -> None:
    owned = {id(sp): sp for m in module.modules() for sp in m.__dict__.get(OWNED_ATTR, ())}
    for sp in owned.values():
        shard = sp.local_shard()
        probe = torch.empty(0, dtype=shard.dtype, device=shard.device)
        try:
            changed = fn(probe)
        except Exception:  # not a conversion a 0-element tensor can take; let nn.Module decide
            continue
        if isinstance(changed, torch.Tensor) and changed.dtype != probe.dtype:
            raise StoredDtypeChangeError(
                f"{type(module).__name__} holds parameters sharded by perparam; changing its parameters' dtype ('{sp.fqn}': "
                f"{probe.dtype} -> {changed.dtype}) after fully_shard is not supported: the compute dtype and "
                "the all-gather layout were fixed from the stored dtypes then. Build the model again, and to "
                f"compute in {changed.dtype} pass fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype="
                f"{changed.dtype})); to store in it, call model.to({changed.dtype}) before fully_shard")
        owner, name = sp.slots[0]
        if changed is not probe and sp.unsharded is not None and owner._parameters.get(name) is sp.unsharded:
            raise UnshardedApplyError(
                f"{class_name(module)} holds parameters sharded by perparam whose unsharded copies are registered "
                f"now (after unshard(); e.g. '{sp.fqn}'): .to() / .cuda() / to_empty() would change those copies "
                "and not the shards. Call reshard() on the sharded module first, then this")


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


def class_name(module: nn.Module) -> str:
    """The name of ``module``'s own class, without the ``Sharded`` subclass ``fully_shard`` swapped in."""
    cls = type(module)
    return cls.__bases__[1].__name__ if cls.__bases__[0] is ShardedModule else cls.__name__


def sharded_class(cls: type) -> type:
    """The subclass of ``cls`` that also derives from ``ShardedModule`` (one per class)."""
    sharded_cls = _CLASS_CACHE.get(cls)
    if sharded_cls is None:
        sharded_cls = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {"__module__": cls.__module__})
        _CLASS_CACHE[cls] = sharded_cls
    return sharded_cls


def attach(module: nn.Module, group: ParamGroup) -> None:
    """Swap ``module``'s class, in place, for a subclass that also derives from ``ShardedModule``.

    A module parametrized by ``torch.nn.utils.parametrize`` has a class of its own made by parametrize
    (its properties on top of the original class), which ``remove_parametrizations`` rolls back to its
    first base: that class is rebuilt on top of the sharded class, so the roll-back keeps the module
    sharded."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        module.__class__ = type(cls.__name__, (sharded_class(cls.__bases__[0]),), body)
    else:
        module.__class__ = sharded_class(cls)
    module.__dict__[_GROUP_ATTR] = group
