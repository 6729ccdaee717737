"""Full (unsharded) state dicts of a sharded model, one tensor at a time: ``full_state_dict`` gathers to
rank 0, ``load_full_state_dict`` broadcasts from rank 0 and keeps each rank's shard.

Memory: ``full_state_dict`` all-gathers one tensor at a time (every rank holds its shards plus one
unsharded tensor while it is gathered) and rank 0 keeps a CPU copy of each. ``load_full_state_dict``
broadcasts one tensor at a time as raw bytes (any dtype, gloo or NCCL) and keeps only this rank's slice,
so no rank holds the model twice. Shards are sliced by the same code ``fully_shard`` uses
(``ShardedParam.shard_of``), so every layout perparam creates loads, the uneven tensor-parallel ones
included.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .comm.peers import lost_peers
from .errors import CheckpointError
from .runtime import take, zero
from .runtime.group import group_of


def _policy_meshes(model: nn.Module) -> list:
    """The meshes parameters of ``model`` were given by ``ParamPolicy(mesh=...)``."""
    meshes: list = []
    for module in model.modules():
        group = group_of(module)
        for p in group.params if group is not None else ():
            mesh = p.policy.mesh
            if mesh is not None and not any(mesh is m for m in meshes):
                meshes.append(mesh)
    return meshes


def per_rank_keys(state: dict, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Key -> this rank's mesh ranks, for each DTensor of ``state`` (a state dict of ``model``, any keys)
    that is a different tensor on different ranks under one name: on a ``ParamPolicy(mesh=...)`` mesh whose
    ranks differ between ranks (each rank's expert on its own expert-data-parallel mesh). Only DTensors on a
    policy mesh are candidates: a DTensor on a data-parallel mesh that differs between ranks because tensor
    parallelism keeps a copy per TP rank is one tensor. A collective on every rank (one
    ``all_gather_object``); ``{}`` on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    meshes = _policy_meshes(model)
    mine = {k: tuple(v.device_mesh.mesh.flatten().tolist()) for k, v in state.items()
            if isinstance(v, DTensor) and any(v.device_mesh == m for m in meshes)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: ranks for k, ranks in mine.items() if len({o[k] for o in everyone if k in o}) > 1}


def _refuse_per_rank(what: str, state: dict, model: nn.Module) -> None:
    """Raise ``CheckpointError`` on every rank when ``model`` holds a different tensor under one name on
    different ranks (``per_rank_keys``): one full tensor per name cannot hold them."""
    per_rank = sorted(per_rank_keys(state, model))
    if per_rank:
        shown = ", ".join(f"'{k}'" for k in per_rank[:5]) + (" ..." if len(per_rank) > 5 else "")
        raise CheckpointError(
            f"{what}: {shown} {'is a different tensor' if len(per_rank) == 1 else 'are different tensors'} "
            "on different ranks (each rank's on its own ParamPolicy(mesh=...) mesh, e.g. its expert), and a "
            "full state dict holds one tensor per name: it would keep one rank's and give it to every rank. "
            "Save and load such a model with perparam.checkpoint.save/load (each stored as "
            "'<key>@ranks=<mesh ranks>'), or gather those parameters yourself over the expert-parallel "
            f"group. Nothing was {'gathered' if what == 'full_state_dict' else 'loaded'}")


@lost_peers("perparam.full_state.full_state_dict")
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The unsharded ``state_dict`` of ``model`` as CPU tensors on rank 0 (``None`` on the other ranks);
    every rank calls it. Stored-quantized parameters come as their codes, with their ``_qscale`` scales.

    Raises ``CheckpointError`` on every rank, before gathering anything, when a parameter is a different
    tensor on different ranks (``per_rank_keys``: experts on per-rank ``ParamPolicy(mesh=...)`` meshes)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    state = model.state_dict()
    _refuse_per_rank("full_state_dict", state, model)
    for key, value in state.items():
        full = full_tensor(value) if isinstance(value, DTensor) else value
        if out is not None:
            out[key] = full.detach().to("cpu", copy=True)
        del full
    return out


def dequantized_full_state_dict(model: nn.Module, dtype: torch.dtype = torch.float32
                                ) -> dict[str, torch.Tensor] | None:
    """``full_state_dict(model)`` with every stored-quantized parameter (``QuantPolicy(...,
    store_quantized=True)``, e.g. QLoRA's NF4 base weights) dequantized to ``dtype`` in its original shape
    and its ``<name>_qscale`` scales dropped: the keys, shapes and float values of the model before
    ``fully_shard``, which ``load_state_dict``, Hugging Face's ``save_pretrained(state_dict=...)`` and
    peft can take. Other entries come as stored. CPU tensors on rank 0, ``None`` on the other ranks;
    every rank calls it (one tensor gathered at a time). The values differ from the weights before
    quantization by at most the quantizer's ``error_bound``.

    Raises ``CheckpointError`` when a stored-quantized parameter's scales are not in the state dict (a
    ``state_dict`` hook removed them)."""
    full = full_state_dict(model)
    if full is None:
        return None
    quantized = {k: sp for k, sp in _sharded_params(model).items() if sp.stored_quantized}
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        sp = quantized.get(key)
        if sp is None:
            if not any(key == f"{k}_qscale" for k in quantized):
                out[key] = value
            continue
        scales = full.get(f"{key}_qscale")
        if scales is None:
            raise CheckpointError(f"dequantized_full_state_dict: '{key}' is stored quantized but its scales "
                                  f"'{key}_qscale' are not in the model's state_dict")
        q = sp.policy.quant
        shape = sp.global_shape
        rows = torch.empty(shape[0], math.prod(shape[1:]), dtype=torch.float32)
        out[key] = q.quantizer.unpack([value, scales], q.block_size, rows).view(shape).to(dtype)
    return out


def full_tensor(value: DTensor) -> torch.Tensor:
    """``full_tensor()``, gathering fp8 codes as bytes (gloo has no float8 all-gather)."""
    if value.dtype.itemsize != 1 or not value.dtype.is_floating_point:
        return value.full_tensor()
    raw = DTensor.from_local(value._local_tensor.view(torch.uint8), value.device_mesh, value.placements,
                             run_check=False, shape=value.shape, stride=value.stride())
    return raw.full_tensor().view(value.dtype)


def _sharded_params(model: nn.Module) -> dict[str, object]:
    """state-dict key -> ShardedParam, for every parameter perparam manages in ``model``."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for module in model.modules():
        group = group_of(module)
        if group is None:
            continue
        for sp in group.params:
            for owner, attr in sp.slots:
                if id(owner) in names:
                    prefix = names[id(owner)]
                    out[f"{prefix}.{attr}" if prefix else attr] = sp
    return out


def _materialise(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` a model on the meta device, then recompute its non-persistent buffers (not in any state
    dict) with each module's ``reset_non_persistent_buffers()``; a module without one is refused."""
    missing = [(n, m) for n, m in model.named_modules() if any(
        m._buffers.get(b) is not None and m._buffers[b].is_meta for b in m._non_persistent_buffers_set)
        and not callable(getattr(m, "reset_non_persistent_buffers", None))]
    if missing:
        name, module = missing[0]
        raise CheckpointError(
            f"module '{name}' ({type(module).__name__}) has non-persistent buffers on the meta device "
            f"({sorted(module._non_persistent_buffers_set)}): no state dict holds them, so after to_empty() "
            "they would be uninitialised memory. Define reset_non_persistent_buffers(self) on it to "
            "recompute them (perparam calls it after materialising), or build that module on a real device")
    model.to_empty(device=device)
    for module in model.modules():
        if module._non_persistent_buffers_set and callable(getattr(module, "reset_non_persistent_buffers",
                                                                   None)):
            module.reset_non_persistent_buffers()


@lost_peers("perparam.full_state.load_full_state_dict")
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None, *,
                         src: int = 0) -> None:
    """Load an unsharded ``state_dict`` held by rank ``src`` only (the other ranks pass ``None``) into the
    sharded ``model``; every rank calls it. A model still on the meta device is materialised first on the
    mesh's device. Values are cast to each entry's stored dtype.

    Raises ``CheckpointError`` on every rank, before anything changes, when keys are missing or
    unexpected or shapes differ (checked on rank ``src``), or for a float value for a stored-quantized
    parameter (load its codes and ``_qscale`` scales, or shard the float weights with ``fully_shard``),
    and when a parameter is a different tensor on different ranks (``per_rank_keys``: experts on per-rank
    ``ParamPolicy(mesh=...)`` meshes; broadcasting rank ``src``'s would overwrite the others' experts).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharded = _sharded_params(model)
    current = model.state_dict()
    _refuse_per_rank("load_full_state_dict", current, model)
    shapes = {k: tuple(v.shape) for k, v in current.items()}
    problem = ""
    if rank == src:
        if state_dict is None:
            problem = f"load_full_state_dict: rank {src} passed None; it must pass the full state dict"
        else:
            missing = [k for k in shapes if k not in state_dict]
            unexpected = [k for k in state_dict if k not in shapes]
            reshaped = [f"'{k}' {tuple(state_dict[k].shape)} vs {shapes[k]}" for k in shapes
                        if k in state_dict and tuple(state_dict[k].shape) != shapes[k]]
            quantized = [k for k, sp in sharded.items() if k in state_dict and sp.stored_quantized
                         and state_dict[k].is_floating_point()]
            def few(items):
                return f"{len(items)}: {items[:5]}" + (" ..." if len(items) > 5 else "")

            parts = [f"missing {few(missing)}" if missing else "",
                     f"unexpected {few(unexpected)}" if unexpected else "",
                     f"other shapes {few(reshaped)}" if reshaped else "",
                     f"float values for stored-quantized parameters {quantized[:5]} (pass their codes and "
                     "_qscale scales, or shard the float weights with fully_shard)" if quantized else ""]
            problem = "; ".join(p for p in parts if p)
    if dist.is_initialized():
        box = [problem]
        dist.broadcast_object_list(box, src=src)
        problem = box[0]
    if problem:
        raise CheckpointError(f"load_full_state_dict: the state dict does not fit the model: {problem}. "
                              "Nothing was loaded")
    if any(v.is_meta for v in current.values()):
        sp = next(iter(sharded.values()), None)
        _materialise(model, sp.mesh_device if sp is not None else torch.device("cpu"))
        current = model.state_dict()
    with torch.no_grad():
        for key, target in current.items():
            local = target._local_tensor if isinstance(target, DTensor) else target
            full = (state_dict[key].to(local.device, target.dtype).contiguous() if rank == src
                    else torch.empty(shapes[key], dtype=target.dtype, device=local.device))
            if dist.is_initialized():
                dist.broadcast(full.reshape(-1).view(torch.uint8), src=src)
            if key in sharded:
                piece = sharded[key].shard_of(full)
            elif isinstance(target, DTensor):
                piece = distribute_tensor(full, target.device_mesh, target.placements,
                                          src_data_rank=None).to_local()
            else:
                piece = full
            local.copy_(piece)
            del full, piece
    zero.invalidate()  # stage-1/2 kept copies: refreshed at the next all-gather


def install_load_hooks(params) -> None:
    """Let ``model.load_state_dict(full)`` take plain (unsharded) tensors, the common case for pretrained
    weights: each plain tensor of a managed parameter's global shape is sliced to this rank's shard on the
    fly, without communication (every rank passes the full dict; ``load_full_state_dict`` needs it on
    rank 0 only). ``params``: one ``fully_shard`` call's ``ShardedParam`` objects."""
    by_module: dict[int, tuple[nn.Module, list]] = {}
    for sp in params:
        for module, name in sp.slots:
            by_module.setdefault(id(module), (module, []))[1].append((name, sp))
    for module, entries in by_module.values():
        module.register_load_state_dict_pre_hook(
            lambda mod, state_dict, prefix, meta, *rest, entries=entries: _slice_plain(
                mod, entries, state_dict, prefix, bool(meta.get("assign_to_params_buffers", False))))
        # the tensors handed out share the shards' storage (dcp.load writes into them): unsharded storage kept
        # as it is (stage-1/2 copies, reshard_after_forward=False) is checked against the shards before its
        # next use once they were written (perparam.runtime.zero.check_unwritten)
        module.register_state_dict_post_hook(
            lambda mod, state_dict, prefix, meta, entries=entries: zero.lent(
                (sp, state_dict.get(prefix + name)) for name, sp in entries))


def _slice_plain(module: nn.Module, entries, state_dict, prefix: str, assign: bool) -> None:
    """The pre-hook of ``module.load_state_dict``: plain tensors of a managed parameter's global shape become
    this rank's shard; with ``assign=True`` (``assign``) the values of each managed entry are taken into the
    sharded parameter perparam registered (``_take``), which then stands in the state dict, so torch's
    assignment puts that same object back (the optimizer's parameters stay the live ones)."""
    zero.invalidate()  # a load: stage-1/2 kept copies are refreshed at the next all-gather
    for name, sp in entries:
        key = prefix + name
        value = state_dict.get(key)
        if (isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and not value.is_meta
                and tuple(value.shape) == sp.global_shape
                and not (sp.stored_quantized and value.is_floating_point())):
            local = sp.shard_of(value.detach()).to(sp.sharded.dtype)
            value = state_dict[key] = DTensor.from_local(local, sp.mesh, sp.placements, run_check=False,
                                                         shape=sp.sharded.shape, stride=sp.sharded.stride())
        # otherwise torch reports what does not fit, as for any module
        if assign and isinstance(value, torch.Tensor):
            state_dict[key] = _take(module, name, sp, key, value)


def _take(module: nn.Module, name: str, sp, key: str, value: torch.Tensor) -> nn.Parameter:
    """``load_state_dict(..., assign=True)`` of ``value`` (a DTensor, or a plain tensor already sliced to one)
    for ``module.<name>``, a place of ``sp``: its values become the shard, in place (or, on a shard still on
    the meta device, as the shard's new storage: no copy where dtype and device match, as torch's assign),
    and the sharded parameter is returned for torch to assign. Raises ``CheckpointError`` naming ``key``
    when ``value`` is not a DTensor of the parameter's mesh, placements and shapes (the fix:
    ``distribute_tensor(full, param.device_mesh, param.placements)``), is a float value for a
    stored-quantized parameter, or when the unsharded parameters are registered (after ``unshard()``)."""
    registered = module._parameters.get(name)
    if registered is not sp.sharded:
        raise CheckpointError(
            f"load_state_dict(assign=True): '{key}' ('{sp.fqn}') has its unsharded parameter registered now "
            "(after unshard(), or between a forward and its backward): assigning would replace the gathered "
            "copy, not the shard. Call reshard() on the sharded module first, then load")
    why = take.misfit(sp, value)
    if why:
        raise CheckpointError(
            f"load_state_dict(assign=True): '{key}' cannot become the sharded parameter '{sp.fqn}': {why}. "
            f"Pass distribute_tensor(full, param.device_mesh, param.placements) for it (param = the model's "
            f"state_dict()['{key}']: {take.spec_text(sp.sharded)}), or the full unsharded tensor; a "
            "stored-quantized parameter takes its codes (and '<name>_qscale' scales)")
    take.take(sp, value)
    return registered
