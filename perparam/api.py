"""``fully_shard``: turn a module's parameters, in place, into sharded DTensors managed by one group."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .api_checks import (
    check_containers,
    check_mesh,
    check_param,
    collect_params,
    default_mesh,
    ignored_ids,
    param_mesh,
    reshard_setting,
    tp_composition,
)
from .comm import peers
from .comm.process_groups import warm_up
from .errors import ShardingError
from .full_state import install_load_hooks
from .module import (
    ShardedModule,
    attach,
    check_divide_factor,
    group_of,
    guard_stored_dtypes,
    mark_fully_sharded,
    mark_managed,
)
from .offload import tier as offload_tier
from .offload.mapped import OffloadError
from .runtime import adopt, hooks, hpz, islands, readers, registration, shard_view
from .runtime.context import IterationContext
from .runtime.group import ParamGroup
from .runtime.param import ShardedParam
from .runtime.tp import CompositionError
from .sharding.policy import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    ParamPolicy,
    PolicyError,
    as_mp_policy,
    as_offload,
)
from .sharding.resolution import ParamError, buffer_dtypes, resolve_params

ParamPolicyArg = ParamPolicy | Mapping[str, ParamPolicy] | Callable[[str, nn.Parameter], ParamPolicy | None]


def fully_shard(module: nn.Module | Sequence[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, param_policy: ParamPolicyArg | None = None,
                ignored_params: set[nn.Parameter] | None = None, gradient_divide_factor: float | None = None,
                offload_policy: OffloadPolicy | str | None = None):
    """Shard ``module``'s parameters over ``mesh`` (ZeRO-3), in place; returns ``module``.

    Every parameter not already managed by a ``fully_shard`` call on a submodule is replaced by an
    ``nn.Parameter`` wrapping a DTensor: placements ``(Shard(0),)`` on a 1D mesh, ``(Replicate(),
    Shard(0))`` on a 2D (replicate, shard) mesh. Rank r of the shard axis holds rows
    ``torch.chunk(p, K, dim=0)[r]`` (the last ranks may hold fewer rows, or none). The module's class is
    changed to a subclass of ``ShardedModule``. A list of modules makes one group (tied weights).

    Args:
        module: a module, or a list of modules sharded as one group.
        mesh: a 1D or 2D ``DeviceMesh``; ``None`` means a 1D mesh over the default process group's ranks
            on the default device (CUDA when the backend is NCCL, else CPU).
        reshard_after_forward: as FSDP2: ``True`` frees the unsharded parameters after forward
            (all-gather again in backward); ``False`` keeps them until the end of backward; ``None`` (the
            default) is ``True``, the root keeping its parameters for the backward that follows anyway
            (an explicit ``True`` frees the root's too: one all-gather more per step, less memory).
            An int k' is the number of ranks to reshard to (FSDP2's int; ZeRO++'s hpZ): ``1`` means
            ``False``, the shard axis's size K means ``True``, and a divisor of K between them keeps,
            after forward, a secondary shard of 1/k' of the group's gathered bytes on each rank, so the
            backward all-gather runs over k' consecutive shard ranks (e.g. those of one node) instead of
            K (``perparam.runtime.hpz``, ``docs/hpz.md``).
        mp_policy, param_policy: mixed precision and per-parameter policies; see ``perparam.sharding.policy``.
            torch's FSDP2 ``MixedPrecisionPolicy`` is accepted too (its four fields, same meaning).
            ``ParamPolicy(mesh=...)`` shards a parameter on its own data-parallel mesh (e.g. experts on an
            expert-data-parallel mesh): one all-gather per mesh per unshard and one reduce-scatter per
            (mesh, reduce dtype) per reduction (``perparam.runtime.meshes``, ``docs/mixture-of-experts.md``).
            A module whose own parameters compute in another dtype than the call's ``param_dtype``
            casts its inputs and outputs (a precision island, ``perparam.runtime.islands``); a norm with
            running statistics (BatchNorm, InstanceNorm with ``track_running_stats``) computes in their dtype.
        ignored_params: parameters left as they are: plain tensors, neither sharded nor all-gathered nor
            reduced (FSDP2's argument), for parameters managed elsewhere. As in FSDP2, those outside
            ``module``'s tree (or sharded by an earlier call) are not this call's concern: one set can be
            passed to every call.
        gradient_divide_factor: what this call's reduced gradients are divided by. A reduction sums a
            gradient over the ranks of ``mesh`` (both axes on a 2D mesh, and for ``Replicate()``
            parameters too; over its own mesh for a parameter with ``ParamPolicy(mesh=...)``); ``None``
            (the default) divides by ``mesh``'s size, the mean over its ranks, for every parameter of the
            call, those on another mesh included (the number of ranks whose losses are averaged: experts
            on an expert mesh in the call's policy need no factor).
            When the loss is the mean over more ranks than ``mesh`` has (experts on their own mesh,
            ``docs/mixture-of-experts.md``), pass the number of ranks whose losses are averaged (the
            data-parallel degree of the dense part). Same meaning as FSDP2's
            ``set_gradient_divide_factor``, which changes it later
            (``ShardedModule.set_gradient_divide_factor``).
        offload_policy: where the parameters' persistent state lives (``perparam.OffloadPolicy``: tier
            ``"device"``, ``"cpu"`` or ``"disk"``; optimizer state only or also the stored shard), for
            every parameter whose ``ParamPolicy.offload`` is ``None``; FSDP2's ``CPUOffloadPolicy`` is
            accepted too. See ``docs/offload.md``.

    Raises:
        ShardingError: a 0-dim parameter, a parameter tied to another call's group, a module already
            sharded, a mesh of more than 2 dims or a 2D mesh without axis names, a non-floating-point
            parameter that requires grad, a policy that cannot apply (named in the message), a
            tensor-parallel parameter that cannot compose with ``mesh``, a ``ParamPolicy.mesh`` of another
            device type than ``mesh``'s, of more than 2 dims, without this rank, on a tensor-parallel
            parameter or with ``reshard_after_forward=int`` (named with the parameter), a module whose own
            parameters
            compute in two dtypes, ``ignored_params`` that is not a collection of tensors, a
            ``gradient_divide_factor`` that is not a positive finite number, a parameter with a hook from
            ``register_hook`` (it could never fire), an uninitialised (Lazy)
            parameter, a ``param_dtype`` given to a norm that computes with running statistics of another
            dtype, a stock module whose forward reads a child's parameters directly
            (``MultiheadAttention.out_proj``) when that child was sharded by an earlier call
            (``perparam.runtime.readers``), an offload tier a parameter cannot have or a disk-tier
            directory that cannot be written or lacks room for the stored shards (named with the
            parameter). Nothing is changed then.

    Every module of ``module``'s tree gets FSDP2's marks ``_is_fsdp_managed_module = True`` and
    ``_fsdp_use_orig_params = True`` (``perparam.module.FSDP_MANAGED_ATTRS``): Hugging Face's ``generate``
    then keeps the ranks in step when they stop at different lengths (``synced_gpus``; docs/huggingface.md),
    and torch.compile traces the module as it traces an FSDP2 one.

    After the call, torch utilities that register parameters into the sharded tree are checked as they
    run (``perparam.runtime.registration``): ``remove_parametrizations`` moves the merged parameter into
    place; what perparam cannot follow raises ``ShardedTreeChangeError`` at that call.

    Warns (once per process) when a trainable parameter is stored in bf16 or fp16: its optimizer then
    updates low-precision weights; pass ``MixedPrecisionPolicy(master_dtype=torch.float32)``.
    """
    modules = list(module) if isinstance(module, Sequence) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ShardingError("fully_shard takes an nn.Module or a non-empty list of nn.Modules")
    if len({id(m) for m in modules}) != len(modules):
        raise ShardingError("fully_shard got the same module twice in its list; list each module once")
    try:  # perparam's policy, or torch's FSDP2 one converted (accelerate's FSDP2 plugin passes torch's)
        mp_policy = as_mp_policy(mp_policy, "fully_shard(mp_policy=...)")
    except PolicyError as e:
        raise ShardingError(str(e)) from None
    if not (param_policy is None or isinstance(param_policy, (ParamPolicy, Mapping))
            or callable(param_policy)):
        raise ShardingError("param_policy must be a ParamPolicy, a mapping from glob patterns to "
                            "ParamPolicy, or a callable (name, param) -> ParamPolicy | None; got "
                            f"{type(param_policy).__name__}")
    try:
        offload_policy = as_offload(offload_policy, "fully_shard(offload_policy=...)")
    except PolicyError as e:
        raise ShardingError(str(e)) from None
    mesh = mesh if mesh is not None else default_mesh()
    check_mesh(mesh)
    auto_reshard_after_forward = reshard_after_forward is None
    reshard_after_forward, secondary_size = reshard_setting(reshard_after_forward, mesh.size(mesh.ndim - 1))
    gradient_divide_factor = check_divide_factor(gradient_divide_factor,
                                                 "fully_shard(gradient_divide_factor=...)", mesh.size())
    for m in modules:
        if isinstance(m, ShardedModule):
            raise ShardingError(
                f"fully_shard was already applied to this {registration.class_name(m)}; call it once per "
                "module (FSDP2 refuses a second call too: Each distinct composable distributed API can only "
                "be applied to a module once). What the first call set changes through the module's setters "
                "(set_reshard_after_forward, set_reshard_after_backward, set_gradient_divide_factor, "
                "set_modules_to_forward_prefetch) and .to(dtype); for another mesh, policy or grouping, "
                "gather the weights with perparam.full_state.full_state_dict(model), build the model again, "
                "shard it with the new arguments and load them (load_full_state_dict)")

    owner = ", ".join(type(m).__name__ for m in modules)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ShardingError(f"fully_shard({owner}): this rank ({dist.get_rank()}) is not in the mesh passed "
                            f"(ranks {mesh.mesh.flatten().tolist()}); call fully_shard on a rank only with a "
                            "mesh that holds it (each rank passes the mesh it belongs to), or leave "
                            "mesh=None for all ranks")
    shard_rank, num_shards = coordinate[-1], mesh.size(mesh.ndim - 1)

    refusal = readers.check_readers(modules, group_of)
    if refusal is not None:
        raise ShardingError(f"fully_shard: {refusal}")
    found, aliases = collect_params(modules)
    ignored = ignored_ids(ignored_params, found)
    found = [entry for entry in found if id(entry[1]) not in ignored]
    check_containers(modules, found)
    for fqn, original, _ in found:
        check_param(fqn, original, owner, modules)
    # validate everything before changing anything: a failed call leaves the module as it was
    prefixes = [(f"{i}." if len(modules) > 1 else "", m) for i, m in enumerate(modules)]
    try:
        resolved = resolve_params([(fqn, p) for fqn, p, _ in found], mp_policy, param_policy, num_shards,
                                  owner, aliases=aliases, compute_dtypes=buffer_dtypes(
                                      prefixes, lambda m: group_of(m) is not None), offload=offload_policy)
        policies = [r.policy for r in resolved]
        meshes = [param_mesh(fqn, p, policy.mesh, mesh, owner, secondary_size)
                  for (fqn, p, _), policy in zip(found, policies)]
        ranks = [shard_rank if m is mesh else m.get_coordinate()[-1] for m in meshes]
        tps = [tp_composition(fqn, p, mesh, policy) for (fqn, p, _), policy in zip(found, policies)]
        island_list = islands.find_islands(
            prefixes, [(fqn, slots, pol.param_dtype if p.is_floating_point() else None)
                       for (fqn, p, slots), pol in zip(found, policies)],
            mp_policy.param_dtype, lambda m: group_of(m) is not None)
        scratches = offload_tier.check([(r.name, r.policy, r.stored_bytes(k))
                                        for r, k in zip(resolved, ranks)],
                                       mesh.device_type, owner)
    except (PolicyError, ParamError, CompositionError, islands.IslandError, OffloadError) as e:
        raise ShardingError(str(e)) from None
    _warn_low_precision_training(found, policies)
    sharded_params = []
    for (fqn, original, slots), res, tp, pmesh, prank in zip(found, resolved, tps, meshes, ranks):
        sp = ShardedParam(fqn, slots, original, pmesh, prank, res, tp)  # each resolved once, above
        adopt.record(original, sp, owner)
        sp.register_sharded()
        if sp.stored_quantized:
            sp.register_scales()
        sharded_params.append(sp)

    group = ParamGroup(modules, sharded_params, mesh, reshard_after_forward, mp_policy,
                       gradient_divide_factor=gradient_divide_factor,
                       auto_reshard_after_forward=auto_reshard_after_forward)
    IterationContext([group]).take(group)  # its own until a root's first forward takes it into its tree
    for part in group.parts:  # created now, by every rank, in call order (per mesh in the fixed order)
        part.reduce_shard_pg, part.reduce_replicate_pg  # noqa: B018
    if secondary_size is not None:  # hpZ: its process groups created now, by every rank, in call order
        group.parts[0].hpz = group.parts[0].secondary = hpz.Secondary(mesh, secondary_size)
    # their communicators too (NCCL's first collective on a group is a handshake of its ranks), in that order
    warm_up([pg for part in group.parts for pg in (part.shard_pg, part.replicate_pg, part.reduce_shard_pg,
                                                    part.reduce_replicate_pg)]
            + ([group.parts[0].secondary.pg] if secondary_size is not None else [])
            + [dist.group.WORLD], mesh.device_type)  # WORLD: clip_grad_norm_'s all-reduce
    peers.register()  # this rank's host and pid in the store: a PeerLostError can name a peer that dies
    for sp in sharded_params:
        sp.on_grad_ready = functools.partial(hooks.grad_ready, group)  # called with the parameter
        shard_view.link(sp)  # stage 1/2 at P: the shard becomes its kept copy's own rows
    for m in modules:
        attach(m, group)
        mark_fully_sharded(m)
        m.register_forward_pre_hook(lambda mod, a, kw, g=group: hooks.pre_forward(g, mod, a, kw),
                                    prepend=True, with_kwargs=True)
        # always_call: a forward that raises still reshards and releases the root
        m.register_forward_hook(lambda mod, a, kw, out, g=group: hooks.post_forward(g, mod, a, kw, out),
                                with_kwargs=True, always_call=True)
    mark_managed(modules)
    _set_up_places(sharded_params)
    for island in island_list:  # after the group's hooks: inside its input cast, before its output cast
        islands.install(island)
    group.islands = island_list
    registration.watch(group, ignored, on_move=_set_up_places)
    group.offload_hook = offload_tier.attach(sharded_params, modules, owner, scratches)
    if isinstance(module, nn.Module):
        _name_in_model(module)
    return module


def _name_in_model(module: nn.Module) -> None:
    """Every parameter sharded in ``module``'s tree, this call's and earlier calls' below it, named by its
    path from ``module`` (``layers.1.mlp.up.weight``): the outermost module sharded so far, the root once the
    last call (bottom-up) has run; what refusals print (``ShardedParam.path``)."""
    paths: dict[int, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    for m in module.modules():
        g = group_of(m)
        for sp in g.params if g is not None else ():
            owner, attr = sp.slots[0]
            if id(owner) in paths:
                sp.path = f"{paths[id(owner)]}.{attr}".lstrip(".")
    registration.bump()  # names cached from the old paths (``MeshPart._what``) are made again



def _set_up_places(params: list[ShardedParam]) -> None:
    """What ``fully_shard`` sets up on the modules where each of ``params`` is registered: the stored-dtype
    guard and the ``load_state_dict`` hooks (again for a parameter a torch utility moved,
    ``perparam.runtime.registration.move``)."""
    guard_stored_dtypes(params)
    install_load_hooks(params)


_WARNED_LOW_PRECISION = False


def _warn_low_precision_training(found, policies) -> None:
    """Once per process: a trainable parameter stored in bf16/fp16 (no fp32 master weights)."""
    global _WARNED_LOW_PRECISION
    low = [(fqn, pol.stored_dtype) for (fqn, _, _), pol in zip(found, policies)
           if pol.requires_grad and pol.stored_dtype in (torch.bfloat16, torch.float16)]
    if low and not _WARNED_LOW_PRECISION:
        _WARNED_LOW_PRECISION = True
        fqn, dtype = low[0]
        warnings.warn(f"perparam: {len(low)} trainable parameter(s), e.g. '{fqn}', are stored in {dtype}: "
                      "the optimizer will update low-precision weights and keep its state in that dtype, and "
                      "small updates round away. To train with fp32 master weights while computing in the "
                      "low precision, pass MixedPrecisionPolicy(master_dtype=torch.float32, param_dtype="
                      f"{dtype}) (this warning is shown once per process)", UserWarning, stacklevel=3)
