"""Changes to a sharded module tree through torch's own utilities, checked as they happen.

``fully_shard`` fixes the parameters of a module tree: each becomes a sharded DTensor that the group
all-gathers, whose gradient it reduces. Torch's utilities that re-register, replace or re-parametrize
parameters (``torch.nn.utils.parametrize``, ``weight_norm`` and ``spectral_norm`` old and new style,
``torch.nn.utils.prune``, the quantization-aware module swaps of ``torch.ao.quantization``, the fusions of
``torch.ao.quantization.fuse_modules``, ``load_state_dict(assign=True)``, plain assignments) all go through
``nn.Module.register_parameter`` or the registration of a submodule. Two global registration hooks of
``torch.nn.modules.module`` (installed by the first ``fully_shard``) look at every such registration into
a module of a sharded tree and at every registration of a parameter perparam manages:

* a managed parameter put back where it already is: accepted (no change); replaced by a DTensor of its
  mesh, placements and shapes (computed from sharded parameters): its values taken, the parameter stays
  (``take``; FSDP2 takes it at lazy init);
* a managed parameter registered at a new place while its old place is in a module that left the tree
  (``parametrize.remove_parametrizations`` moves ``parametrizations.<name>.original`` back, with or without
  ``unshard()`` first): it *moves* there, keeping its group and sharded object (the optimizer's); its
  value (the merged weight) is re-sharded (``move``);
* any other registration of a managed parameter at a second place (``register_parametrization``,
  ``spectral_norm``, pruning, a QAT module swap, tying weights after sharding), a new parameter in a
  sharded tree (``weight_norm``, ``prune.remove``, a fused module, an assignment), or a new parameter
  that holds a DTensor computed from sharded parameters: refused at that call with
  ``ShardedTreeChangeError``, naming the parameter and the module and the fix. A managed place the utility
  emptied on its way is put back first (the message says when torch changed more than that).

What no hook sees (``del module.weight``, ``module._parameters[...] = ...``, ``torch.func``'s swaps) is
refused by the slot check at the next forward or ``unshard()`` (``ShardedParam.check_slots``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from ..sharding.errors import ShardingError
from . import take
from .live_groups import GROUPS
from .state import TrainingState
from .untraced import graph_holder

#: ``module.__dict__`` key: a weak reference to the group whose ``fully_shard`` call took the module's tree
#: (weak, so a deep copy of a module does not copy the group)
_TREE_ATTR = "_perparam_tree"

#: ``module.__dict__`` key of the modules where a ``ShardedParam`` has a place
#: (``module.guard_stored_dtypes``)
OWNED_ATTR = "_perparam_owned"
#: class attribute of the ``Sharded<Class>`` subclasses ``fully_shard`` swaps in: the class they derive from
BASE_ATTR = "_perparam_base"

_FIX = ("Apply it before fully_shard (fully_shard then shards what it registered). To change a trained "
        "sharded model (merge adapters, fuse, quantize, prune for export), gather its weights with "
        "perparam.full_state.full_state_dict (or perparam.finetune.lora.merged_state_dict), load them into "
        "an unsharded copy of the model and change that")


class ShardedTreeChangeError(ShardingError, RuntimeError):
    """A parameter registration into a sharded module tree that perparam cannot follow. A
    ``ShardingError`` and a ``RuntimeError`` (the type FSDP2 raises for a model it cannot run as
    changed)."""


def watch(group, ignored_ids: set[int], on_move) -> None:
    """Start checking registrations into ``group``'s module trees (called by ``fully_shard``).
    ``on_move(params)``: what ``fully_shard`` sets up on a parameter's places (the stored-dtype guard, the
    load hooks), run again for a parameter that ``move`` gives a new place."""
    GROUPS.watched[group] = (frozenset(ignored_ids), on_move)
    GROUPS.add(group)
    ref = weakref.ref(group)
    for root in group.modules:
        for m in root.modules():
            m.__dict__.setdefault(_TREE_ATTR, ref)  # a submodule sharded earlier keeps its own group
    if not GROUPS.hooks:
        GROUPS.hooks.append(nn.modules.module.register_module_parameter_registration_hook(_on_parameter))
        GROUPS.hooks.append(nn.modules.module.register_module_module_registration_hook(_on_module))


def tree_group(module: nn.Module):
    """The group whose ``fully_shard`` call took ``module``'s tree, while ``module`` is in it (not a deep
    copy of one of its modules, as ``fuse_conv_bn_eval`` makes, nor a module that left it), or ``None``."""
    ref = module.__dict__.get(_TREE_ATTR)
    group = ref() if ref is not None else None
    return None if group is None or id(module) not in _tree_ids(group) else group


def bump() -> None:
    """Perparam created sharded or unsharded parameter objects (a group, or
    ``ShardedParam._ensure_buffers``)."""
    GROUPS.bump()


def generation() -> int:
    """How many times perparam created parameter objects or moved one (``bump``): a cache of anything derived
    from parameter names (``MeshPart._what``) is current while this is unchanged."""
    return GROUPS.generation()


def lookup(tensor) -> tuple | None:
    """``(group, ShardedParam)`` when ``tensor`` is a sharded or unsharded parameter perparam holds."""
    return GROUPS.lookup(tensor)


def group_holding(sp):
    """The group (a ``fully_shard`` call's) that manages ``sp``, or ``None``."""
    hit = lookup(sp.sharded)
    return hit[0] if hit is not None and hit[1] is sp else None


def _at_slot(sp, module: nn.Module, name: str) -> bool:
    return any(m is module and n == name for m, n in sp.slots)


def _tree_ids(group) -> set[int]:
    return {id(m) for root in group.modules for m in root.modules()}


def _path(group, module: nn.Module) -> str | None:
    """``module``'s path in ``group``'s trees ("" for a module given to ``fully_shard`` alone), or
    ``None``."""
    for i, root in enumerate(group.modules):
        for path, m in root.named_modules(remove_duplicate=False):
            if m is module:
                return ".".join(p for p in (str(i) if len(group.modules) > 1 else "", path) if p)
    return None


def class_name(module: nn.Module) -> str:
    """The name of ``module``'s own class, without the ``Sharded`` subclass ``fully_shard`` swapped in
    (which records the class it derives from under ``BASE_ATTR``)."""
    cls = type(module)
    return cls.__dict__.get(BASE_ATTR, cls).__name__


_cls = class_name


def _where(module: nn.Module, name: str, group) -> str:
    path = _path(group, module) if group is not None else None
    return f"'{name}' of {_cls(module)}" + (f" '{path}'" if path else "")


def _utility(module: nn.Module, name: str) -> str:
    if isinstance(module, parametrize.ParametrizationList):
        return ("torch.nn.utils.parametrize.register_parametrization (also parametrizations.weight_norm, "
                "spectral_norm, orthogonal)")
    if isinstance(getattr(module, "parametrizations", None), nn.ModuleDict) or _cls(module).startswith(
            "Parametrized"):
        return ("torch.nn.utils.parametrize.remove_parametrizations, which has already taken the "
                "parametrization off the module (build the model again)")
    if name.endswith("_orig"):
        return "torch.nn.utils.prune or torch.nn.utils.spectral_norm"
    if name.endswith(("_g", "_v")):
        return "torch.nn.utils.weight_norm"
    return ("a torch utility (parametrize, weight_norm, spectral_norm, prune, prune.remove, a quantization "
            "or fusion module swap) or an assignment")


def _owned(module: nn.Module) -> list:
    """The ``ShardedParam``s with a place in ``module`` (recorded by ``module.guard_stored_dtypes``)."""
    return list({id(sp): sp for sp in module.__dict__.get(OWNED_ATTR, ())}.values())


def _restore_vacated(module: nn.Module) -> list[str]:
    """Put back managed parameters a utility removed from ``module`` on its way here (``weight_norm`` and
    ``spectral_norm`` delete ``weight`` before registering their own), in their places in the module's
    order; returns their names."""
    back, order = [], []
    for sp in _owned(module):
        hit = lookup(sp.sharded)
        for m, n in sp.slots:
            if m is not module:
                continue
            order.append(n)
            if hit is not None and module._parameters.get(n) is None and n not in module.__dict__:
                module._parameters[n] = sp.unsharded if hit[0].registered_unsharded else sp.sharded
                back.append(n)
    if back:  # the order fully_shard saw (state_dict and named_parameters follow it)
        params = module._parameters
        ordered = {n: params[n] for n in order if n in params}
        ordered.update((n, p) for n, p in params.items() if n not in ordered)
        params.clear()
        params.update(ordered)
    return back


def _on_parameter(module: nn.Module, name: str, param: nn.Parameter):
    if not GROUPS:
        return None
    hit = lookup(param)
    if hit is not None and graph_holder(module) and tree_group(module) is None:  # torch.compile's references
        return None
    owner = tree_group(module)
    if hit is not None:
        group, sp = hit
        if _at_slot(sp, module, name):
            return None
        if owner is group and _movable(group, sp, module):
            return move(group, sp, module, name, param)
        back = _restore_vacated(module)
        raise ShardedTreeChangeError(
            f"perparam: parameter '{sp.path}' of group [{group.name}] is sharded by fully_shard and cannot "
            f"be registered again as {_where(module, name, owner)} after fully_shard (by "
            f"{_utility(module, name)}): a parameter has one place in a sharded model, which perparam "
            f"all-gathers and reduces. {_FIX}; tie weights before fully_shard too.{_changed(back, name)}")
    if owner is not None:
        if id(param) in GROUPS.watched.get(owner, ((), None))[0]:
            return None
        replaced = next((sp for sp in _owned(module) if _at_slot(sp, module, name)), None)
        if replaced is not None:
            if module._parameters.get(name) is replaced.sharded and not take.misfit(replaced, param):
                # a DTensor of its spec: the values taken (FSDP2's lazy-init reset)
                take.take(replaced, param)
                return replaced.sharded
            raise ShardedTreeChangeError(replaced_message(replaced, module, name))
        back = _restore_vacated(module)
        raise ShardedTreeChangeError(
            f"perparam: new parameter {_where(module, name, owner)} registered after fully_shard (by "
            f"{_utility(module, name)}): fully_shard fixed the parameters of this sharded tree, so this one "
            "would be neither sharded nor reduced (each rank would train its own copy). "
            f"{_FIX}.{_changed(back, name)}")
    mesh = param.device_mesh if isinstance(param, DTensor) else None
    if mesh is not None and GROUPS.holds_mesh(mesh):
        raise ShardedTreeChangeError(
            f"perparam: new parameter '{name}' of {_cls(module)} holds a DTensor computed from "
            f"parameters sharded by fully_shard (by {_utility(module, name)}); perparam would neither "
            f"all-gather nor reduce it. {_FIX}")
    return None


def _changed(back: list[str], name: str) -> str:
    if not back:
        return ""
    if f"{name}_orig" in back:  # torch.nn.utils.prune.remove: the mask and the computed weight are gone too
        return (f" (perparam put back {back}, but prune.remove had already deleted the pruning mask: build "
                "the model again, and remove pruning before fully_shard or on an unsharded copy)")
    return f" (perparam put back {back}, which the utility had removed; nothing else changed)"


def _on_module(parent: nn.Module, name: str, child: nn.Module | None):
    if child is None or not GROUPS:
        return None
    owner = tree_group(parent)
    if owner is None:
        return None
    ignored = GROUPS.watched.get(owner, ((), None))[0]
    where_attached = _where(parent, name, owner)
    by = ("torch.nn.utils.parametrize.register_parametrization (also parametrizations.weight_norm, "
          "spectral_norm, orthogonal)" if isinstance(child, parametrize.ParametrizationList)
          else "a module swap by "
          "torch.ao.quantization fuse_modules / prepare / convert, fuse_conv_bn_eval, or an assignment")
    for sub_path, sub in child.named_modules(remove_duplicate=False):
        for n, p in sub._parameters.items():
            if p is None or id(p) in ignored:
                continue
            hit = lookup(p)
            if hit is not None and _at_slot(hit[1], sub, n):
                continue
            where = f"{name}.{sub_path}".rstrip(".")
            what = (f"parameter '{hit[1].path}' of group [{hit[0].name}], which is sharded elsewhere" if hit
                    else "a parameter perparam does not manage")
            undone = _undo_parametrization(owner, parent, name, child)
            raise ShardedTreeChangeError(
                f"perparam: module {_cls(child)} attached as {where_attached} after fully_shard (by {by}) "
                f"holds {what} at '{where}.{n}': it would be neither sharded nor reduced. {_FIX}. A module "
                f"holding no parameters, or only the sharded ones where they are, may be attached.{undone}")
    ref = weakref.ref(owner)
    for sub in child.modules():
        sub.__dict__.setdefault(_TREE_ATTR, ref)
    return None


def _undo_parametrization(owner, parent: nn.Module, name: str, child: nn.Module) -> str:
    """``register_parametrization`` attaches its ``ParametrizationList`` last, once it has deleted the
    parameter, swapped the module's class and put a property in its place: when that attachment is
    refused, undo those steps (as ``remove_parametrizations`` would) and put the parameter back. Returns
    what to tell the user."""
    if not isinstance(child, parametrize.ParametrizationList) or not isinstance(parent, nn.ModuleDict):
        return ""
    module = next((m for root in owner.modules for m in root.modules()
                   if m._modules.get("parametrizations") is parent), None)
    if module is None:
        return ""
    cls = type(module)
    if isinstance(cls.__dict__.get(name), property):
        delattr(cls, name)
    if len(parent) == 0:
        del module._modules["parametrizations"]
        module.__class__ = cls.__bases__[0]
    back = _restore_vacated(module)
    return f" (perparam undid the parametrization of {back}; the module is as it was)" if back else ""


def _movable(group, sp, module: nn.Module) -> bool:
    """Every place ``sp`` had is in a module that left the group's tree, and ``module`` is in it."""
    tree = _tree_ids(group)
    return id(module) in tree and not any(id(m) in tree for m, _ in sp.slots)


def move(group, sp, module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter:
    """Make ``module.<name>`` the place of ``sp`` (its old places left the tree), with the value ``param``
    holds now: the full tensor a utility ``set_`` into the unsharded parameter, or a DTensor it swapped
    into the sharded one (re-sharded with one all-gather when its placements differ). Returns the sharded
    parameter for torch to register. Raises ``ShardedTreeChangeError`` where perparam cannot follow."""
    what = f"parameter '{sp.path}' of group [{group.name}] moving to {_where(module, name, group)}"
    why = ("during " + group.state.value if group.state is not TrainingState.IDLE
           else "as a tensor-parallel parameter" if sp.tp is not None
           else "as a stored-quantized parameter" if sp.stored_quantized
           else "in a group with precision islands" if group.islands else None)
    if why is not None:
        raise ShardedTreeChangeError(
            f"perparam: {what} (by {_utility(module, name)}) {why}: perparam moves only plain data-parallel "
            "parameters of groups without precision islands, between steps. The utility has already changed "
            f"the module: build the model again. {_FIX}")
    with torch.no_grad():
        if param is sp.unsharded:  # the utility set_ the full value into the gathered parameter
            local = sp.shard_of(param.detach())
            sp.local_shard().copy_(local)
        elif not _fits(sp, param):  # a DTensor of other placements swapped into the sharded object
            fresh = sp._make_sharded(param.detach().full_tensor())
            grad = sp.sharded.grad
            torch.utils.swap_tensors(sp.sharded, fresh)
            sp.sharded.grad = grad
    # the shard changed: a stage-1/2 kept copy is refreshed at the next all-gather (runtime.zero)
    sp.kept_key = None
    if group.registered_unsharded or group.storage_alive:
        group.reshard()
    # the old unsharded object now holds other storage
    sp._padded = sp._padded_data = sp._padded_write = sp.unsharded = None
    sp.slots = [(module, name)]
    path = _path(group, module)
    sp.fqn = sp.path = f"{path}.{name}" if path else name  # (``sp.path`` from the group's modules now)
    GROUPS.watched[group][1]([sp])  # the face's per-place set-up (dtype guard, load hooks) given to ``watch``
    bump()
    return sp.sharded


def _fits(sp, param) -> bool:
    """``param`` (the sharded object after a swap) still has ``sp``'s mesh, placements, shapes and dtype."""
    if not isinstance(param, DTensor):
        return False
    local = param._local_tensor
    return (param.device_mesh is sp.mesh and tuple(param.placements) == tuple(sp.placements)
            and tuple(param.shape) == sp.global_shape and local.dtype == sp.policy.stored_dtype
            and tuple(local.shape) == tuple(sp.layout.local_shape(sp.shard_rank)))


def replaced_message(sp, module: nn.Module, name: str, removed: bool = False) -> str:
    """Why ``module.<name>`` (a place of ``sp``) may not be replaced or removed after ``fully_shard``, and
    what to do instead; a model still on the meta device is told how to materialise it."""
    what = f"parameter '{sp.path}' ({class_name(module)}.{name})"
    if sp.local_shard().is_meta:
        return (f"{what} of a sharded model still on the meta device was "
                f"{'removed' if removed else 'replaced'}: a new tensor there would replace the sharded "
                "parameter fully_shard created. Load the values instead: load_state_dict(sd, assign=True) or "
                "set_model_state_dict(..., StateDictOptions(full_state_dict=True)) take them into the "
                "sharded parameters, as does perparam.full_state.load_full_state_dict(model, "
                "full_state_dict); or materialise the shards in place, model.to_empty(device=...), and "
                "initialise them")
    if removed:
        return (f"{what} was removed after fully_shard (del module.{name}, or a torch utility such as "
                "parametrize.register_parametrization, weight_norm, spectral_norm or prune run after "
                "fully_shard); perparam all-gathers and reduces the parameter it sharded there. Apply such "
                "utilities before fully_shard, or build the module again and shard it")
    return (f"{what} was replaced after fully_shard (module.{name} = ..., load_state_dict(assign=True), or "
            "torch.func.functional_call, which cannot pass its own tensors through a sharded module); "
            "perparam manages the sharded parameter it created. Change values in place instead "
            f"(with torch.no_grad(): {name}.copy_(distribute_tensor(new, {name}.device_mesh, "
            f"{name}.placements)), load_state_dict without assign=True, or set_model_state_dict(..., "
            "StateDictOptions(full_state_dict=True))), or build the module again and shard it")
