"""``ShardedModule``'s settings (``ShardedModuleSettings``, its base): FSDP2's setters (divide factor,
all-reduce hook, resharding, gradient sync, HSDP all-reduce, prefetch lists, custom collectives), each
checked where it is set and stored in the call's group (``perparam.runtime.group.ParamGroup``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import nn

from .errors import ShardingError
from .runtime.group import ParamGroup, group_of
from .runtime.registration import class_name


class ShardedModuleSettings:
    """The setters of ``perparam.module.ShardedModule`` (FSDP2's ``FSDPModule`` methods of the same names)."""

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
        for group in _groups_below(self, recurse):
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
            raise NotImplementedError("set_all_reduce_hook(stream=...): perparam issues its reductions and runs "
                                      "the hook on the current stream; pass stream=None")
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
        for group in _groups_below(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: keep accumulating unsharded gradients locally across micro-batches, with no
        communication; the next backward with sync on reduce-scatters the sum. As FSDP2's, it sets
        ``set_requires_all_reduce`` to the same value (under HSDP it governs both collectives). ``recurse``
        applies the setting to every sharded module below this one too.

        Raises ``TypeError`` for a value that is not a bool."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for group in _groups_below(self, recurse):
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
        for group in _groups_below(self, recurse):
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
        for group in _groups_below(self, recurse):
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
        quantized = [p.fqn for p in group.params if p.policy.grad_quant is not None]
        if comm is not None and quantized:
            raise ShardingError(f"{class_name(self)}.set_custom_reduce_scatter: parameters {quantized} have "
                                "grad_quant, whose reduce-scatter is perparam's own; drop grad_quant for them or "
                                "keep perparam's reduce-scatter")
        group.reduce_scatter_comm = _check_comm(comm, "set_custom_reduce_scatter", "ReduceScatter")


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
            raise ShardingError(f"{where}: entry {i} ({what}) is not a module fully_shard was applied to, so it "
                                "has no all-gather to prefetch; list modules passed to fully_shard (e.g. the "
                                "transformer blocks), or call fully_shard on it first")
        groups.setdefault(id(g), g)
    return list(groups.values()) or None


def _check_comm(comm, method: str, interface: str):
    if comm is not None and not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(f"{method}: {comm!r} has no allocate(size, *, dtype, device) or is not callable; pass "
                        f"an object with FSDP2's {interface} interface (or None for perparam's own collective)")
    return comm


def _groups_below(module: nn.Module, recurse: bool) -> list[ParamGroup]:
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
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor) or factor <= 0:
        raise ShardingError(
            f"{where}: gradient divide factor {factor!r} is not a positive finite number. It is what the summed "
            "gradients are divided by: pass the number of ranks whose losses are averaged (the data-parallel "
            f"degree of the dense part, e.g. {mesh_size} for this mesh), or None for the mesh's size")
    return float(factor)
