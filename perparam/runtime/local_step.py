"""A ``torch.optim`` step on perparam's sharded parameters without DTensor dispatch.

``SGD``, ``Adam`` and ``AdamW`` update every element from the same element of the parameter, its gradient
and its state (plus scalars): on a sharded parameter that is the same arithmetic on the local shards,
so running it on the local tensors gives bit for bit what DTensor's dispatch gives, for about half the
CPU (the benchmark's AdamW on 2-rank shards: ``benchmarks/optim_dispatch.py``, ``benchmarks/README.md``).

Around each step of such an optimizer (the ``LocalSwap`` stage of its binding, ``perparam.runtime.optim``),
every perparam parameter in its ``param_groups`` is replaced by its local tensor, the local gradient
attached as ``.grad``, and its state re-keyed to the local tensor with DTensors unwrapped (``swap_in``);
after the step the parameters are put back, the local ``.grad`` detached, and the state re-keyed back,
tensors shaped like the local shard wrapped as DTensors of the parameter's mesh and placements (state the
step created) or restored to the DTensor they were (state it updated in place) (``swap_out``). Outside the
step the optimizer, its ``state_dict`` and DCP see exactly what they see without this.

It applies only to ``torch.optim.SGD``, ``Adam`` and ``AdamW`` themselves (a subclass may change
``step``), not ``differentiable``, to a step without a closure (``step(closure)`` computes the gradients
inside the step), when every gradient is a DTensor with its parameter's placements and
local shape, every parameter is on the CPU and none is offloaded (``perparam.offload`` moves state around
the step), and ``perparam.configure(local_optimizer_step=True)`` (the default); otherwise the step runs on
DTensors as before. A step whose step proper raises leaves the swap in place until the next step of that
optimizer, whose pre-hook undoes it first. The user's step hooks never see the swap: perparam's pre-hook is
the optimizer's last and its post-hook the first (``perparam.runtime.optim.binding``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..sharding.policy import OffloadPolicy
from . import config
from .optim.step import GradKind

#: the optimizers whose update is elementwise (plus scalars): exact on local shards
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

_NO_OFFLOAD = OffloadPolicy()
_ABSENT = object()


def has_closure(args, kwargs) -> bool:
    """``step(closure)``: the closure runs inside the step, after the pre-hooks; its ``zero_grad()`` and
    backward would act on the swapped-in local tensors' ``.grad`` while perparam's reduction writes the
    DTensor ``.grad``, and the step would apply the stale (or no) gradient. Such a step runs on DTensors."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args: (optimizer, *step's args)
    return closure is not None


def _local(optimizer, owners, step) -> dict[int, DTensor | None] | None:
    """id(sharded parameter) -> its sharded ``.grad`` (as the step read it), for the parameters of ``owners``,
    when the step may run on their local shards (one pass over them), else ``None``."""
    if not config.current().local_optimizer_step or not owners:
        return None
    if any(group.get("differentiable", False) for group in optimizer.param_groups):
        return None
    grads = step.grads()
    mine = {}
    for sp in owners:
        p = sp.sharded
        shard = p._local_tensor
        offload = sp.policy.offload
        if not shard.is_cpu or (offload is not _NO_OFFLOAD and offload != _NO_OFFLOAD):
            return None
        grad, kind = grads[id(sp)]
        if kind is GradKind.OTHER:  # perparam's own gradient has what is checked below
            if (not isinstance(grad, DTensor) or grad.placements != p.placements
                    or grad.device_mesh != p.device_mesh):
                return None
            local = grad._local_tensor
            if local.shape != shard.shape or local.dtype != shard.dtype or local.is_sparse:
                return None
        mine[id(p)] = grad
    return mine


def swap_in(optimizer, owners, step) -> list | None:
    """Swap the local shards of ``owners`` (the ``ShardedParam``s ``optimizer`` holds) into its
    ``param_groups`` when the step may run on them (``step``: the step, which knows each gradient's kind);
    returns the records ``swap_out`` takes (``None``: the step runs on DTensors)."""
    mine = _local(optimizer, owners, step)
    if mine is None:
        return None
    records = []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            grad = mine.get(id(p), _ABSENT)
            if grad is _ABSENT:
                continue
            local = p._local_tensor
            local.grad = None if grad is None else grad._local_tensor
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v
                                          for k, v in state.items()}
            params[i] = local
            records.append((params, i, p, local, state))
    return records


def _wrap(value, p: DTensor, local: torch.Tensor):
    """A state tensor the step created: a DTensor of ``p``'s mesh and placements when it has the local
    shard's shape (``zeros_like(p)`` on the DTensor path gives that), else as it is (a scalar step count)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.shape != local.shape:
        return value
    spec = p._spec
    if value.dtype != p.dtype:
        spec = DTensorSpec(p.device_mesh, p.placements,
                           tensor_meta=TensorMeta(p.shape, p.stride(), value.dtype))
    return DTensor(value, spec, requires_grad=False)


def swap_out(optimizer, records: list | None) -> None:
    """Undo ``swap_in`` (``records``: what it returned; ``None``: nothing was swapped)."""
    if records is None:
        return
    for params, i, p, local, before in records:
        params[i] = p
        local.grad = None
        state = optimizer.state.pop(local, None)
        if state is None:
            if before is not None:
                optimizer.state[p] = before
            continue
        restored = {}
        for key, value in state.items():
            old = before.get(key) if before is not None else None
            if isinstance(old, DTensor) and old._local_tensor is value:
                restored[key] = old  # updated in place
            elif key == "step":  # a plain tensor on the DTensor path, even for a 0-dim parameter's shape
                restored[key] = value
            else:
                restored[key] = _wrap(value, p, local)
        optimizer.state[p] = restored
