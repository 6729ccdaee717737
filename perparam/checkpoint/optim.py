"""``perparam.checkpoint``'s optimizer state: each optimizer's manifest entry and tensors by parameter name
(one optimizer under ``optim.``, the ``i``-th of a sequence under ``optim<i>.``), and their restoration on
load; the tensor and JSON helpers the model's state shares."""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..offload import tier as offload_tier
from ..runtime import owner_state
from ..runtime.optim.binding import bind


def info(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "dtensor": isinstance(t, DTensor)}


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def optimizer_params(model: nn.Module, optimizer) -> list[list[tuple[str, torch.Tensor]]]:
    bind(optimizer)  # built before fully_shard: point it at the sharded parameters now
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        named = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                                      "parameter of the model (a parameter the model no longer has, e.g. an "
                                      "adapter merged away by remove_parametrizations, or a tensor that "
                                      "never was one): build the optimizer from the model's parameters as "
                                      "they are now")
            named.append((names[id(p)], p))
        groups.append(named)
    return groups


def as_json(value, what: str):
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must be JSON-serialisable (numbers, strings, lists, dicts): "
                              f"{e}") from None
    return value


def listed(optimizer) -> list[tuple[str, torch.optim.Optimizer]]:
    """``save``/``load``'s ``optimizer`` as ``[(key prefix, optimizer)]``: one optimizer's state under
    ``optim.<name>.<key>``, the ``i``-th of a sequence's (Muon and AdamW) under ``optim<i>.<name>.<key>``."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [("optim.", optimizer)]
    return [(f"optim{i}.", opt) for i, opt in enumerate(optimizer)]


def optimizer_entry(model: nn.Module, optimizer, state: dict, prefix: str) -> dict:
    """The manifest entry of ``optimizer`` (class, groups by parameter name, non-tensor state); its
    tensors go into ``state`` under ``prefix``. A collective (owner state)."""
    offload_tier.bring_in(optimizer)  # offloaded state read back once, ahead of DCP's reads
    groups, opt_state = [], {}
    named_groups = optimizer_params(model, optimizer)
    owned = owner_state.sharded_state(optimizer)  # update="owner": whole on the owner -> sharded like p
    for group, named in zip(optimizer.param_groups, named_groups):
        options = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
        groups.append({"params": [n for n, _ in named], "options": as_json(options, "optimizer options")})
        for name, p in named:
            entries = {}
            for key, value in owned.get(id(p), optimizer.state.get(p, {})).items():
                if isinstance(value, torch.Tensor):
                    state[f"{prefix}{name}.{key}"] = value
                    entries[key] = info(value)
                else:
                    entries[key] = {"value": as_json(value, f"optimizer state '{key}' of '{name}'")}
            if entries:
                opt_state[name] = entries
    return {"class": type(optimizer).__name__, "param_groups": groups, "state": opt_state}


def optimizer_targets(model: nn.Module, optimizer, saved: dict | None, prefix: str, targets: dict,
                       problems: list[str]) -> list[tuple[torch.Tensor, dict]]:
    """``load``: fresh tensors for ``optimizer``'s saved state (added to ``targets`` under ``prefix``),
    as ``[(parameter, state)]``; a mismatch with the manifest entry ``saved`` goes into ``problems``."""
    named_groups = optimizer_params(model, optimizer)
    restore: list[tuple[torch.Tensor, dict]] = []
    if saved is None:
        problems.append("the checkpoint has no optimizer state for this optimizer (or a different number of "
                        "optimizers); load(path, model) without an optimizer, or pass the optimizers it was "
                        "saved with")
    elif saved["class"] != type(optimizer).__name__:
        problems.append(f"the optimizer was a {saved['class']} and is a {type(optimizer).__name__} now")
    elif [g["params"] for g in saved["param_groups"]] != [[n for n, _ in g] for g in named_groups]:
        problems.append("the optimizer's parameter groups differ from the saved ones (names per group: "
                        f"{[g['params'] for g in saved['param_groups']]})")
    else:
        for named in named_groups:
            for name, p in named:
                entries, state = saved["state"].get(name, {}), {}
                for key, info in entries.items():
                    if "value" in info:
                        state[key] = info["value"]
                    elif info["shape"] == list(p.shape) and isinstance(p, DTensor):  # sharded like p
                        state[key] = targets[f"{prefix}{name}.{key}"] = torch.zeros_like(
                            p, dtype=dtype_of(info["dtype"]))
                    else:
                        state[key] = targets[f"{prefix}{name}.{key}"] = torch.zeros(
                            info["shape"], dtype=dtype_of(info["dtype"]), device=local(p).device)
                restore.append((p, state))
    return restore


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def restore_loaded(optimizer, saved: dict, restore: list[tuple[torch.Tensor, dict]]) -> None:
    """``load``, once every tensor is read: ``optimizer``'s state and group options from the checkpoint."""
    owner_state.own_state(optimizer, restore)  # update="owner": onto the owners of the current plan
    routed = owner_state.routed_ids(optimizer)  # an empty entry on the other ranks (owner_state's docstring)
    for p, state in restore:
        if state or id(p) in routed:
            optimizer.state[p] = state
        else:
            optimizer.state.pop(p, None)
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for key, value in saved_group["options"].items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
