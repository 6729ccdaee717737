"""Where each parameter's persistent state lives: the hooks that move it between memory and its tier.

``check`` (called by ``fully_shard`` before it changes anything) refuses a tier a parameter cannot have
and makes the disk tier's scratch folders; ``attach`` (after the group exists) files each offloaded
parameter's ``ParamOffload`` and installs:

* two global optimizer step hooks (``torch.optim``'s, so stock AdamW/Adam/SGD, foreach or not, need
  nothing): before a step, every slot of the optimizer's offloaded parameters is fetched (usually already
  on its way) and waited for; after it, the optimizer's new state tensors are moved into files the first
  time (``Slot``) and every slot is written back and evicted on the I/O thread;
* the read-ahead of each trainable offloaded parameter's optimizer state (and stored shard) starts when
  its reduced gradient is accumulated (``ParamOffload.grad_ready``, called by the reduction as each
  group's gradients land, not at the end of backward), so it overlaps the rest of backward;
* for ``state="all"``: forward hooks on the group's modules: before the group's forward its stored
  shards are fetched (and the next group's, in the last forward's order), after its forward evicted; and
  the group's ``ParamGroup.offload_hook``, called by every all-gather of the group (forward, backward,
  prefetch) before it packs the shards: it starts their reads and those of the next
  ``RuntimeConfig.gather_read_ahead`` groups in the all-gathers' direction (backward: reverse forward order),
  so the backward all-gathers find their shards read in behind the runtime's prefetch;
* for ``state="all"`` on disk, the gradient shard of a trainable stage-2/3 parameter: a file reserved at
  ``fully_shard`` (``GradSlot``). The reduction (``ShardedParam.accumulate_sharded_grad``) makes a new
  ``.grad`` in it (``grad_new``) or reads it back before adding to it (``grad_in``), then has it written
  out and dropped (``grad_out``); the read-ahead above reads it back for the step, and after the step it
  is dropped without a write (the step only reads it).

Nothing here changes what is computed: a slot is a file mapping, so a tensor touched while evicted is
read back by the kernel (slower, never stale). ``OffloadError`` is raised from the step pre-hook when a
write-back failed (the bytes are still in memory) and from the step post-hook when the files cannot be
made (before any is made, when the free space says so).
"""

from __future__ import annotations

import ctypes
import itertools
import shutil
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import host
from .host import HostSlot
from .mapped import SHARD_LANE, GradSlot, OffloadError, Slot
from .scratch import Scratch, ScratchError, scratch_for

#: live ``ShardedParam``s with an offloaded tier (each carries ``.offload``: its ``ParamOffload``)
_OWNERS: weakref.WeakSet = weakref.WeakSet()
_hooks: list = []
#: optimizers holding host-offloaded state that got the state_dict pre-hook (``bring_in``)
_STATE_DICT_HOOKED: weakref.WeakSet = weakref.WeakSet()
_order: list[int] = []  # the groups (their _Group.key) in the last forward's order
_current: list[int] = []
_KEYS = itertools.count()  # a freed group's id() comes back for the next: a new model read ahead by its order


class _Group(list):
    """The ``ParamOffload``s with stored shards of one ``fully_shard`` call (its forward hooks hold it)."""

    def __init__(self) -> None:  # made empty (list.__new__); filled by append
        self.key = next(_KEYS)  # never reused


_groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> _Group, while its model lives


class ParamOffload:
    """One parameter's tier and its slots (files) on it."""

    def __init__(self, sp, owner: str, scratch: Scratch) -> None:
        self.sp = sp
        self.policy = sp.policy.offload
        self.label = f"'{sp.fqn}' of {owner}"
        self.scratch = scratch
        self.state_slots: dict[str, Slot] = {}
        self.shard_slot: Slot | None = None
        # state="all" on disk, trainable, sharded gradient: see grad_out
        self.grad_slot: GradSlot | None = None

    @property
    def shards(self) -> bool:
        return self.policy.state == "all"

    def slots(self) -> list[Slot]:
        """The slots holding a tensor now: optimizer state, stored shard, the ``.grad`` while it lives."""
        out = list(self.state_slots.values())
        out += [self.shard_slot] if self.shard_slot is not None else []
        return (out + [self.grad_slot] if self.grad_slot is not None and self.grad_slot.tensor is not None
                else out)

    def files(self) -> list[Slot]:
        """Every slot with a file, the gradient's reserved one included."""
        return list(self.state_slots.values()) + [s for s in (self.shard_slot, self.grad_slot)
                                                  if s is not None]

    def grad_ready(self) -> None:
        """Called by the reduction once this parameter's reduced gradient is in its sharded ``.grad``: the
        read-ahead of its slots for the optimizer step starts now, while backward goes on."""
        _read_ahead(self)

    def _grad_local(self) -> torch.Tensor | None:
        grad = self.sp.sharded.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else None
        if local is None or self.grad_slot is None or local.dtype != self.grad_slot.dtype \
                or tuple(local.shape) != self.grad_slot.shape or local.device.type != "cpu":
            return None  # no .grad, or one of the user's of another kind: left alone
        return local

    def grad_in(self) -> None:
        """Before a reduced gradient is added into the existing sharded ``.grad`` (several backwards per
        step): read its evicted bytes back (in memory once this returns). Raises ``OffloadError``."""
        local = self._grad_local()
        if local is not None and self.grad_slot.holds(local):
            self.grad_slot.fetch()
            self.grad_slot.wait()

    def grad_new(self, values: torch.Tensor) -> torch.Tensor:
        """The tensor a new sharded ``.grad`` should have for ``values`` (the reduced gradient, this rank's
        shard): a mapping of its reserved file holding them, or ``values`` when there is no file for it."""
        if self.grad_slot is None or values.dtype != self.grad_slot.dtype \
                or tuple(values.shape) != self.grad_slot.shape or values.device.type != "cpu":
            return values
        return self.grad_slot.take(values)

    def grad_out(self) -> None:
        """After a reduced gradient was accumulated into the sharded ``.grad`` held in the file: written
        out and dropped on the I/O thread; the read-ahead at the end of backward (``_read_ahead``) or the
        step's pre-hook reads it back. A ``.grad`` the user set is left alone."""
        local = self._grad_local()
        if local is not None and self.grad_slot.holds(local):
            self.grad_slot.evict(write=True)

    def shard_to_adopt(self) -> torch.Tensor | None:
        """The stored shard's tensor when it is not (or no longer) in its file, else ``None``."""
        if not self.shards:
            return None
        local = self.sp.local_shard()
        if local.is_meta or local.numel() == 0 or (self.shard_slot is not None
                                                   and self.shard_slot.holds(local)):
            return None
        return local

    def state_to_adopt(self, state: dict) -> list[tuple[str, torch.Tensor]]:
        """The optimizer state tensors (1+ dims, on the CPU) not yet in their files."""
        out = []
        for key, value in state.items():
            local = value._local_tensor if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor) or local.dim() == 0 or local.numel() == 0:
                continue
            if local.device.type != ("cpu" if self.policy.tier == "disk" else self.sp.mesh_device.type):
                continue  # the disk tier holds CPU tensors; the cpu tier holds the mesh device's tensors
            slot = self.state_slots.get(key)
            if slot is None or not slot.holds(local):
                out.append((key, local))
        return out

    def adopt(self, state: dict) -> None:
        local = self.shard_to_adopt()
        if local is not None:
            self.shard_slot = Slot(self.scratch, f"{self.label} stored shard", local, lane=SHARD_LANE)
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
            raise OffloadError(f"parameter '{name}' of {owner}: the disk tier is implemented for CPU meshes "
                               f"only (this mesh is on {device_type}); use OffloadPolicy('cpu', 'optimizer') "
                               "instead (its optimizer state in pinned host memory, copied in for the step) "
                               "or 'device'")
        if device_type != "cpu" and tier.tier == "cpu" and tier.state == "all":
            raise OffloadError(f"parameter '{name}' of {owner}: the cpu tier of the stored shard on a "
                               f"{device_type} mesh (host optimizer step) is not implemented yet; use "
                               "OffloadPolicy('cpu', 'optimizer') (optimizer state in pinned host memory) or "
                               "'device' for it")
        if tier.tier == "disk" and tier.path not in scratches:
            try:
                scratches[tier.path] = scratch_for(tier.path)
            except ScratchError as e:
                raise OffloadError(f"parameter '{name}' of {owner}: {e.strerror}; name a writable directory "
                                   "in OffloadPolicy('disk', path=...)") from None
    _check_space(entries, scratches, owner)
    return scratches


def _check_space(entries, scratches: dict[str, Scratch], owner: str) -> None:
    need: dict[str, int] = {}
    for _, policy, nbytes in entries:
        if policy.offload.tier == "disk" and policy.offload.state == "all":
            grad = nbytes if has_grad_file(policy) else 0
            need[policy.offload.path] = need.get(policy.offload.path, 0) + nbytes + grad
    for path, nbytes in need.items():
        free = shutil.disk_usage(scratches[path].dir).free
        if nbytes > free:
            raise OffloadError(f"{owner}: the disk tier needs {nbytes} bytes for stored shards and their "
                               f"gradients in {path} but {free} are free; free space or name another "
                               "directory")


def has_grad_file(policy) -> bool:
    """Whether a parameter of ``policy`` (a ``ResolvedPolicy``) keeps its gradient shard in the disk tier:
    ``state="all"``, trainable, and a sharded gradient (stage 1 keeps the whole gradient in memory)."""
    return (policy.offload.tier == "disk" and policy.offload.state == "all" and policy.requires_grad
            and not policy.whole_grad)


def attach(params: list, modules: list, owner: str, scratches: dict[str, Scratch]):
    """File the offloaded parameters of one group (``params``: its ``ShardedParam``s, every mesh's; each
    gets its ``ShardedParam.offload``) and install the hooks; the disk tier's stored shards move into their
    files now (``check`` made sure they fit). Returns the group's before-all-gather hook,
    ``hook(read_ahead)`` (``fully_shard`` sets it as ``ParamGroup.offload_hook``; every mesh part calls it
    before it packs shards, with ``RuntimeConfig.gather_read_ahead``), or ``None`` when no stored shard is
    offloaded. Raises ``OffloadError`` when a file cannot be made all the same."""
    offloaded = [sp for sp in params if sp.policy.offload.tier == "disk"
                 or (sp.policy.offload.tier == "cpu" and host.tier_moves(sp.mesh_device.type))]
    if not offloaded:
        return None
    _install()
    group = _Group()
    for sp in offloaded:
        po = ParamOffload(sp, owner, scratches.get(sp.policy.offload.path))
        sp.offload = po
        _OWNERS.add(sp)
        if po.shards:
            po.adopt({})
            local = sp.local_shard()
            if has_grad_file(sp.policy) and not local.is_meta and local.numel() > 0:
                po.grad_slot = GradSlot(scratches[sp.policy.offload.path], f"{po.label} gradient shard",
                                        local)
            for slot in po.slots():
                slot.evict(write=True)
            group.append(po)
    if group:
        _groups[group.key] = group
        for m in modules:
            m.register_forward_pre_hook(lambda *_, g=group: _before_forward(g), prepend=True)
            m.register_forward_hook(lambda *_, g=group: _after_forward(g), always_call=True)
        return lambda read_ahead, g=group: _before_gather(g, read_ahead)
    return None


def _read_ahead(po: ParamOffload) -> None:
    for slot in po.slots():
        slot.fetch()


def _before_forward(group: _Group) -> None:
    key = group.key
    if key not in _current:
        _current.append(key)
    for po in group:
        if po.shard_to_adopt() is not None:
            po.adopt({})
        if po.shard_slot is not None:
            po.shard_slot.fetch()
    if key in _order and _order.index(key) + 1 < len(_order):
        _fetch_shards(_groups.get(_order[_order.index(key) + 1], ()))
    for po in group:
        if po.shard_slot is not None:
            po.shard_slot.wait()


def _fetch_shards(group) -> None:
    for po in group:
        if po.shard_slot is not None:
            po.shard_slot.fetch()


def _before_gather(group: _Group, read_ahead: int) -> None:
    """Called by the group's all-gather before it packs the shards (forward, backward, prefetches): start
    the reads of the group's stored shards (when none is on its way) and of the next ``read_ahead``
    groups the all-gathers will reach (``RuntimeConfig.gather_read_ahead``; 0: none, the kernel reads the
    pages when the all-gather packs them): in backward the ones that ran before it in this iteration's
    forward, in forward the ones that ran after it in the last forward. Nothing waits here: a page the
    packing touches before its read is done is read by the kernel (waiting behind the one I/O thread's
    queue of write-backs was measured slower than that)."""
    if read_ahead <= 0:
        return
    key = group.key
    backward = torch._C._current_graph_task_id() != -1
    if backward and key in _current:
        i = _current.index(key)
        ahead = _current[max(0, i - read_ahead):i][::-1]
    else:
        order = _order if key in _order else _current
        i = order.index(key) if key in order else len(order)
        ahead = order[i + 1:i + 1 + read_ahead]
    _fetch_shards(group)
    for other in ahead:
        _fetch_shards(_groups.get(other, ()))


def _after_forward(group: _Group) -> None:
    for po in group:
        if po.shard_slot is not None:
            po.shard_slot.evict(write=False)


def _install() -> None:
    if not _hooks:
        # eager when compiled
        _hooks.append(register_optimizer_step_pre_hook(torch.compiler.disable(_pre_step)))
        _hooks.append(register_optimizer_step_post_hook(torch.compiler.disable(_post_step)))


def _offloads(optimizer) -> list[tuple[torch.Tensor, ParamOffload]]:
    by_id = {id(sp.sharded): sp.offload for sp in _OWNERS}
    return [(p, by_id[id(p)]) for group in optimizer.param_groups for p in group["params"] if id(p) in by_id]


def _pre_step(optimizer, args, kwargs) -> None:
    found = _offloads(optimizer)
    if optimizer not in _STATE_DICT_HOOKED and any(isinstance(slot, HostSlot) for _, po in found
                                                   for slot in po.state_slots.values()):
        # between steps host-offloaded state has no device storage: optimizer.state_dict() (a checkpoint, a
        # logged norm of it) would hand out tensors over freed memory; it brings the state in first
        _STATE_DICT_HOOKED.add(optimizer)
        optimizer.register_state_dict_pre_hook(bring_in)
    for p, po in found:
        state = optimizer.state.get(p, {})
        for key, slot in host.slots_of(po):
            slot.unpark(state, key)  # the device tensor back in the optimizer's state (HostSlot.park)
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
    host.evict_all([slot for _, po in found for _, slot in host.slots_of(po)])  # one host wait for all copies
    for p, po in found:
        for slot in po.slots():
            slot.evict(write=slot is not po.grad_slot)  # the step read the gradient and wrote nothing there
        state = optimizer.state.get(p, {})
        for key, slot in host.slots_of(po):
            slot.park(state, key)  # between steps the state entry is the host copy, not freed device memory


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
        for slot in sp.offload.files():
            tier = "cpu" if isinstance(slot, HostSlot) else "disk"
            out[tier] = out.get(tier, 0) + slot.nbytes
    return out


def flush() -> None:
    """Wait for every queued fetch and write-back of this process (e.g. before measuring memory)."""
    for sp in list(_OWNERS):
        for slot in sp.offload.files():
            slot.wait()
