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
from types import MappingProxyType

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
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})
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
_MASKS = frozenset({"lt", "gt", "le", "ge", "eq", "ne", "__lt__", "__gt__", "__le__", "__ge__", "__eq__",
                    "__ne__", "isnan", "isinf", "isfinite", "isposinf", "isneginf"})
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


class TrackedDTensor(DTensor):
    """A sharded parameter's DTensor: DTensor in every respect, plus ``__torch_function__`` counting the
    writes of the calls made on it (see the module docstring)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        # attribute reads (requires_grad, grad, ...): the fast path
        if name == "__get__" and func != _DATA_GET:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args)
        handler = _HANDLERS.get(name)
        if handler is None:  # no row: an in-place method (``name_``, not a dunder) writes its first argument
            handler = _writes_first if name.endswith("_") and not name.startswith("__") else _reads
        return handler(func, name, args, kwargs)

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


# ``TrackedDTensor.__torch_function__``'s table: a call's handler by the called function's ``__name__``
# (``_HANDLERS``, a constant table, frozen; a name in no row is an in-place method when it ends in ``_`` and
# is no dunder, else a read; attribute reads other than ``.data``, the most frequent calls, take the fast path
# before it). A handler runs the call as DTensor does (``_call``:
# ``out=`` counted), then counts the writes its kind makes and tracks what the result is.


def _call(func, args, kwargs):
    """Run ``func`` as DTensor does; a write into ``out=`` counted (a factory into a sharded parameter,
    ``torch.eye(n, out=p)``, drawn in full as ``_draw_full`` draws)."""
    if not kwargs:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args)
    out = kwargs.get("out")
    if (isinstance(out, TrackedDTensor) and owner_of(out) is not None and out.is_floating_point()
            and not any(isinstance(a, torch.Tensor) for a in args)):
        drawn = _draw_full(owner_of(out), out, lambda full, **kw: func(*args, **kw, out=full), (out,),
                           {k: v for k, v in kwargs.items() if k != "out"})
        if drawn is not None:
            return drawn
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    if out is not None:
        _count(out)
    return result


def _count(written) -> None:
    """One write on each written tensor's owner; a written window is written back into its parameter."""
    for t in written if isinstance(written, (list, tuple)) else (written,):
        sp = owner_of(t)
        if sp is not None:
            sp._writes += 1
        window = t.__dict__.get(_WINDOW_KEY) if isinstance(t, TrackedDTensor) else None
        if window is not None:
            _write_back(t, *window)


def _derived(result, args):
    """What is computed from a scratch tensor is scratch too."""
    if type(result) is DTensor and any(_is_scratch(a) for a in args):
        _track(result, None)
    return result


def _reads(func, name, args, kwargs):
    """Every name in no other row (views, arithmetic, reductions; ``out=`` counted by ``_call``)."""
    return _derived(_call(func, args, kwargs), args)


def _writes_first(func, name, args, kwargs):
    """In-place methods and operators (``mul_``, ``p += x``), ``torch._foreach_*_`` and fused optimizer
    kernels (their first argument, a list)."""
    result = _call(func, args, kwargs)
    if args:
        _count(args[0])
    return _derived(result, args)


def _initializes(func, name, args, kwargs):
    """``torch.nn.init.*`` and ``Tensor``'s random in-place methods: drawn in full where ``_draw_full``
    applies, else a write of the first argument."""
    nn_init = getattr(func, "__module__", None) == "torch.nn.init"
    if nn_init and kwargs and "tensor" in kwargs:
        args, kwargs = (kwargs["tensor"], *args), {k: v for k, v in kwargs.items() if k != "tensor"}
    if args and isinstance(args[0], TrackedDTensor) and (
            nn_init or name in _RANDOM and func is getattr(torch.Tensor, name, None)):
        drawn = _draw_full(owner_of(args[0]), args[0], func, args, kwargs or {})
        if drawn is not None:
            return drawn
    return _writes_first(func, name, args, kwargs)


def _sets_items(func, name, args, kwargs):
    """``p[index] = x`` (one process's meaning, ``_set_items``); into a window or a scratch tensor: a
    write."""
    sp = owner_of(args[0])
    if sp is not None:
        return _set_items(sp, *args)
    return _writes_first(func, name, args, kwargs)


def _sets_attribute(func, name, args, kwargs):
    """``p.data = x`` (one process's meaning, ``_assign_data``); other attribute writes as DTensor does."""
    sp = owner_of(args[0]) if func == _DATA_SET else None
    if sp is not None:
        return _assign_data(sp, args[0], args[1])
    return _reads(func, name, args, kwargs)


def _aliases(func, name, args, kwargs):
    """``detach()``, ``.data``: an alias sharing the shard, so its writes are the parameter's."""
    result = _call(func, args, kwargs)
    if type(result) is DTensor:
        sp = owner_of(args[0])
        if sp is not None or _is_scratch(args[0]):
            _track(result, sp)
    return result


def _windows(func, name, args, kwargs):
    """``p[index]``: a window (never a parameter: its random draws are drawn as its own shape)."""
    result = _call(func, args, kwargs)
    if type(result) is DTensor and owner_of(args[0]) is not None:
        _track(result, None)
        result.__dict__[_WINDOW_KEY] = (args[0], args[1])
        return result
    return _derived(result, args)


def _scratch(func, name, args, kwargs):
    """``_SCRATCH_FROM`` and ``_MASKS``: the result is scratch."""
    result = _call(func, args, kwargs)
    if type(result) is DTensor:
        _track(result, None)
    return result


def _decides(func, name, args, kwargs):
    """``_DECISIONS``: a Python value of a scratch ``Partial`` is read from the whole tensor."""
    t = args[0]
    if _is_scratch(t) and any(p.is_partial() for p in t.placements):
        args = (t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim), *args[1:])
    return _derived(_call(func, args, kwargs), args)


#: ``torch.nn.init``'s in-place functions, by name (``Tensor.normal_`` and ``uniform_`` share theirs:
#: ``_initializes`` tells them apart)
_INIT = frozenset(n for n, f in vars(torch.nn.init).items()
                  if n.endswith("_") and callable(f) and getattr(f, "__module__", None) == "torch.nn.init")
_HANDLERS = MappingProxyType({
    "__get__": _aliases,  # ``.data`` (every other attribute read takes the fast path)
    "__set__": _sets_attribute, "detach": _aliases, "__getitem__": _windows,
    **dict.fromkeys(_INPLACE_OPERATORS, _writes_first), "__setitem__": _sets_items,
    **dict.fromkeys(_RANDOM | _INIT, _initializes),
    **dict.fromkeys(_SCRATCH_FROM | _MASKS, _scratch),
    **dict.fromkeys(_DECISIONS, _decides),
    **dict.fromkeys(_NOT_WRITES, _reads),
})


def _write_back(window, base, index) -> None:
    """An in-place write to ``window`` (``base[index]``): put its values into ``base``'s shard, as one
    process's view would have. Two all-gathers (``full_tensor``), issued on every rank alike (the write runs
    on every rank); for initialization-time writes such as ``Embedding``'s zeroed ``padding_idx`` row."""
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
        # the parameter or an alias: its own split
        if sp is not None and tuple(tensor.shape) == sp.global_shape:
            local.copy_(sp.shard_of(full))
            sp._writes += 1
        else:
            local.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements,
                                          src_data_rank=None)._local_tensor)
    return tensor


def _assign_data(sp, tensor, value):
    """``tensor.data = value`` (``tensor``: the sharded parameter or an alias of it), one process's
    meaning."""
    shape, local = sp.global_shape, tensor._local_tensor
    where = f"'{sp.path}' (global shape {list(shape)}, this rank's shard {list(local.shape)})"
    fix = ("Assign a tensor of the global shape (every rank the same), or write in place: with "
           "torch.no_grad(): p.copy_(full) or p.copy_(distribute_tensor(full, p.device_mesh, p.placements))")
    if sp.stored_quantized:
        raise ShardDataAssignmentError(f"perparam: .data = ... on the stored-quantized parameter {where}: "
                                       "its shard holds quantized codes. Load the values with "
                                       "load_state_dict instead")
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
        raise ShardDataAssignmentError(f"perparam: .data = {type(value).__name__} for the sharded parameter "
                                       f"{where}")
    with torch.no_grad():
        local.copy_(piece)
    sp._writes += 1
