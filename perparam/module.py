"""``ShardedModule``: the mixin class ``fully_shard`` adds to a module, and its user-facing methods: unshard,
reshard, reset, and FSDP2's setters (divide factor, all-reduce hook, resharding, gradient sync, HSDP
all-reduce, prefetch lists, custom collectives), each checked where it is set and stored in the call's group
(``perparam.runtime.group.ParamGroup``)."""

from __future__ import annotations

import functools
import math
import numbers
import sys
import types
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from .comm import peers, sequence
from .errors import ShardingError
from .hf import methods as hf_methods
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


class ShardedModule:
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
        """Refused with ``DeepcopyError`` (as FSDP2 refuses it, with its ``AssertionError``): a copy would
        share the original's group, hooks and process groups, so its forward would all-gather the original's
        parameters and leave its own sharded."""
        raise DeepcopyError(
            f"copy.deepcopy of {class_name(self)}, a module sharded by fully_shard, is not supported (FSDP2: "
            "FSDP does not support deepcopy. Please use state dict for serialization): the copy would "
            "keep the original's group and hooks (its forward would all-gather the original's parameters). "
            "Deepcopy the model before fully_shard and shard the copy with calls of its own, or build it "
            "again and load the values: state = perparam.full_state.full_state_dict(model) on every rank, "
            "then perparam.full_state.load_full_state_dict(new_sharded_model, state)")

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeError as e:  # the error path only: nothing is added to a call that succeeds
            if isinstance(e, peers.PeerLostError):  # the frames below (modules, hooks, c10d) say nothing more
                raise e.with_traceback(None) from None
            # readers.note, from the post-forward hook
            explained = e.__dict__.pop("_perparam_explained", None)
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
        """Read by ``DistributedDataParallel`` at its construction (``hasattr``): a sharded model wrapped in
        DDP (directly, or by accelerate's ``prepare`` or transformers' ``Trainer``) is refused here, naming
        the routes that work, instead of failing in DTensor's ops at DDP's first broadcast."""
        raise ShardingError(
            f"perparam: DistributedDataParallel cannot wrap {type(self).__name__}, which fully_shard "
            "sharded: perparam already reduces its gradients. Train the sharded model as it is; under "
            "transformers' Trainer use perparam.hf_trainer.ShardedTrainer, under accelerate "
            "perparam.hf_accelerate.ShardedAccelerator (or do not pass the model to Accelerator.prepare) "
            "(docs/huggingface.md)")

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
        for group in groups_below(self, recurse):
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

    # -- FSDP2's setters, each checked where it is set and stored in the call's group --------------------
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code: FSDP2 with ``False`` skips waiting, at the end of backward, for the
        gradient reductions still running on its streams (their results are the same; the wait moves to
        a later backward). perparam finishes every reduction before ``backward()`` returns whatever the
        value (the sharded ``.grad``s are complete then, and no rank waits for a reduction earlier,
        ``perparam.runtime.hooks``), so either value leaves communication and results as they are.

        Raises ``TypeError`` for a value that is not a bool."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward takes a bool, got {is_last_backward!r}")

    def set_gradient_divide_factor(self, factor: float | None, *, recurse: bool = False) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the mesh's size (FSDP2's
        ``set_gradient_divide_factor``; ``fully_shard(..., gradient_divide_factor=)`` sets it at shard
        time). A reduction sums each gradient over the ranks of the group's mesh (both axes under HSDP,
        ``Replicate()`` parameters too); the sum is then divided by ``factor``. For the mean of the ranks'
        losses, ``factor`` is the number of ranks whose losses are averaged: for experts sharded on their own
        mesh, the data-parallel degree of the dense part, not the expert mesh's size
        (``docs/mixture-of-experts.md``). ``None`` restores the default, the mesh's size.

        ``recurse``: also set it on every sharded module below this one (FSDP2's method has no such
        argument and sets this module's group only, the default here).

        Raises ``ShardingError`` unless ``factor`` is a positive finite number (or ``None``)."""
        own = group_of(self)
        factor = check_divide_factor(factor, f"{own.name}.set_gradient_divide_factor", own.mesh.size())
        for group in groups_below(self, recurse):
            group.gradient_divide_factor = factor

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *, stream=None) -> None:
        """Call ``hook(reduced)`` on each gradient reduction of this module's group (FSDP2's
        ``set_all_reduce_hook``), e.g. to all-reduce the gradients over a further process group.

        ``reduced``: this rank's summed gradients of one reduction, a 1-D tensor in the reduce dtype: the
        reduce-scatter's output (after the all-reduce over the replicate axis under HSDP), the rank's padded
        pieces of the group's sharded parameters in registration order; for ``Replicate()`` parameters the
        all-reduced whole gradients. A group issues one reduction per reduce dtype (plus one per reduce
        dtype for its replicated parameters), each hooked. The hook may change ``reduced`` in place; it runs
        before the division by the gradient divide factor (FSDP2 divides fp32 sums inside the collective,
        before its hook: for a linear hook such as an all-reduce the result is the same). It runs in the
        final callback of a synchronising backward, on every rank, in the reductions' issue order (the same
        on every rank), so it may issue collectives. A parameter no rank of the group's mesh used keeps its
        ``.grad`` whatever the hook does. ``None`` removes the hook.

        Raises ``NotImplementedError`` for a ``stream`` (perparam runs reductions on the current stream)
        and ``TypeError`` for a hook that is not callable."""
        if stream is not None:
            raise NotImplementedError("set_all_reduce_hook(stream=...): perparam issues its reductions and "
                                      "runs the hook on the current stream; pass stream=None")
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook takes a callable hook(reduced_grads) or None, got {hook!r}")
        group_of(self).all_reduce_hook = hook

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """FSDP2's tuning knob, accepted and without effect. FSDP2 keeps at most ``max_input_buffers``
        reduce-scatter inputs in flight (default 1) and makes the next copy-in wait for an earlier
        reduce-scatter to free one: memory against overlap. perparam never waits for a reduction during
        backward (a peer may issue it only at its final callback, ``perparam.runtime.hooks``): its
        reduce-scatter inputs come from the root's ``BufferPool`` (``perparam.comm.buffers``, at most
        ``IN_FLIGHT_GROUPS`` times the largest group's ``pool_bytes()`` kept idle), the queue is polled past
        ``MAX_REDUCES_IN_FLIGHT`` (``perparam.runtime.context``) and every reduction finishes before
        ``backward()`` returns, so there is no stall for the knob to remove and no bound to set.

        Raises ``TypeError`` for a non-int (or a bool) and ``ValueError`` below 1, as FSDP2 does."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the unsharded parameters gathered after backward until ``reshard()`` (or until a
        shard changes in place, e.g. an optimizer step, which the next unshard detects and all-gathers
        anew): no all-gather in the next forward of a gradient-accumulation micro-batch, and the
        parameters a second backward through a ``create_graph=True`` graph needs stay valid. A backward
        with ``create_graph=True`` keeps them until the end of the next backward by itself. What a backward
        kept serves the next forward whatever the setting is by then, so FSDP2's pattern
        (``set_reshard_after_backward(is_last_micro_batch)``) gathers nothing in the last micro-batch's
        forward. Writes through
        ``.data`` and ``torch._foreach_*`` called by hand on the DTensors are not detected: call
        ``reshard()`` after them."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"reshard_after_backward must be a bool, got {reshard_after_backward!r}")
        for group in groups_below(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: keep accumulating unsharded gradients locally across micro-batches, with no
        communication; the next backward with sync on reduce-scatters the sum. As FSDP2's, it sets
        ``set_requires_all_reduce`` to the same value (under HSDP it governs both collectives). ``recurse``
        applies the setting to every sharded module below this one too.

        Raises ``TypeError`` for a value that is not a bool."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for group in groups_below(self, recurse):
            group.requires_gradient_sync = requires_gradient_sync
            group.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation with reduce-scatter only (FSDP2's ``set_requires_all_reduce``):
        ``False`` reduce-scatters each backward's gradients over the shard axis as usual (the unsharded
        gradients are freed) but holds this rank's summed piece, ``[padded local elements]`` per reduce
        dtype, instead of all-reducing it over the replicate axis; the next backward with ``True`` adds
        the held sum to its own reduce-scatter output and issues one all-reduce for all of them, then
        divides and accumulates into the sharded ``.grad`` (``perparam.runtime.partial``). On a 1D mesh
        there is no all-reduce and the setting changes nothing. Set it back to ``True`` (or
        ``set_requires_gradient_sync(True)``) before the last micro-batch's backward: held gradients reach
        ``.grad`` only through an all-reduce.

        Raises ``TypeError`` for a value that is not a bool."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"requires_all_reduce must be a bool, got {requires_all_reduce!r}")
        for group in groups_below(self, recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool | None, *, recurse: bool = True) -> None:
        """``True`` frees the unsharded parameters after forward and all-gathers again in backward, the
        root's too (as FSDP2's setter: one all-gather more per step); ``False`` keeps them from forward to
        backward (more memory, one all-gather fewer), and after a forward without grad
        (``torch.no_grad()``, evaluation or generation) until ``reshard()`` or the next forward with grad,
        so several evaluation forwards all-gather once. ``None`` (not in FSDP2) restores ``fully_shard``'s
        default: ``True``, except that the root keeps its parameters for the backward that follows a
        forward with grad (under no_grad it frees them). ``True``/``False`` turn off the secondary
        partition (hpZ) of ``fully_shard(..., reshard_after_forward=int)``, as FSDP2's setter does; ``None``
        restores the int given to ``fully_shard``."""
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool or None, got {reshard_after_forward!r}")
        for group in groups_below(self, recurse):
            group.reshard_after_forward = reshard_after_forward is not False
            own = group.parts[0]  # hpZ is refused with parameters on other meshes
            group.auto_reshard_after_forward = reshard_after_forward is None and own.secondary is None
            # as FSDP2's setter: a bool turns fully_shard's int (hpZ) off; None restores it
            own.use_secondary(reshard_after_forward is None)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Issue the all-gathers of ``modules`` (sharded modules of the same model), in the order given, right
        after this module's own all-gather in its pre-forward (FSDP2's ``set_modules_to_forward_prefetch``),
        instead of prefetching the module that ran after it in the last forward. A listed module whose
        forward already ran in this iteration, or whose parameters are gathered, is skipped. Applies from
        the first forward (the recorded order needs one forward first) and whatever
        ``perparam.configure(prefetch=...)`` says. Each prefetched group holds its gathered parameters (and,
        on gloo, its receive buffers) from then until its forward ends: more than one module listed means
        more memory. ``[]`` restores the recorded order. Every rank must set the same lists.

        Raises ``ShardingError`` for an entry that is not a module ``fully_shard`` was applied to (naming it);
        ``PrefetchError`` at the root's first forward for a module of another model."""
        group_of(self).forward_prefetch = _prefetch_groups(self, modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Issue the all-gathers of ``modules`` (sharded modules of the same model), in the order given,
        right after this module's own backward all-gather (FSDP2's ``set_modules_to_backward_prefetch``),
        instead of the one module after it in the backward order (root, reverse forward order). The lists
        become part of that fixed order: a rank whose backward does not reach this module (its output
        unused there) issues them where its peers do, so every rank issues the same all-gathers in the
        same order; a module gathered earlier in the backward is not gathered again, and a listed module
        with no backward in this iteration is skipped. ``[]`` restores the default. Every rank must set the
        same lists.

        Raises ``ShardingError`` for an entry that is not a module ``fully_shard`` was applied to (naming it);
        ``PrefetchError`` at the root's first forward for a module of another model."""
        group_of(self).backward_prefetch = _prefetch_groups(self, modules, "backward")

    def set_custom_all_gather(self, comm) -> None:
        """Run this module's group's all-gathers through ``comm`` (FSDP2's ``set_custom_all_gather``): an
        object with FSDP2's ``AllGather`` interface, ``comm.allocate(size, *, dtype, device)`` returning the
        output buffer (uint8, ``[K * slot bytes]``) and ``comm(output, input, group, async_op)`` returning a
        work handle (or ``None``). ``None`` restores perparam's own. Every rank must set the same.

        Raises ``TypeError`` for an object without ``allocate`` or not callable."""
        group_of(self).all_gather_comm = _check_comm(comm, "set_custom_all_gather", "AllGather")

    def set_custom_reduce_scatter(self, comm) -> None:
        """Run this module's group's gradient reduce-scatters through ``comm`` (FSDP2's
        ``set_custom_reduce_scatter``): ``comm.allocate(size, *, dtype, device)`` returns the output (one
        rank's ``[n]`` piece in the reduce dtype) and ``comm(output, input, group, op, async_op)`` sums the
        ``[K * n]`` input over ``group`` (``op`` is ``ReduceOp.SUM``; perparam divides afterwards). The HSDP
        all-reduce and replicated parameters' all-reduces are unchanged. ``None`` restores perparam's own.

        Raises ``TypeError`` for an object without ``allocate`` or not callable, ``ShardingError`` when the
        group has ``grad_quant`` parameters (their reduce-scatter is perparam's encoded all-to-all)."""
        group = group_of(self)
        quantized = [p.path for p in group.params if p.policy.grad_quant is not None]
        if comm is not None and quantized:
            raise ShardingError(f"{class_name(self)}.set_custom_reduce_scatter: parameters {quantized} have "
                                "grad_quant, whose reduce-scatter is perparam's own; drop grad_quant for "
                                "them or keep perparam's reduce-scatter")
        group.reduce_scatter_comm = _check_comm(comm, "set_custom_reduce_scatter", "ReduceScatter")


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
                f"{class_name(module)} holds parameters sharded by perparam whose unsharded copies are "
                f"registered now (after unshard(); e.g. '{sp.path}'): .to() / .cuda() / to_empty() would "
                "change those copies and not the shards. Call reshard() on the sharded module first, then "
                "this")
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
    the module's hooks (``readers.forward_called_directly``). A ``try`` costs nothing while nothing raises;
    the signature is ``cls.forward``'s (``inspect.signature``, which Hugging Face reads, follows
    ``__wrapped__``)."""

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


def _prefetch_groups(module: nn.Module, modules, kind: str) -> list[ParamGroup] | None:
    """The groups of ``modules`` (in order, each once), or ``None`` for an empty list."""
    where = f"{class_name(module)}.set_modules_to_{kind}_prefetch"
    if isinstance(modules, nn.Module) or not isinstance(modules, (list, tuple)):
        what = class_name(modules) if isinstance(modules, nn.Module) else type(modules).__name__
        raise ShardingError(f"{where} takes a list of sharded modules, got {what}; pass e.g. "
                            "[model.layers[i + 1]]")
    groups: dict[int, ParamGroup] = {}
    for i, m in enumerate(modules):
        g = group_of(m) if isinstance(m, nn.Module) else None
        if g is None:
            what = class_name(m) if isinstance(m, nn.Module) else type(m).__name__
            raise ShardingError(f"{where}: entry {i} ({what}) is not a module fully_shard was applied to, so "
                                "it has no all-gather to prefetch; list modules passed to fully_shard (e.g. "
                                "the transformer blocks), or call fully_shard on it first")
        groups.setdefault(id(g), g)
    return list(groups.values()) or None


def _check_comm(comm, method: str, interface: str):
    if comm is not None and not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(f"{method}: {comm!r} has no allocate(size, *, dtype, device) or is not callable; "
                        f"pass an object with FSDP2's {interface} interface (or None for perparam's own "
                        "collective)")
    return comm


def groups_below(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    """The groups of ``module`` and, with ``recurse``, of every sharded module below it, each once, in
    ``module.modules()`` order."""
    modules = module.modules() if recurse else [module]
    groups: dict[int, ParamGroup] = {}
    for m in modules:
        g = group_of(m)
        if g is not None:
            groups.setdefault(id(g), g)
    return list(groups.values())


def check_divide_factor(factor, where: str, mesh_size: int) -> float | None:
    """``factor`` as a float (``None`` stays ``None``: the mesh's size); raises ``ShardingError`` unless it
    is a positive finite number (not a bool). ``where`` names the call, ``mesh_size`` the default."""
    if factor is None:
        return None
    if (isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor)
        or factor <= 0):
        raise ShardingError(
            f"{where}: gradient divide factor {factor!r} is not a positive finite number. It is what the "
            "summed gradients are divided by: pass the number of ranks whose losses are averaged (the "
            f"data-parallel degree of the dense part, e.g. {mesh_size} for this mesh), or None for the "
            "mesh's size")
    return float(factor)
