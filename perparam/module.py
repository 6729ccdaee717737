"""``ShardedModule``: the mixin class ``fully_shard`` adds to a module, and its user-facing methods."""

from __future__ import annotations

import functools
import sys
import types
from collections import OrderedDict

import torch
from torch import nn
from torch.nn.utils import parametrize

from .comm import peers, sequence
from .errors import ShardingError
from .hf import methods as hf_methods
from .module_settings import ShardedModuleSettings, _groups_below, check_divide_factor  # noqa: F401 (re-exported)
from .runtime import hooks, readers, recast, writes, zero
from .runtime.group import GROUP_ATTR, ParamGroup, group_of
from .runtime.registration import BASE_ATTR, OWNED_ATTR, class_name
from .runtime.untraced import untraced

_CLASS_CACHE: dict[type, type] = {}


class StoredDtypeChangeError(ShardingError, TypeError):
    """``module.to(dtype)`` / ``.half()`` / ``.double()`` ... on a sharded module that perparam cannot follow
    (``perparam.runtime.recast.problem``: stored-quantized or offloaded parameters, precision islands,
    gradients held between micro-batches). A ``ShardingError`` and a ``TypeError``, the type
    ``nn.Module.to`` raises for a dtype it does not take."""


class DeepcopyError(ShardingError, AssertionError):
    """``copy.deepcopy`` of a sharded module: refused. A ``ShardingError`` and an ``AssertionError``, the type
    FSDP2 raises for it."""


class UnshardedApplyError(RuntimeError):
    """``module.to(device)`` / ``to_empty`` ... while the unsharded parameters are registered: refused."""


class ShardedModule(ShardedModuleSettings):
    """Mixed into every module passed to ``fully_shard``; ``isinstance(m, ShardedModule)`` tells.

    The methods act on the module's group (all modules of one ``fully_shard`` call share one group).
    FSDP2's ``FSDPModule`` names that have a meaning in perparam are here with that meaning
    (``set_reduce_scatter_max_input_buffers`` is accepted and changes nothing, saying why).
    """

    def _apply(self, fn, recurse=True):
        """``nn.Module.to``, ``.half()``, ``.cuda()``, ``to_empty`` ... all come here. A change of device
        (or ``to_empty``) is applied to the shards as usual; a change of the stored dtype casts the shards
        and derives the compute dtype, the all-gather layout and the reduce dtype again
        (``perparam.runtime.recast``), or is refused before anything changes with
        ``StoredDtypeChangeError`` where that cannot be followed. Any change while the unsharded
        parameters are registered (after ``unshard()``) is refused with ``UnshardedApplyError``: it would
        reach the gathered copies and not the shards."""
        owned = _refuse_dtype_change(self, fn)
        zero.invalidate()  # stage-1/2 kept copies: refreshed at the next all-gather
        out = super()._apply(fn, recurse)
        recast.follow(owned)
        writes.rebind(owned)  # torch's _apply swapped new DTensors in: track their writes again
        return out

    def __deepcopy__(self, memo):
        """Refused with ``DeepcopyError`` (as FSDP2 refuses it, with its ``AssertionError``): a copy would share
        the original's group, hooks and process groups, so its forward would all-gather the original's
        parameters and leave its own sharded."""
        raise DeepcopyError(
            f"copy.deepcopy of {class_name(self)}, a module sharded by fully_shard, is not supported (FSDP2: FSDP does "
            "not support deepcopy. Please use state dict for serialization): the copy would "
            "keep the original's group and hooks (its forward would all-gather the original's parameters). "
            "Deepcopy the model before fully_shard and shard the copy with calls of its own, or build it again "
            "and load the values: state = perparam.full_state.full_state_dict(model) on every rank, then "
            "perparam.full_state.load_full_state_dict(new_sharded_model, state)")

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeError as e:  # the error path only: nothing is added to a call that succeeds
            if isinstance(e, peers.PeerLostError):  # the frames below (modules, hooks, c10d) say nothing more
                raise e.with_traceback(None) from None
            explained = e.__dict__.pop("_perparam_explained", None)  # readers.note, from the post-forward hook
            if explained is None:
                group = group_of(self)
                path = f" '{group.path}'" if group is not None and group.path else ""
                where = f"the forward of {class_name(self)}{path}"
                explained = peers.explain(e, where) or sequence.explain_wait(e, where)
            if explained is None:
                raise
            raise explained from e

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        """Read by ``DistributedDataParallel`` at its construction (``hasattr``): a sharded model wrapped in DDP
        (directly, or by accelerate's ``prepare`` or transformers' ``Trainer``) is refused here, naming the
        routes that work, instead of failing in DTensor's ops at DDP's first broadcast."""
        raise ShardingError(
            f"perparam: DistributedDataParallel cannot wrap {type(self).__name__}, which fully_shard sharded: perparam "
            "already reduces its gradients. Train the sharded model as it is; under transformers' Trainer use "
            "perparam.hf_trainer.ShardedTrainer, under accelerate perparam.hf_accelerate.ShardedAccelerator (or do "
            "not pass the model to Accelerator.prepare) (docs/huggingface.md)")

    @untraced
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

    @untraced
    def reshard(self) -> None:
        """Register the sharded DTensors again and free the unsharded storage (no communication)."""
        group_of(self).reshard()

    def mark_shards_written(self, *, recurse: bool = True) -> None:
        """Tell perparam that the shards of this module's parameters (and, with ``recurse``, of every sharded
        module below) were written by a route it cannot see: into ``p.to_local()``, or into the tensors
        ``state_dict()`` handed out (``dcp.load(model.state_dict())`` without ``model.load_state_dict``).
        Unsharded storage kept across the write (ZeRO stage 1/2 copies, ``reshard_after_forward=False``,
        ``set_reshard_after_backward(False)``, parameters kept gathered for evaluation) is all-gathered
        afresh at its next use. Call it on every rank: it decides the size of the next all-gathers. Writes
        through the parameters themselves (in-place ops, ``torch._foreach_*``, ``.data =``, ``torch.nn.init``,
        optimizer steps, ``load_state_dict``) are seen without it (``perparam/runtime/writes.py``)."""
        for group in _groups_below(self, recurse):
            for sp in group.params:
                sp._writes += 1

    def _perparam_kept_unsharded(self) -> list[torch.Tensor]:
        """``perparam.sharding.live.ReportsKeptCopies``: what ``perparam.memory.measure`` counts as kept."""
        group = group_of(self)
        return group.kept_unsharded() if group is not None else []

    @untraced
    def reset(self) -> None:
        """Abandon an interrupted iteration (an exception in forward or backward) of the model this module
        belongs to: finish the collectives in flight and drop their results, drop gradients accumulated
        without sync, reshard everything and start clean. The next root forward does this by itself (with
        a warning) when it finds such a state. Sharded ``.grad``s already reduced are kept: call
        ``optimizer.zero_grad()`` to drop them too."""
        group = group_of(self)
        group.ctx.reset()

    def reset_iter_state(self) -> None:
        """FSDP2's name for ``reset()``, with its meaning: after an exception aborted a forward or backward,
        finish the collectives in flight, discard the reductions of the failed iteration and the
        gradients accumulated without sync, reshard every group and start the next iteration clean.
        FSDP2 requires the root; perparam accepts any sharded module of the model."""
        self.reset()


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

    @untraced
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
            explained = e.__dict__.pop("_perparam_explained", None)  # perparam.runtime.readers.note
            if explained is None:
                raise
            raise explained from e
        return hooks.post_forward(group, module, args, kwargs, output)

    object.__setattr__(module, method_name, wrapped)


def guard_stored_dtypes(params) -> None:
    """Refuse stored-dtype changes on every module that registers one of ``params``, not only on the
    modules given to ``fully_shard``: ``model.layer.half()`` comes through the child's own ``_apply``."""
    for sp in params:
        for module, _ in sp.slots:
            module.__dict__.setdefault(OWNED_ATTR, []).append(sp)
            if not isinstance(module, ShardedModule) and "_apply" not in module.__dict__:
                module.__dict__["_apply"] = types.MethodType(_guarded_apply, module)


def _guarded_apply(self, fn, recurse=True):
    owned = _refuse_dtype_change(self, fn)
    # ``model.sub.to_empty()`` / ``.to(device)`` changes the shards as the root's ``_apply`` does: stage-1/2
    # kept copies are refreshed at the next all-gather (every rank calls it alike)
    zero.invalidate()
    out = type(self)._apply(self, fn, recurse)
    recast.follow(owned)
    writes.rebind(owned)
    return out


def _refuse_dtype_change(module: nn.Module, fn) -> list:
    """The ``ShardedParam``s registered in ``module``'s tree, once each; raises ``StoredDtypeChangeError``
    for a stored-dtype change perparam cannot follow (``recast.problem``) and ``UnshardedApplyError`` while
    unsharded parameters are registered, before anything changes."""
    owned = list({id(sp): sp for m in module.modules() for sp in m.__dict__.get(OWNED_ATTR, ())}.values())
    why = recast.problem(recast.changed(owned, fn))
    if why is not None:
        raise StoredDtypeChangeError(
            f"{class_name(module)} holds parameters sharded by perparam; its dtype cannot change now: {why}. "
            "Nothing was changed")
    for sp in owned:
        owner, name = sp.slots[0]
        if sp.unsharded is None or owner._parameters.get(name) is not sp.unsharded:
            continue
        probe = torch.empty(0, dtype=sp.local_shard().dtype, device=sp.local_shard().device)
        try:
            changed = fn(probe)
        except Exception:  # not a conversion a 0-element tensor can take; let nn.Module decide
            continue
        if changed is not probe:
            raise UnshardedApplyError(
                f"{class_name(module)} holds parameters sharded by perparam whose unsharded copies are registered "
                f"now (after unshard(); e.g. '{sp.path}'): .to() / .cuda() / to_empty() would change those copies "
                "and not the shards. Call reshard() on the sharded module first, then this")
    return owned


def sharded_class(cls: type) -> type:
    """The subclass of ``cls`` that also derives from ``ShardedModule`` (one per class)."""
    sharded_cls = _CLASS_CACHE.get(cls)
    if sharded_cls is None:
        body = {"__module__": cls.__module__, BASE_ATTR: cls}
        if cls.forward is not nn.Module.forward:
            body["forward"] = _checked_forward(cls)
        sharded_cls = type(f"Sharded{cls.__name__}", (ShardedModule, cls), body)
        # setdefault: ranks that are threads of one process get one class per class, as processes do
        sharded_cls = _CLASS_CACHE.setdefault(cls, sharded_cls)
    return sharded_cls


def _checked_forward(cls: type):
    """``cls.forward`` (looked up at each call: a class patched later is followed), raising
    ``UsedWhileShardedError`` with the fix where DTensor's mixing error comes out of a forward called without
    the module's hooks (``readers.forward_called_directly``). A ``try`` costs nothing while nothing raises; the
    signature is ``cls.forward``'s (``inspect.signature``, which Hugging Face reads, follows ``__wrapped__``)."""

    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        try:
            return cls.forward(self, *args, **kwargs)
        except RuntimeError as e:  # the error path only
            explained = readers.forward_called_directly(self, group_of(self), e, sys._getframe(1))
            if explained is None:
                raise
            raise explained from e

    return forward


def mark_fully_sharded(module: nn.Module) -> None:
    """Record ``fully_shard`` in torch's composable-API registry of ``module``, as FSDP2's ``fully_shard``
    does, so that torch's composable APIs which leave fully-sharded modules to their owner leave it to
    perparam: ``torch.distributed._composable.replicate`` (DDP) on a model whose blocks perparam shards
    then replicates only the other parameters, and refuses a module perparam shards itself."""
    try:
        from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
    except ImportError:  # a torch without composable APIs: nothing to tell
        return
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry.setdefault("fully_shard", RegistryItem())


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
    module.__dict__[GROUP_ATTR] = group


#: the attributes torch's FSDP2 sets on every module a ``fully_shard`` call manages, read by others:
#: Hugging Face ``transformers`` (``transformers.distributed.fsdp.is_fsdp_managed_module``) keeps the ranks
#: in step during ``generate`` for such a model (``synced_gpus``: a rank whose sequences ended keeps running
#: forwards, and so all-gathers, until every rank's have), and torch.compile's Dynamo traces such a module
#: as FSDP's (its parameters read as inputs on every call, not baked into the graph).
FSDP_MANAGED_ATTRS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def mark_managed(modules: list[nn.Module]) -> None:
    """Set ``FSDP_MANAGED_ATTRS`` to ``True`` on every module of ``modules``' trees (the roots of one
    ``fully_shard`` call and their submodules; those an earlier call sharded already carry them), as FSDP2
    does for the modules its call manages, so code that recognises an FSDP2 model recognises this one; and
    refuses the Hugging Face methods that cannot run on a sharded module (``perparam.hf_methods``)."""
    for root in modules:
        for m in root.modules():
            for attr in FSDP_MANAGED_ATTRS:
                setattr(m, attr, True)
            hf_methods.guard(m)
