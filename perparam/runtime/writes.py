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

Some writes are also given the meaning one process gives them (DTensor's differs):

* ``p.data = x`` (torch would swap the DTensor's metadata and keep the old shard): a tensor of the
  parameter's global shape, or a DTensor of its mesh, placements and shape, is copied into the shard (the
  parameter object stays); anything else is refused with ``ShardDataAssignmentError`` naming the parameter;
* random initialization (``nn.init.uniform_/normal_/kaiming_*/xavier_*/trunc_normal_``, ``Tensor.uniform_``,
  ``normal_``, ``bernoulli_`` ..., i.e. ``reset_parameters()``): the full tensor is drawn on every rank as
  one process draws it (the generator advances by the whole tensor, so later parameters match too) and
  this rank's rows kept: bitwise the unsharded model's values at any number of ranks. Memory: one full
  parameter at a time. Initializers that draw into new tensors (``trunc_normal_``'s rejection sampling
  into ``torch.empty_like(p)``, ``orthogonal_`` into ``p.new_empty(...)``) draw into scratch DTensors
  tracked the same way, and a Python decision on a mask of one (``if not mask.any()``) is taken on the whole
  tensor (DTensor's ``bool()`` of a ``Partial`` reads this rank's part); factories into ``out=p``
  (``eye_``) fill the full tensor too;
* ``p[index] = x`` and in-place writes to ``p[index]`` (``Embedding``'s zeroed ``padding_idx`` row; DTensor
  writes a copy when the row lies on one rank): written into the full tensor (two all-gathers, every rank
  alike) and this rank's rows kept.

Not seen (rank-local, detected by ``runtime.zero.check_unwritten``): writes into ``p.to_local()`` or into
the tensors ``state_dict()`` handed out (``dcp.load``); after those call ``mark_shards_written()`` on the
sharded module on every rank.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ..sharding.errors import ShardingError

#: the ``__dict__`` key of a tracked tensor's owner
OWNER_KEY = "_perparam_shard_owner"
#: the ``__dict__`` key of a window, ``p[index]`` of a sharded parameter: ``(p, index)``. DTensor makes it a
#: copy (a row of a ``Shard(0)`` parameter lies on one rank); an in-place write to it is written back
_WINDOW_KEY = "_perparam_window_of"

#: in-place methods that change no values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "_fix_weakref", "pin_memory"})
_INPLACE_OPERATORS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})
#: ``Tensor`` methods that draw random values in place: drawn as the full tensor, this rank's rows kept
_RANDOM = frozenset({"uniform_", "normal_", "bernoulli_", "cauchy_", "exponential_", "geometric_",
                     "log_normal_", "random_"})
#: calls making an uninitialized DTensor from a tracked one: a scratch tensor, tracked without an owner
#: (``trunc_normal_``'s rejection sampling draws into ``torch.empty_like(tensor)``; ``orthogonal_`` into
#: ``tensor.new_empty(...)``); what is computed from a scratch tensor is scratch too
_SCRATCH_FROM = frozenset({"empty_like", "new_empty", "new_empty_strided"})
#: comparisons of a tracked tensor: their masks are scratch, so that a Python decision on them
#: (``if not mask.any()``: ``trunc_normal_``'s rejection loop) is taken on the whole tensor, the same on
#: every rank, not on this rank's partial result (DTensor's ``bool()`` of a ``Partial`` reads the local value)
_MASKS = frozenset({"lt", "gt", "le", "ge", "eq", "ne", "__lt__", "__gt__", "__le__", "__ge__", "__eq__", "__ne__",
                    "isnan", "isinf", "isfinite", "isposinf", "isneginf"})
_DECISIONS = frozenset({"__bool__", "item", "tolist", "__float__", "__int__"})
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
        if name == "__get__" and func != _DATA_GET:  # attribute reads (requires_grad, grad, ...): the fast path
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args)
        if name == "__set__" and func == _DATA_SET and owner_of(args[0]) is not None:
            return _assign_data(owner_of(args[0]), args[0], args[1])
        if name.endswith("_"):
            if kwargs and "tensor" in kwargs and getattr(func, "__module__", None) == "torch.nn.init":
                args, kwargs = (kwargs["tensor"], *args), {k: v for k, v in kwargs.items() if k != "tensor"}
            if args and isinstance(args[0], TrackedDTensor) and (
                    name in _RANDOM and func is getattr(torch.Tensor, name, None)
                    or getattr(func, "__module__", None) == "torch.nn.init"):
                drawn = _draw_full(owner_of(args[0]), args[0], func, args, kwargs or {})
                if drawn is not None:
                    return drawn
        if name == "__setitem__" and owner_of(args[0]) is not None:
            return _set_items(owner_of(args[0]), *args)
        out = kwargs.get("out") if kwargs else None
        if (isinstance(out, TrackedDTensor) and owner_of(out) is not None and out.is_floating_point()
                and not any(isinstance(a, torch.Tensor) for a in args)):  # a factory into p: torch.eye(..., out=p)
            drawn = _draw_full(owner_of(out), out, lambda full, **kw: func(*args, **kw, out=full), (out,),
                               {k: v for k, v in kwargs.items() if k != "out"})
            if drawn is not None:
                return drawn
        if name in _DECISIONS and _is_scratch(args[0]) and any(p.is_partial() for p in args[0].placements):
            t = args[0]
            args = (t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        for t in (_targets(name, args, kwargs) if name[-1:] == "_" or name in _INPLACE_OPERATORS or kwargs else ()):
            sp = owner_of(t)
            if sp is not None:
                sp._writes += 1
            window = t.__dict__.get(_WINDOW_KEY) if isinstance(t, TrackedDTensor) else None
            if window is not None:
                _write_back(t, *window)
        if isinstance(result, DTensor) and type(result) is DTensor:
            if name == "detach" or (name == "__get__" and func == _DATA_GET):
                sp = owner_of(args[0])
                if sp is not None or _is_scratch(args[0]):
                    _track(result, sp)  # an alias sharing the shard: its writes are the parameter's
            elif name == "__getitem__" and owner_of(args[0]) is not None:
                _track(result, None)  # (never a parameter: its random draws are drawn as its own shape)
                result.__dict__[_WINDOW_KEY] = (args[0], args[1])
            elif name in _SCRATCH_FROM or name in _MASKS or any(_is_scratch(a) for a in args):
                _track(result, None)
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


def _write_back(window, base, index) -> None:
    """An in-place write to ``window`` (``base[index]``): put its values into ``base``'s shard, as one process's
    view would have. Two all-gathers (``full_tensor``), issued on every rank alike (the write runs on every
    rank); for initialization-time writes such as ``Embedding``'s zeroed ``padding_idx`` row."""
    with torch.no_grad():
        full = base.full_tensor()
        full[index] = window.full_tensor()
        base._local_tensor.copy_(distribute_tensor(full, base.device_mesh, base.placements,
                                                   src_data_rank=None)._local_tensor)
    sp = owner_of(base)
    if sp is not None:
        sp._writes += 1


def _set_items(sp, base, index, value) -> None:
    """``base[index] = value`` on a sharded parameter, one process's meaning (DTensor writes a replicated copy
    for a row that lies on one rank): the full tensor, written, and this rank's piece kept (two
    all-gathers, issued on every rank alike)."""
    with torch.no_grad():
        full = base.full_tensor()
        full[index] = value.full_tensor() if isinstance(value, DTensor) else value
        base._local_tensor.copy_(distribute_tensor(full, base.device_mesh, base.placements,
                                                   src_data_rank=None)._local_tensor)
    sp._writes += 1


def _is_scratch(t) -> bool:
    return type(t) is TrackedDTensor and owner_of(t) is None


def _draw_full(sp, tensor, func, args, kwargs):
    """Run the initializer ``func`` on a full tensor of ``tensor``'s global shape and dtype (every rank draws
    what one process draws) and copy this rank's piece into ``tensor``'s local tensor (DTensor's own split,
    ``distribute_tensor(..., src_data_rank=None)``: no communication). ``tensor``: a sharded parameter (``sp``
    its ``ShardedParam``), an alias of one, or a scratch tensor made from one (``sp`` ``None``). ``None``:
    not applicable (a stored-quantized parameter, a meta tensor, a tensor-valued argument): DTensor's own
    random op runs."""
    local = tensor._local_tensor
    if ((sp is not None and sp.stored_quantized) or local.is_meta or not tensor.is_floating_point()
            or any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))):
        return None
    full = torch.empty(tensor.shape, dtype=tensor.dtype, device=local.device)
    with torch.no_grad():
        func(full, *args[1:], **kwargs)
        if sp is not None and tuple(tensor.shape) == sp.global_shape:  # the parameter or an alias: its own split
            local.copy_(sp.shard_of(full))
            sp._writes += 1
        else:
            local.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements,
                                          src_data_rank=None)._local_tensor)
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
