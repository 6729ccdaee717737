"""Modules that use a sharded module's parameters without calling it.

perparam all-gathers a group's parameters in the forward pre-hook of the module(s) given to
``fully_shard``; outside that forward they are sharded DTensors. A module that reads a child's
parameters directly instead of calling the child (``nn.MultiheadAttention`` passes ``out_proj.weight`` to
``F.multi_head_attention_forward``; a user's ``F.linear(x, self.head.weight)``; weight tying by reading
another module's ``.weight``) therefore computes with a sharded DTensor, and DTensor refuses with its
generic "got mixed torch.Tensor and DTensor".

* At ``fully_shard``: ``check_readers`` refuses a call whose tree holds a stock torch module of
  ``READERS`` whose reading child was sharded by an earlier call (shard the parent whole).
* At run time: DTensor's error, as it leaves the forward of a sharded module (its post-forward hook
  sees it before anything is resharded: ``note``), becomes ``UsedWhileShardedError`` (raised by
  ``ShardedModule.__call__``) naming the parameter, its group and the module that used it, with the fix.
  Only the error path does any of this: nothing is added to a call that succeeds. An error that leaves
  no sharded module's forward (the reader is outside every sharded tree) stays DTensor's.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from .registration import class_name, lookup

#: stock torch modules whose forward reads these children's parameters without calling the children
READERS: dict[type, tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}
if hasattr(nn, "LinearCrossEntropyLoss"):  # reads linear.weight / linear.bias (torch >= 2.13)
    READERS[nn.LinearCrossEntropyLoss] = ("linear",)

_MIXED = "got mixed torch.Tensor and DTensor"

_FIX = ("Shard the module that uses it whole (fully_shard on it or on a module above it, with no separate "
        "fully_shard call on the module holding the parameter), or call the module holding the parameter "
        "instead of reading its parameters (self.head(x), not F.linear(x, self.head.weight)); for parameters "
        "tied across modules, shard those modules in one call, fully_shard([module_a, module_b])")


class UsedWhileShardedError(RuntimeError):
    """A parameter sharded by ``fully_shard`` was used outside its group's forward (still a DTensor)."""


def check_readers(roots: list[nn.Module], group_of) -> str | None:
    """The refusal for a call over ``roots`` whose tree holds a ``READERS`` module whose reading child is a
    group of an earlier call (``group_of(child)`` not ``None``), else ``None``."""
    for root in roots:
        for path, module in root.named_modules():
            for child_name in READERS.get(type(module), ()):
                child = getattr(module, child_name, None)
                if isinstance(child, nn.Module) and group_of(child) is not None:
                    cls, where = type(module).__name__, path or type(module).__name__
                    child_path = f"{path}.{child_name}" if path else child_name
                    return (f"'{child_path}' ({type(child).__name__}) was sharded by an earlier fully_shard "
                            f"call, but its parent '{where}' is a {cls}, whose forward reads "
                            f"'{child_name}''s parameters without calling it, so their all-gather would "
                            f"never run. Shard the {cls} whole: build the model again and leave "
                            f"'{child_path}' out of the earlier calls (e.g. of a loop that shards every "
                            f"nn.Linear); fully_shard on '{where}' or a module above it shards it too")
    return None


def _frames(error: BaseException) -> list:
    """The traceback's frames, innermost first."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]


def _sharded_in(value, lookup):
    """``(group, ShardedParam)`` when ``value`` (or an element of a tuple/list) is a sharded parameter."""
    for t in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(t, DTensor):
            hit = lookup(t)
            if hit is not None and t is hit[1].sharded:
                return hit
    return None


def _registered_sharded(module: nn.Module, lookup) -> list:
    """``(group, ShardedParam)`` of parameters in ``module``'s tree that are registered sharded now."""
    out = {}
    for m in module.modules():
        for p in m._parameters.values():
            hit = _sharded_in(p, lookup) if p is not None else None
            if hit is not None:
                out[id(hit[1])] = hit
    return list(out.values())


def note(error: BaseException, group) -> None:
    """Attach to ``error`` (raised in the forward of ``group``'s module, seen by its post-forward hook before
    anything is resharded) the ``UsedWhileShardedError`` that explains it, when it is DTensor's mixing
    error on a parameter perparam sharded; ``ShardedModule.__call__`` raises that instead."""
    if (isinstance(error, UsedWhileShardedError) or hasattr(error, "_perparam_explained")
        or _MIXED not in str(error)):
        return
    explained = explain(error, group.ctx.groups[0].modules)
    if explained is not None:
        error._perparam_explained = explained


def explain(error: BaseException, roots: list[nn.Module]) -> UsedWhileShardedError | None:
    """``UsedWhileShardedError`` for DTensor's mixing error when it involves a parameter perparam sharded
    (found in the traceback's locals, else among the parameters registered sharded in the innermost
    module whose code raised it); ``None`` for any other error. ``roots``: the root group's modules, for
    module paths."""
    if isinstance(error, UsedWhileShardedError) or _MIXED not in str(error):
        return None
    frames = _frames(error)
    hits, user = [], None
    for i, frame in enumerate(frames):
        for value in frame.f_locals.values():
            hit = _sharded_in(value, lookup)
            if hit is not None:
                hits = [hit]
                user = next((f.f_locals["self"] for f in frames[i:]
                             if isinstance(f.f_locals.get("self"), nn.Module)), None)
                break
        if hits:
            break
    if not hits:
        user = next((f.f_locals["self"] for f in frames if isinstance(f.f_locals.get("self"), nn.Module)),
                    None)
        hits = _registered_sharded(user, lookup) if user is not None else []
    if not hits:
        return None
    names = {id(m): (f"{i}." if len(roots) > 1 else "") + n for i, root in enumerate(roots)
             for n, m in root.named_modules()}
    params = " or ".join(f"'{sp.path}' of group '{g.path or g.name}' [{g.name}]" for g, sp in hits[:4])
    by = f"{class_name(user)}.forward" if user is not None else "code outside its group's forward"
    if user is not None and names.get(id(user)):
        by += f" ('{names[id(user)]}')"
    first = str(error).splitlines()[0]
    return UsedWhileShardedError(
        f"perparam: parameter {params} was used by {by} while sharded: perparam all-gathers a group's "
        "parameters only around the forward of the module(s) given to fully_shard, and this code used them "
        f"without calling that forward, so it got the sharded DTensor. {_FIX}. (DTensor: {first})")


def forward_called_directly(module: nn.Module, group, error: BaseException,
                            caller) -> UsedWhileShardedError | None:
    """``UsedWhileShardedError`` for DTensor's mixing error raised by ``module.forward`` (``module`` given to
    ``fully_shard``, ``group`` its group) when its group's parameters were not gathered: the forward was
    called directly (``model.forward(x)``, a bound ``forward`` kept aside, or an unregistered method calling
    it), so the pre-forward hook never ran. ``caller``: the frame that called ``forward``, to name the method.
    ``None`` when the parameters were gathered (the error is someone else's: ``note`` explains it) or for any
    other error.
    """
    if group is None or group.registered_unsharded or _MIXED not in str(error):
        return None
    owner = caller.f_locals.get("self") if caller is not None else None
    by = ""
    if isinstance(owner, nn.Module) and not str(caller.f_globals.get("__name__", "")).startswith("torch."):
        by = f" by {class_name(owner)}.{caller.f_code.co_name}"
    method = caller.f_code.co_name if owner is module and caller.f_code.co_name != "forward" else "generate"
    first = str(error).splitlines()[0]
    return UsedWhileShardedError(
        f"perparam: {class_name(module)}.forward was called directly{by} on a module given to fully_shard "
        f"(group [{group.name}]): a call of .forward(...), of a bound forward kept aside, or of a method "
        "that calls self.forward skips the module's hooks, so its parameters were never all-gathered and the "
        "forward got the sharded DTensors. Call the module instead: model(x), not model.forward(x); for a "
        f"method that calls forward, register it once: perparam.register_forward_method(model, '{method}'). "
        f"(DTensor: {first})")
