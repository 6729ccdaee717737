"""What ``fully_shard`` checks and works out per call before it changes anything: the parameters it
collects (skipping already-sharded submodules) and their checks, ``ignored_params``, a parameter's mesh
(``ParamPolicy.mesh``) and tensor-parallel composition, ``reshard_after_forward`` made concrete, the
default mesh."""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from mesh import MeshError, check_dp_mesh, default_device_type

from .errors import ShardingError
from .module import (
    group_of,
)
from .runtime.live_groups import GROUPS
from .runtime.optim.registry import REGISTRY
from .runtime.tp import TensorParallel, compose


def ignored_ids(ignored_params, found) -> set[int]:
    """Ids of the ``ignored_params`` this call would otherwise manage."""
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor) or not all(isinstance(p, torch.Tensor)
                                                           for p in ignored_params):
        raise ShardingError("ignored_params must be a set of parameters (e.g. {model.lm_head.weight}), got "
                            f"{type(ignored_params).__name__}")
    # as FSDP2: parameters outside the module's tree (or managed by an earlier call) are simply not
    # concerned, so one set of ignored parameters can be passed to every call of a model
    known = {id(p) for _, p, _ in found}
    return {id(p) for p in ignored_params if id(p) in known}


def param_mesh(fqn: str, p: nn.Parameter, own: DeviceMesh | None, mesh: DeviceMesh, owner: str,
                secondary_size: int | None) -> DeviceMesh:
    """The data-parallel mesh parameter ``fqn`` is sharded on: its ``ParamPolicy.mesh`` (checked here, as
    the call's mesh is), else the call's ``mesh``. Raises ``ShardingError`` naming the parameter."""
    if own is None or own is mesh or own == mesh:
        return mesh
    where = f"ParamPolicy(mesh=...) of parameter '{fqn}' of {owner}"
    if own.device_type != mesh.device_type:
        raise ShardingError(f"{where} is a {own.device_type!r} mesh but the call's mesh is "
                            f"{mesh.device_type!r}: one fully_shard call computes on one device type; build "
                            f"the parameter's mesh with init_device_mesh({mesh.device_type!r}, ...)")
    try:
        check_dp_mesh(own)
    except MeshError as e:
        raise ShardingError(f"{where}: {e}") from None
    if own.get_coordinate() is None:
        raise ShardingError(f"{where} does not hold this rank ({dist.get_rank()}); give each rank the mesh "
                            "it belongs to (e.g. init_device_mesh(..., (ep, edp), mesh_dim_names=('ep', "
                            "'edp'))['edp'])")
    if isinstance(p.data, DTensor):
        raise ShardingError(f"{where}: the parameter is tensor-parallel ({p.data.device_mesh}), and a "
                            "tensor-parallel parameter on another data-parallel mesh than the call's is not "
                            "supported; drop mesh for it (it composes with the call's mesh) or shard it in a "
                            "fully_shard call of its own on that mesh")
    if secondary_size is not None:
        raise ShardingError(f"{where}: reshard_after_forward={secondary_size} (hpZ) is not supported with "
                            "parameters on another mesh than the call's; pass True or False, or shard the "
                            "parameter in a fully_shard call of its own")
    return own


def check_containers(modules: list[nn.Module], found) -> None:
    """Refuse (``ShardingError``, a ``ValueError``: FSDP2's type) an ``nn.ModuleList``/``nn.ModuleDict`` given
    as a module when the call would manage parameters: a container has no forward, so the hooks that
    all-gather them would never run (its children's forwards used the sharded DTensors)."""
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward and found:
            kind = type(m).__name__
            values = ".values()" if kind == "ModuleDict" else ""
            raise ShardingError(
                f"fully_shard({kind}): fully_shard does not support containers that do not implement "
                f"forward: a {kind} has no forward, so the hooks that all-gather its parameters would "
                f"never run. Pass its modules as a list, fully_shard(list(container{values})) (one group, "
                "one all-gather for them all), or call fully_shard on each of them")


def tp_composition(fqn: str, p: nn.Parameter, mesh: DeviceMesh, policy) -> TensorParallel | None:
    """The tensor-parallel composition of a parameter that is already a DTensor, else ``None``."""
    if not isinstance(p.data, DTensor):
        return None
    return compose(fqn, p.data, mesh, policy.placement)


def reshard_setting(value, num_shards: int) -> tuple[bool, int | None]:
    """FSDP2's ``reshard_after_forward`` values, as (free after forward?, hpZ's secondary size or None)."""
    if value is None:
        return True, None
    if isinstance(value, bool):
        return value, None
    if isinstance(value, numbers.Integral):
        value = int(value)
        if value == 1:
            return False, None
        if value == num_shards:
            return True, None
        if 1 < value < num_shards and num_shards % value == 0:
            return True, value
        divisors = [d for d in range(1, num_shards + 1) if num_shards % d == 0]
        raise ShardingError(f"reshard_after_forward={value}: an int is the number of ranks to reshard to "
                            f"after forward and must divide the shard axis size {num_shards} (one of "
                            f"{divisors}: 1 means False, {num_shards} means True); pass one of those, or "
                            "True or False")
    raise ShardingError(f"reshard_after_forward must be a bool, an int or None (as FSDP2), got {value!r}; "
                        "pass True or False")


def default_mesh() -> DeviceMesh:
    """A 1D mesh over every rank of the default process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ShardingError("fully_shard(mesh=None) needs torch.distributed.init_process_group() first, "
                            "or pass mesh=init_device_mesh(...)")
    return init_device_mesh(default_device_type(), (dist.get_world_size(),))


def check_mesh(mesh: DeviceMesh) -> None:
    try:
        check_dp_mesh(mesh)
    except MeshError as e:
        words = (f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: "
                 if getattr(mesh, "ndim", 0) > 2 else "fully_shard: ")
        raise ShardingError(f"{words}{e}") from None


def collect_params(modules: list[nn.Module]) -> tuple[list[tuple[str, nn.Parameter,
                                                                 list[tuple[nn.Module, str]]]],
                                                dict[str, tuple[str, ...]]]:
    """The parameters this call manages, with every slot each is registered in, and every name of each
    (keyed by its first name: a parameter tied inside the call has several).

    Walks the module trees, skipping subtrees already sharded by an earlier call; names are relative to
    the module given (prefixed ``i.`` for the i-th module of a list).
    """
    found: dict[int, tuple[str, nn.Parameter, list]] = {}
    names: dict[int, list[str]] = {}
    for i, root in enumerate(modules):
        prefix = f"{i}." if len(modules) > 1 else ""
        stack = [(prefix, root)]
        while stack:
            mod_prefix, mod = stack.pop()
            if mod is not root and group_of(mod) is not None:
                continue
            for name, p in mod._parameters.items():
                if p is None:
                    continue
                entry = found.setdefault(id(p), (mod_prefix + name, p, []))
                entry[2].append((mod, name))
                names.setdefault(id(p), []).append(mod_prefix + name)
            for child_name, child in reversed(list(mod._modules.items())):
                if child is not None:
                    stack.append((f"{mod_prefix}{child_name}.", child))
    return list(found.values()), {found[i][0]: tuple(ns) for i, ns in names.items()}


def check_param(fqn: str, p: nn.Parameter, owner: str, modules: list[nn.Module]) -> None:
    # the live groups (``GROUPS``, weak on each group: a weakref on the parameter itself would block
    # ``to_empty``'s ``swap_tensors``) recognise a parameter an earlier call already sharded
    earlier = next((g for g in GROUPS.snapshot() if g.manages(p)), None)
    if earlier is not None:
        other_fqn = next(sp.fqn for sp in earlier.params if sp.sharded is p)
        inside = any(sub is m for em in earlier.modules for sub in em.modules() for m in modules)
        if inside:
            raise ShardingError(
                f"parameter '{fqn}' of {owner} is already sharded by an earlier fully_shard call on its "
                f"parent {earlier.name} (as '{other_fqn}'); apply fully_shard bottom-up: submodules first, "
                "then their parent (build the model again: a fully_shard call cannot be undone)")
        raise ShardingError(
            f"parameter '{fqn}' of {owner} (this call) is already sharded by an earlier fully_shard call on "
            f"{earlier.name} (as '{other_fqn}'): the submodule holding it is shared by both. A parameter "
            f"belongs to one group: build the model again and shard both modules in one call "
            f"(fully_shard([the {earlier.name}, this {owner}])), or shard the shared submodule first with "
            "its own fully_shard call, before both")
    taken = REGISTRY.replaced.get(p)  # the parameter an earlier call replaced (tied across calls)
    if taken is not None:
        other, other_fqn = taken.call, taken.fqn
        raise ShardingError(
            f"parameter '{fqn}' of {owner} (this call) is shared with parameter '{other_fqn}' of an earlier "
            f"fully_shard call on {other}; a parameter can belong to one group only: build the model again "
            "and shard the modules that share it in one call, e.g. fully_shard([module_a, module_b]), or "
            "leave them to the parent's call")
    if p._backward_hooks:
        raise ShardingError(
            f"parameter '{fqn}' of {owner} has a hook registered with register_hook(); fully_shard replaces "
            "the parameter by a sharded one, so the hook would never fire. Remove it (handle.remove()) "
            "before fully_shard, and use p.register_post_accumulate_grad_hook(fn) instead: it carries over "
            "to the sharded parameter and fires with the reduced sharded gradient in p.grad")
    # the 0-dim, dtype and requires-grad checks run in resolve_params (shared with perparam plan)
