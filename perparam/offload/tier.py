"""Where each parameter's persistent state lives: the hooks that move it between memory and its tier.

``check`` (called by ``fully_shard`` before it changes anything) refuses a tier a parameter cannot have
and makes the disk tier's scratch folders; ``attach`` (after the group exists) files each offloaded
parameter's ``ParamOffload`` and installs:

* two global optimizer step hooks (``torch.optim``'s, so stock AdamW/Adam/SGD, foreach or not, need
  nothing): before a step, every slot of the optimizer's offloaded parameters is fetched (usually already
  on its way) and waited for; after it, the optimizer's new state tensors are moved into files the first
  time (``Slot``) and every slot is written back and evicted on the I/O thread;
* a post-accumulate-grad hook on each trainable offloaded parameter: the read-ahead of its optimizer
  state (and stored shard) starts when its reduced gradient is ready, so it overlaps the rest of backward;
* for ``state="all"``: forward hooks on the group's modules: before the group's all-gather its stored
  shards are fetched (and the next group's, in the last forward's order), after its forward evicted.

Nothing here changes what is computed: a slot is a file mapping, so a tensor touched while evicted is
read back by the kernel (slower, never stale). ``OffloadError`` is raised from the step pre-hook when a
write-back failed (the bytes are still in memory) and from the step post-hook when the files cannot be
made (before any is made, when the free space says so).
"""

from __future__ import annotations

import ctypes
import shutil
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .host import HostSlot
from .mapped import OffloadError, Slot
from .scratch import Scratch, ScratchError, scratch_for

#: live ``ShardedParam``s with an offloaded tier (each carries ``.offload``: its ``ParamOffload``)
_OWNERS: weakref.WeakSet = weakref.WeakSet()
_hooks: list = []
_order: list[int] = []  # the groups (ids of their _Group) in the last forward's order
_current: list[int] = []


class _Group(list):
    """The ``ParamOffload``s with stored shards of one ``fully_shard`` call (its forward hooks hold it)."""


_groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> _Group, while its model lives


class ParamOffload:
    """One parameter's tier and its slots (files) on it."""

    def __init__(self, sp, owner: str, scratch: Scratch) -> None:
        self.sp = sp
        self.policy = sp.policy.offload
        self.label = f"'{sp.fqn}' of {owner}"
        self.scratch = scratch
        self.state_slots: dict[str, Slot] = {}
        self.shard_slot: Slot | None = None

    @property
    def shards(self) -> bool:
        return self.policy.state == "all"

    def slots(self) -> list[Slot]:
        out = list(self.state_slots.values())
        return out + [self.shard_slot] if self.shard_slot is not None else out

    def shard_to_adopt(self) -> torch.Tensor | None:
        """The stored shard's tensor when it is not (or no longer) in its file, else ``None``."""
        if not self.shards:
            return None
        local = self.sp.local_shard()
        if local.is_meta or local.numel() == 0 or (self.shard_slot is not None and self.shard_slot.holds(local)):
            return None
        return local

    def state_to_adopt(self, state: dict) -> list[tuple[str, torch.Tensor]]:
        """The optimizer state tensors (1+ dims, on the CPU) not yet in their files."""
        out = []
        for key, value in state.items():
            local = value._local_tensor if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor) or local.dim() == 0 or local.numel() == 0:
                continue
            if (local.device.type == "cpu") != (self.policy.tier == "disk"):
                continue  # the disk tier holds CPU tensors; the cpu tier holds device tensors
            slot = self.state_slots.get(key)
            if slot is None or not slot.holds(local):
                out.append((key, local))
        return out

    def adopt(self, state: dict) -> None:
        local = self.shard_to_adopt()
        if local is not None:
            self.shard_slot = Slot(self.scratch, f"{self.label} stored shard", local)
        for key, tensor in self.state_to_adopt(state):
            label = f"{self.label} optimizer state '{key}'"
            if self.policy.tier == "cpu":
                self.state_slots[key] = HostSlot(label, tensor, self.policy.pin_memory)
            else:
                self.state_slots[key] = Slot(self.scratch, label, tensor)


def check(entries: list[tuple[str, object, int]], device_type: str, owner: str) -> dict[str, Scratch]:
    """Refuse tiers the parameters cannot have, before ``fully_shard`` changes anything; make the disk
    tier's scratch folders and check they have room for the stored shards. ``entries``: ``(name,
    ResolvedPolicy, bytes of this rank's shard)``. Raises ``OffloadError`` naming the parameter (and the
    folder)."""
    scratches: dict[str, Scratch] = {}
    for name, policy, _ in entries:
        tier = policy.offload
        if not tier.offloaded:
            continue
        if device_type != "cpu" and tier.tier == "disk":
            raise OffloadError(f"parameter '{name}' of {owner}: the disk tier is implemented for CPU meshes only "
                               f"(this mesh is on {device_type}); use OffloadPolicy('cpu', ...) or 'device'")
        if device_type != "cpu" and tier.tier == "cpu" and tier.state == "all":
            raise OffloadError(f"parameter '{name}' of {owner}: the cpu tier of the stored shard on a {device_type} "
                               "mesh (host optimizer step) is not implemented yet; use OffloadPolicy('cpu', "
                               "'optimizer') (optimizer state in pinned host memory) or 'device' for it")
        if tier.tier == "disk" and tier.path not in scratches:
            try:
                scratches[tier.path] = scratch_for(tier.path)
            except ScratchError as e:
                raise OffloadError(f"parameter '{name}' of {owner}: {e.strerror}; name a writable directory in "
                                   "OffloadPolicy('disk', path=...)") from None
    _check_space(entries, scratches, owner)
    return scratches


def _check_space(entries, scratches: dict[str, Scratch], owner: str) -> None:
    need: dict[str, int] = {}
    for _, policy, nbytes in entries:
        if policy.offload.tier == "disk" and policy.offload.state == "all":
            need[policy.offload.path] = need.get(policy.offload.path, 0) + nbytes
    for path, nbytes in need.items():
        free = shutil.disk_usage(scratches[path].dir).free
        if nbytes > free:
            raise OffloadError(f"{owner}: the disk tier needs {nbytes} bytes for stored shards in {path} but "
                               f"{free} are free; free space or name another directory")


def attach(params: list, modules: list, owner: str, scratches: dict[str, Scratch]) -> None:
    """File the offloaded parameters of one group (``params``: its ``ShardedParam``s) and install the
    hooks; the disk tier's stored shards move into their files now (``check`` made sure they fit).
    Raises ``OffloadError`` when a file cannot be made all the same."""
    offloaded = [sp for sp in params if sp.policy.offload.tier == "disk"
                 or (sp.policy.offload.tier == "cpu" and sp.mesh_device.type != "cpu")]
    if not offloaded:
        return
    _install()
    group = _Group()
    for sp in offloaded:
        po = ParamOffload(sp, owner, scratches.get(sp.policy.offload.path))
        sp.offload = po
        _OWNERS.add(sp)
        if sp.sharded.requires_grad:
            sp.sharded.register_post_accumulate_grad_hook(lambda _p, po=po: _read_ahead(po))
        if po.shards:
            po.adopt({})
            for slot in po.slots():
                slot.evict(write=True)
            group.append(po)
    if group:
        _groups[id(group)] = group
        for m in modules:
            m.register_forward_pre_hook(lambda *_, g=group: _before_forward(g), prepend=True)
            m.register_forward_hook(lambda *_, g=group: _after_forward(g), always_call=True)


def _read_ahead(po: ParamOffload) -> None:
    for slot in po.slots():
        slot.fetch()


def _before_forward(group: _Group) -> None:
    key = id(group)
    if key not in _current:
        _current.append(key)
    for po in group:
        if po.shard_to_adopt() is not None:
            po.adopt({})
        if po.shard_slot is not None:
            po.shard_slot.fetch()
    if key in _order and _order.index(key) + 1 < len(_order):
        for po in _groups.get(_order[_order.index(key) + 1], ()):
            if po.shard_slot is not None:
                po.shard_slot.fetch()
    for po in group:
        if po.shard_slot is not None:
            po.shard_slot.wait()


def _after_forward(group: _Group) -> None:
    for po in group:
        if po.shard_slot is not None:
            po.shard_slot.evict(write=False)


def _install() -> None:
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_pre_step))
        _hooks.append(register_optimizer_step_post_hook(_post_step))


def _offloads(optimizer) -> list[tuple[torch.Tensor, ParamOffload]]:
    by_id = {id(sp.sharded): sp.offload for sp in _OWNERS}
    return [(p, by_id[id(p)]) for group in optimizer.param_groups for p in group["params"] if id(p) in by_id]


def _pre_step(optimizer, args, kwargs) -> None:
    found = _offloads(optimizer)
    for _, po in found:
        _read_ahead(po)
    errors = []
    for _, po in found:
        for slot in po.slots():
            try:
                slot.wait()
            except OffloadError as e:
                errors.append(e)
    if errors:  # every slot waited for: the step can be retried once the cause is gone
        more = f" ({len(errors) - 1} more tensors failed alike)" if len(errors) > 1 else ""
        raise OffloadError(f"{errors[0]}{more}; the optimizer step did not run")


def bring_in(optimizer) -> None:
    """Fetch every offloaded tensor of ``optimizer``'s parameters and wait for it (before a checkpoint
    reads them; they stay resident until the next step's write-back). Raises ``OffloadError``."""
    _pre_step(optimizer, (), {})


def _post_step(optimizer, args, kwargs) -> None:
    global _order, _current
    if _current:
        _order, _current = _current, []
    found = _offloads(optimizer)
    need: dict[Scratch, int] = {}
    for p, po in found:
        state = optimizer.state.get(p, {})
        for _, tensor in po.state_to_adopt(state) if po.scratch is not None else ():
            need[po.scratch] = need.get(po.scratch, 0) + tensor.numel() * tensor.element_size()
    for scratch, nbytes in need.items():
        free = shutil.disk_usage(scratch.dir).free
        if nbytes > free:
            names = ", ".join(po.label for _, po in found[:3])
            raise OffloadError(f"disk tier: the optimizer state of {names}... needs {nbytes} bytes in "
                               f"{scratch.root} but {free} are free; free space or name another directory in "
                               "OffloadPolicy('disk', path=...). The state is kept in memory")
    for p, po in found:
        po.adopt(optimizer.state.get(p, {}))
    if need:
        trim_heap()  # the state's first home was anonymous memory, now free: give it back to the system
    for _, po in found:
        for slot in po.slots():
            slot.evict(write=True)


def trim_heap() -> None:
    """``malloc_trim(0)``: glibc keeps freed blocks under its mmap threshold in its heaps; this returns
    their pages to the system (no-op where the C library has no ``malloc_trim``)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def offloaded_bytes() -> dict[str, int]:
    """Bytes this process holds in each tier's files now (``{"disk": n}``; ``{}`` when nothing is)."""
    out: dict[str, int] = {}
    for sp in list(_OWNERS):
        for slot in sp.offload.slots():
            tier = "cpu" if isinstance(slot, HostSlot) else "disk"
            out[tier] = out.get(tier, 0) + slot.nbytes
    return out


def flush() -> None:
    """Wait for every queued fetch and write-back of this process (e.g. before measuring memory)."""
    for sp in list(_OWNERS):
        for slot in sp.offload.slots():
            slot.wait()
