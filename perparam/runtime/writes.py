"""Every write to a sharded parameter that runs on every rank is counted, applied, or refused.

perparam keeps unsharded storage across steps (ZeRO stage 1/2 copies, ``reshard_after_forward=False``,
``set_reshard_after_backward(False)``, parameters kept gathered for evaluation) and must know when the
shards it was gathered from change. Version counters do not tell: a DTensor ``torch._foreach_*`` op
bumps neither the parameter's nor its local shard's, and ``p.data.mul_(...)`` writes through a tensor
with counters of its own. So the sharded parameter is a ``TrackedDTensor`` (a DTensor whose
``__torch_function__`` sees every torch call made on it, then runs it as DTensor does) and each call that
writes it, or a ``detach()`` / ``.data`` alias of it, counts one write on its ``ShardedParam``
(``ShardedParam.writes``). The user's code runs on every rank, so the count is the same on every rank, a
rank with an empty shard included: it may decide the next all-gather's size (``runtime/zero.py``,
``ParamGroup._versions``). Seen this way: in-place DTensor methods and operators (``mul_``, ``copy_``,
``p[i] = x``, ``+=``), ``torch._foreach_*_`` and fused optimizer kernels, ``out=``, ``torch.nn.init.*``,
``load_state_dict`` in place, optimizer steps, EMA and averaging utilities (``torch.optim.swa_utils``,
which write through ``detach()``).

Two writes are also given the meaning one process gives them:

* ``p.data = x`` (torch would swap the DTensor's metadata and keep the old shard): a tensor of the
  parameter's global shape, or a DTensor of its mesh, placements and shape, is copied into the shard (the
  parameter object stays); anything else is refused with ``ShardDataAssignmentError`` naming the parameter;
* random initialization (``nn.init.uniform_/normal_/kaiming_*/xavier_*/trunc_normal_``, ``Tensor.uniform_``,
  ``normal_``, ``bernoulli_`` ..., i.e. ``reset_parameters()``): the full tensor is drawn on every rank as
  one process draws it (the generator advances by the whole tensor, so later parameters match too) and
  this rank's rows kept: bitwise the unsharded model's values at any number of ranks. Memory: one full
  parameter at a time. ``nn.init.orthogonal_`` and ``sparse_`` (which draw into a new DTensor) warn.

Not seen (rank-local, detected by ``runtime.zero.check_unwritten``): writes into ``p.to_local()`` or into
the tensors ``state_dict()`` handed out (``dcp.load``); after those call ``mark_shards_written()`` on the
sharded module on every rank.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.distributed.tensor import DTensor

from ..sharding.errors import ShardingError

#: the ``__dict__`` key of a tracked tensor's owner
OWNER_KEY = "_perparam_shard_owner"

#: in-place methods that change no values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "_fix_weakref", "pin_memory"})
_INPLACE_OPERATORS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})
#: ``Tensor`` methods that draw random values in place: drawn as the full tensor, this rank's rows kept
_RANDOM = frozenset({"uniform_", "normal_", "bernoulli_", "cauchy_", "exponential_", "geometric_",
                     "log_normal_", "random_"})
#: ``torch.nn.init`` functions that draw into a new DTensor (``tensor.new_empty``): not the unsharded values
_UNMATCHED_INITS = frozenset({"orthogonal_", "sparse_"})
_DATA_SET = torch.Tensor.data.__set__
_DATA_GET = torch.Tensor.data.__get__


class ShardDataAssignmentError(ShardingError, RuntimeError):
    """``p.data = x`` on a sharded parameter with an ``x`` perparam cannot take as the parameter's value
    (another shape, this rank's shard alone, a DTensor of other placements, a stored-quantized parameter)."""


class _Owner:
    """A tracked tensor's ``ShardedParam`` (weak). A copy (``copy.deepcopy`` of the model, pickling) holds
    none: the copy's ``ShardedParam`` binds its own at its next use (``ShardedParam.writes``)."""

    __slots__ = ("ref",)

    def __init__(self, sp=None) -> None:
        self.ref = weakref.ref(sp) if sp is not None else None

    def __call__(self):
        return self.ref() if self.ref is not None else None

    def __deepcopy__(self, memo):
        return _Owner()

    def __reduce__(self):
        return (_Owner, ())


def owner_of(t):
    o = t.__dict__.get(OWNER_KEY) if isinstance(t, TrackedDTensor) else None
    return o() if o is not None else None


def _track(t, sp) -> None:
    if type(t) is DTensor:
        t.__class__ = TrackedDTensor
    if isinstance(t, TrackedDTensor):
        t.__dict__[OWNER_KEY] = _Owner(sp)


def bound(sp) -> bool:
    """``sp.sharded`` is tracked for ``sp`` (``to_empty`` swaps a new object's class and ``__dict__`` in)."""
    return owner_of(sp.sharded) is sp


def bind(sp) -> None:
    """Track ``sp.sharded`` for ``sp``."""
    _track(sp.sharded, sp)


def rebind(params) -> None:
    """After ``nn.Module._apply`` (``to_empty``, ``.to(device)``: torch swaps new DTensors into the
    parameter objects): track them again and count a write (every rank runs it alike)."""
    for sp in params:
        if not bound(sp):
            bind(sp)
            sp._writes += 1


def _targets(name: str, args, kwargs) -> list:
    """The tensors a call writes (its ``self`` for in-place methods, operators and ``torch.nn.init``; the
    first list of a ``_foreach_*_`` / ``_fused_*_`` call; ``out=``)."""
    found = []
    if args and ((name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES)
                 or name in _INPLACE_OPERATORS):
        first = args[0]
        found.extend(first if isinstance(first, (list, tuple)) else (first,))
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        found.extend(out if isinstance(out, (list, tuple)) else (out,))
    return found


class TrackedDTensor(DTensor):
    """A sharded parameter's DTensor: DTensor in every respect, plus ``__torch_function__`` counting the
    writes of the calls made on it (see the module docstring)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__set__" and func == _DATA_SET and owner_of(args[0]) is not None:
            return _assign_data(owner_of(args[0]), args[0], args[1])
        if name.endswith("_"):
            if kwargs and "tensor" in kwargs and getattr(func, "__module__", None) == "torch.nn.init":
                args, kwargs = (kwargs["tensor"], *args), {k: v for k, v in kwargs.items() if k != "tensor"}
            sp = owner_of(args[0]) if args else None
            if sp is not None and (name in _RANDOM and func is getattr(torch.Tensor, name, None)
                                   or getattr(func, "__module__", None) == "torch.nn.init"):
                drawn = _draw_full(sp, args[0], func, args, kwargs or {})
                if drawn is not None:
                    return drawn
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        for t in _targets(name, args, kwargs):
            sp = owner_of(t)
            if sp is not None:
                sp._writes += 1
        if name == "detach" or (name == "__get__" and func == _DATA_GET):
            sp = owner_of(args[0])
            if sp is not None and isinstance(result, DTensor):
                _track(result, sp)  # an alias sharing the shard: its writes are the parameter's
        return result

    def __deepcopy__(self, memo):
        # torch's deepcopy of a wrapper subclass wants clone() to return the subclass: copy as a DTensor
        import copy

        self.__class__ = DTensor
        try:
            new = copy.deepcopy(self, memo)
        finally:
            self.__class__ = TrackedDTensor
        if type(new) is DTensor:
            new.__class__ = TrackedDTensor
        return new


def _draw_full(sp, tensor, func, args, kwargs):
    """Run the random initializer ``func`` on a full tensor of ``tensor``'s global shape and dtype (every rank
    draws what one process draws) and copy this rank's rows into the shard. ``None``: not applicable (a
    stored-quantized parameter, an alias of another shape, an initializer that draws into a new tensor)."""
    name = func.__name__
    if name in _UNMATCHED_INITS:
        warnings.warn(f"perparam: torch.nn.init.{name} on the sharded parameter '{sp.fqn}' draws into a new "
                      "DTensor, not as one process draws: the values differ from the unsharded model's. "
                      "Initialize before fully_shard, or load the values (load_state_dict)", stacklevel=3)
        return None
    local = tensor._local_tensor
    if (sp.stored_quantized or tuple(tensor.shape) != sp.global_shape or local.is_meta
            or tuple(local.shape) != tuple(sp.local_shard().shape)):
        return None
    full = torch.empty(sp.global_shape, dtype=tensor.dtype, device=local.device)
    with torch.no_grad():
        func(full, *args[1:], **kwargs)
        local.copy_(sp.shard_of(full))
    sp._writes += 1
    return tensor


def _assign_data(sp, tensor, value):
    """``tensor.data = value`` (``tensor``: the sharded parameter or an alias of it), one process's meaning."""
    shape, local = sp.global_shape, tensor._local_tensor
    where = f"'{sp.fqn}' (global shape {list(shape)}, this rank's shard {list(local.shape)})"
    fix = ("Assign a tensor of the global shape (every rank the same), or write in place: with torch.no_grad(): "
           "p.copy_(full) or p.copy_(distribute_tensor(full, p.device_mesh, p.placements))")
    if sp.stored_quantized:
        raise ShardDataAssignmentError(f"perparam: .data = ... on the stored-quantized parameter {where}: its "
                                       "shard holds quantized codes. Load the values with load_state_dict instead")
    if isinstance(value, DTensor):
        if tuple(value.shape) != shape or value.device_mesh != tensor.device_mesh:
            raise ShardDataAssignmentError(
                f"perparam: .data = a DTensor of shape {list(value.shape)} on mesh "
                f"{value.device_mesh.mesh.tolist()} for the sharded parameter {where}: perparam keeps the "
                f"parameter's shape and mesh. {fix}")
        if tuple(value.placements) != tuple(tensor.placements):
            value = value.redistribute(tensor.device_mesh, tensor.placements)  # every rank calls it alike
        piece = value._local_tensor
    elif isinstance(value, torch.Tensor):
        if tuple(value.shape) != shape:
            what = ("this rank's shard shape: perparam cannot tell it from a new value"
                    if tuple(value.shape) == tuple(local.shape) else "another shape")
            raise ShardDataAssignmentError(
                f"perparam: .data = a tensor of shape {list(value.shape)} for the sharded parameter {where}: "
                f"{what}; a sharded parameter keeps its global shape. {fix}")
        piece = sp.shard_of(value.detach())
    else:
        raise ShardDataAssignmentError(f"perparam: .data = {type(value).__name__} for the sharded parameter {where}")
    with torch.no_grad():
        local.copy_(piece)
    sp._writes += 1
