"""ZeRO stages 1 and 2 (``ParamPolicy.zero_stage``): when a parameter's kept unsharded copy is refreshed.

A stage-1/2 parameter keeps its unsharded buffer (``ShardedParam.unsharded``, ``param_dtype``, padded) on
every rank across steps: a group's ``free`` leaves it alone and forward and backward gather nothing for it.
After the shards change it is refreshed, in the group's next all-gather (lazily: the next pre-forward,
prefetch or ``unshard()``), together with whatever stage-3 parameters that all-gather carries. The shards
change at:

* an optimizer step: ``ShardedParam.optimizer_steps`` counts the steps of the ``torch.optim`` optimizers
  holding the parameter (``perparam.runtime.optim``: its ``CountStep`` stage), a count every rank shares. A
  parameter frozen when gathered and frozen now is not refreshed after a step (the optimizer skips it), unless
  it held a ``.grad`` at that step (the optimizer steps it then: the ``CountStep`` stage,
  ``runtime/optim/stages.py``, marks its copy stale);
* a load (``perparam.checkpoint.load``, ``load_full_state_dict``, ``load_state_dict``) or a device change
  (``to_empty``, ``.to(device)``): these call ``invalidate()``, which every rank calls alike;
* a write to the sharded parameter: ``ShardedParam.writes`` counts every torch call that writes it
  (``perparam/runtime/writes.py``: in-place ops, ``torch._foreach_*``, ``.data``, ``torch.nn.init``, EMA
  updates through ``detach()``), and the DTensor's own version counter (its views share it) is read too:
  the user's code runs on every rank, so both are the same on every rank.

The local shards' version counters do not decide a refresh: they may differ between ranks (an empty shard,
``dcp.load`` writing only the ranks that hold rows), and the decision must be the same on every rank,
since it sets the all-gather's size. A rank-local write (``dcp.load(model.state_dict())`` not followed by
``model.load_state_dict``, a copy into ``p.to_local()``) is not refreshed: call
``model.mark_shards_written()`` on every rank after it (``ShardedModule``). The version counters only tell
that such a write happened (those of the local shard and of the tensors ``state_dict()`` handed out, which
share its storage with counters of their own): before kept storage is used again, a rank that sees one
compares the storage with its shard and raises ``UnseenShardWriteError`` if they differ, before issuing
anything, instead of computing with the stale copy (``check_unwritten``; also for stage-3 storage kept by
``reshard_after_forward=False``, whose own version check cannot see writes through ``state_dict()``'s
tensors). A rank whose shard is empty sees nothing: its peers' error stops the job.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..sharding.errors import ShardingError
from . import shard_view
from .writes import OWNER_KEY

if TYPE_CHECKING:
    from .param import ShardedParam


class UnseenShardWriteError(ShardingError, RuntimeError):
    """A shard was written in place since the unsharded storage kept for it was gathered, by a route that
    does not refresh that storage (see the module docstring). A ``ShardingError`` and a ``RuntimeError``,
    like perparam's other refusals of a change made after ``fully_shard``."""


#: default process group (one per rank, also for ranks that are threads of one process: torch's threaded
#: process group keeps one world per thread) -> its load generation. Per rank, never per process: a load on
#: one thread rank must not make a peer thread's kept copies stale (its next all-gather would then carry
#: them, a size the other ranks of that peer's group do not issue).
_GENERATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_WORLD = [0]  # before init_process_group
_lock = threading.Lock()


def _world():
    return dist.distributed_c10d._world.default_pg if dist.is_initialized() else None


def generation() -> int:
    """This rank's load generation: the number of ``invalidate()`` calls made under its default process
    group (in its thread, for thread ranks)."""
    world = _world()
    if world is None:
        return _NO_WORLD[0]
    with _lock:
        return _GENERATIONS.get(world, 0)


def invalidate() -> None:
    """Every stage-1/2 kept unsharded copy of this rank (the parameters sharded under the calling thread's
    default process group) is stale: the next all-gather of its group refreshes it. perparam's loads and
    device moves call it on every rank (it changes the size of the next all-gathers). Internal: users
    call ``model.mark_shards_written()``."""
    world = _world()
    with _lock:
        if world is None:
            _NO_WORLD[0] += 1
        else:
            _GENERATIONS[world] = _GENERATIONS.get(world, 0) + 1


def needs_refresh(p: ShardedParam) -> bool:
    """``p`` (a stage-1/2 parameter) has no valid kept copy: never gathered, freed by a move, invalidated by
    a load, written since it was gathered (``p.writes``, ``runtime/writes.py``; or the DTensor's version,
    which its views share), or a step ran since it was gathered while it was trainable (then or now)."""
    key = p.kept_key
    if key is None or not p.storage_alive or key[1] != generation():
        return True
    if key[3] != p.writes or key[4] != p.sharded._version:
        return True
    return key[0] != p.optimizer_steps and (key[2] or p.sharded.requires_grad)


def lent(handed) -> None:
    """``handed``: ``(ShardedParam, value)`` pairs of a ``state_dict()`` call. Each value's local tensor
    shares its shard's storage with a version counter of its own (``dcp.load`` writes into it in place):
    its writes are tracked from now on (``check_unwritten``). The value is handed out as a plain DTensor
    (``detach()`` of the sharded parameter made it a tracked alias, ``runtime/writes.py``). Bookkeeping per
    parameter: one entry per ``state_dict()`` value still alive (a value that died is remembered as one
    flag, ``aliases_lost``), whatever the number of calls."""
    for p, value in handed:
        if isinstance(value, DTensor) and value is not p.sharded and type(value) is not DTensor:
            value.__dict__.pop(OWNER_KEY, None)
            value.__class__ = DTensor
        local = value._local_tensor if isinstance(value, DTensor) else None
        if local is None or local is p.local_shard():
            continue  # keep_vars=True: the shard itself, tracked already
        if p.write_sig is None:
            note_gathered([p], force=True)
        lend = shard_view.lend(p)
        if lend is not None:  # a view of the shard's lending alias: one entry, alive as long as the parameter
            value._local_tensor = lend
            if not p.aliases:
                p.aliases.append((weakref.ref(p._lend), p._lend._version))
            continue
        _prune(p)
        p.aliases.append((weakref.ref(local), local._version))


def _prune(p: ShardedParam) -> None:
    """Drop the aliases that died; one that did may have been written: ``aliases_lost``."""
    live = [(ref, version) for ref, version in p.aliases if ref() is not None]
    if len(live) != len(p.aliases):
        p.aliases_lost = True
        p.aliases = live


def written(p: ShardedParam) -> bool:
    """``p``'s local shard or a live tensor ``state_dict()`` handed out for it was written in place since the
    baseline (``note_gathered``), or such a tensor died since (it may have been)."""
    local, sig = p.local_shard(), p.write_sig
    if sig is None or sig[0]() is not local or sig[1] != local._version:  # another shard, or written
        return True
    _prune(p)
    return p.aliases_lost or any(ref()._version != version for ref, version in p.aliases)  # (live: pruned)


def note_gathered(params: list[ShardedParam], force: bool = False) -> None:
    """``params``' unsharded storage is being filled from their shards as they are now: their writes are
    tracked from here when they keep it across steps (stage 1/2) or ``state_dict()`` handed them out."""
    for p in params:
        if p.aliases:
            p.aliases = [(ref, t._version) for ref, _ in p.aliases if (t := ref()) is not None]
        p.aliases_lost = False
        local = p.local_shard()
        # the shard itself by weak reference: id() of a replaced, freed shard comes back for the new one
        p.write_sig = (weakref.ref(local), local._version) if force or p.kept or p.aliases else None


@torch.no_grad()
def check_unwritten(p: ShardedParam) -> None:
    """Raise ``UnseenShardWriteError`` when ``p``'s unsharded storage, kept as it is (a stage-1/2 copy
    current by the counts, or stage-3 storage kept by ``reshard_after_forward=False`` /
    ``set_reshard_after_backward(False)`` whose versions say fresh), was written since it was gathered
    (``signature`` changed) and no longer holds this rank's shard cast to the compute dtype, bit for bit,
    in its own rows. Compared for plain parameters without TP and not offloaded (their storage's rows are
    the cast shard exactly)."""
    if p.write_sig is None or not written(p):
        return
    if not p.plain or p.tp is not None or p.policy.offload.offloaded or not p.storage_alive:
        return
    if not shard_view.linked(p):  # (a linked shard is the copy's own rows: nothing to compare with)
        local = p.local_shard()
        own = p.shard_of(p.unsharded.detach())
        if torch.equal(own.contiguous().view(torch.uint8),
                       local.to(own.dtype).contiguous().view(torch.uint8)):
            note_gathered([p], force=True)  # written, but with what it held
            return
    if p.kept:
        kept = f"ZeRO stage {p.policy.zero_stage}: its unsharded copy is kept across steps"
    else:
        kept = ("its unsharded storage is kept: reshard_after_forward=False or "
                "set_reshard_after_backward(False)")
    raise UnseenShardWriteError(
        f"perparam: the shard of '{p.path}' ({kept}) was written in place since that copy was gathered, by a "
        "rank-local route perparam does not see (e.g. dcp.load(model.state_dict()) without "
        "model.load_state_dict(...) after it, or a write into p.to_local()); computing on would use the old "
        "weights. After such a write call model.mark_shards_written() on every rank (model: the sharded "
        "root, or any module fully_shard was called on), or load through model.load_state_dict / "
        "set_model_state_dict / perparam.checkpoint.load, which refresh it")


def mark_gathered(params: list[ShardedParam]) -> None:
    """``params``' kept copies are being filled from the shards as they are now."""
    current = generation()
    for p in params:
        sharded = p.sharded
        p.kept_key = (p.optimizer_steps, current, sharded.requires_grad, p.writes, sharded._version)
