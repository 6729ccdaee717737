"""A DTensor of a sharded parameter's mesh, placements and shapes taken as its values: by
``load_state_dict(assign=True)`` (``perparam.full_state``) and by a reassignment of the parameter
(``module.w = nn.Parameter(dtensor)``, ``registration``: FSDP2 takes such a parameter at its lazy init,
``reset_sharded_param``). The parameter object perparam registered stays the model's, so an optimizer and
perparam's hooks keep working on it."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["misfit", "spec_text", "take"]


def spec_text(t: DTensor) -> str:
    return f"mesh {t.device_mesh}, placements {tuple(t.placements)}"


def misfit(sp, value: torch.Tensor) -> str:
    """Why ``value`` cannot be taken as ``sp``'s shard (``sp``: a ``ShardedParam``); "" when it can."""
    if sp.stored_quantized and value.is_floating_point():
        return "a float value for a stored-quantized parameter (its codes are stored)"
    if not isinstance(value, DTensor):
        return (f"a plain tensor of shape {tuple(value.shape)}, neither a DTensor nor the full tensor of "
                f"shape {sp.global_shape}")
    if value.device_mesh != sp.mesh or tuple(value.placements) != tuple(sp.placements):
        return f"a DTensor of {spec_text(value)}"
    if tuple(value.shape) != tuple(sp.sharded.shape):
        return f"a DTensor of global shape {tuple(value.shape)}, not {tuple(sp.sharded.shape)}"
    if tuple(value._local_tensor.shape) != tuple(sp.local_shard().shape):
        return (f"this rank's local shape {tuple(value._local_tensor.shape)} is not the shard's "
                f"{tuple(sp.local_shard().shape)}")
    return ""


def take(sp, value: DTensor) -> None:
    """``value``'s local tensor (``misfit`` is empty) becomes ``sp``'s shard: copied in place, or, on a
    shard still on the meta device, as its new storage (no copy where dtype and device match, as torch's
    assign) in the same parameter object. A value on the meta device leaves the shard as it is."""
    local = value._local_tensor.detach()
    if local.is_meta:
        return
    shard = sp.local_shard()
    local = local.to(device=sp.mesh_device, dtype=shard.dtype)
    with torch.no_grad():
        if not shard.is_meta:
            shard.copy_(local)
        else:
            fresh = nn.Parameter(DTensor(local.contiguous(), sp.sharded._spec, requires_grad=False),
                                 requires_grad=sp.sharded.requires_grad)
            # attributes the user set (swap_tensors swaps __dict__)
            fresh.__dict__.update(sp.sharded.__dict__)
            torch.utils.swap_tensors(sp.sharded, fresh)
    sp.kept_key = None  # a stage-1/2 kept copy is refreshed at the next all-gather
