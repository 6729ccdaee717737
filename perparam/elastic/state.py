"""``State``: commit a training loop's state to memory after a step, restore it at start (the shape of
Horovod Elastic's ``State.commit()`` / ``restore()``), for a loop under ``torchrun --max-restarts N``.

``commit()`` after each optimizer step (every ``every``-th is kept): this rank's shards of the parameters and
of every optimizer state tensor, the optimizers' options and non-tensor state, the step, the scheduler, the
RNG states and the user's own small state go into a slot in host shared memory (``slots.py``). The small
values are pickled in the commit; the tensors are copied into the slot, with the payload's checksum and the
header (written last), by a background thread (``copier.py``; on CUDA a side stream) while the next step's
forward and backward run: each optimizer's ``step`` waits for that copy first (a step pre-hook), since the
tensors change only there; the next commit, ``restore``, ``finish`` and ``close`` wait for it too. A process
killed before the header is written leaves the slot refused and the other one (the previous generation)
complete. When the job spans nodes (``replica="auto"``, or always with ``"always"``), a replica goes to a
rank on the next node (``replica.py``: its send starts once the copy is done, before the next optimizer step,
and runs beside it). ``restore()`` at start finds the newest generation that every shard has complete, own
or replica (``restore.py``), loads it onto the current mesh (any number of ranks, through
``perparam.checkpoint.load_from``) and returns the number of steps done: the step to continue from.

Between a commit and the next optimizer step, change the parameters and the optimizer state only through the
optimizers' ``step`` (or call ``finish()`` first): anything else could race the copy.

Memory per rank: two slots (double-buffered: one is always complete while the other is written) of its own
snapshot, plus two of the replica it holds when replicas are kept, i.e. ``2 x own`` on one node and
``2 x (own + replica)`` bytes across nodes, each ``own`` being its local
state's bytes plus a page of header and a small description (``bytes_mapped()``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import random
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from perparam import checkpoint
from perparam.full_state import per_rank_keys
from perparam.runtime.group import group_of

from .copier import InFlight, copier_for, plan
from .description import Description, Layout, local_of
from .errors import SnapshotError
from .reader import SnapshotReader
from .replica import REPLICA_MODES, ReplicaLink, replica_wanted
from .restore import find
from .slots import PAYLOAD_AT, Header, align
from .store import Store, clear, job_folder, node_folder, remove, scan

_live: weakref.WeakSet = weakref.WeakSet()
#: the attributes ``State`` sets on itself (a user value of one of these names is refused: it would hide it)
_OWN_NAMES = frozenset({"model", "optimizers", "scheduler", "every", "step", "rank", "world", "job_folder",
                        "folder", "store", "replica", "group", "link", "copier", "last_commit_s",
                        "last_wait_s", "restored", "wrote", "superseded", "closed"})


@atexit.register
def _finish_at_exit() -> None:  # no c10d work left in flight at interpreter exit
    for state in list(_live):
        # a process group already gone (a peer lost, destroy_process_group): nothing left to wait for
        with contextlib.suppress(Exception):
            state.finish()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _refuse_what_cannot_compose(model: torch.nn.Module, state: dict) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    for module in model.modules():  # each fully_shard call's ShardedParams (a parameter carries no policy)
        for sp in getattr(group_of(module), "params", ()):
            if getattr(sp.policy.offload, "tier", None) == "disk":
                owner, attr = sp.slots[0]
                name = ".".join(x for x in (names.get(id(owner), "?"), attr) if x)
                raise SnapshotError(
                    f"parameter '{name}' is offloaded to the disk tier: in-memory snapshots would copy it "
                    "back into memory every step; use OffloadPolicy('cpu') or no offload with "
                    "perparam.elastic, or save to disk with perparam.checkpoint")
    per_rank = sorted(per_rank_keys(state, model))  # a collective
    if per_rank:
        raise SnapshotError(f"'{per_rank[0]}' is a different tensor on each rank (experts on their own "
                            "ParamPolicy(mesh=...) mesh): in-memory snapshots cannot reshard it; shard the "
                            "experts on the data-parallel mesh, or save with perparam.checkpoint")
    _refuse_narrow_meshes(state)


def _refuse_narrow_meshes(state: dict) -> None:
    """A DTensor on a mesh of fewer ranks than the job's (pipeline stages: each stage's model sharded over its
    own ranks) on any rank: refused on every rank (a collective). A restore rebuilds every rank from one
    model's layout, which a stage's ranks do not share with another stage's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    narrow = next(((k, v.device_mesh.size()) for k, v in state.items()
                   if isinstance(v, DTensor) and v.device_mesh.size() < world), None)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, narrow)
    found = next(((r, n) for r, n in enumerate(everyone) if n is not None), None)
    if found is not None:
        rank, (key, size) = found
        raise SnapshotError(
            f"'{key}' on rank {rank} is sharded over {size} of the job's {world} ranks (pipeline stages, or "
            "another model on other ranks): in-memory snapshots restore one model sharded over every rank; "
            "snapshot the whole model, or save each stage to disk (perparam.checkpoint) and restart there")


class State:
    """A training loop's state, committed to memory and restored after a restart. Every rank builds it.

    ``model``: the sharded model; ``optimizers``: one optimizer or a sequence of them; ``scheduler``: an LR
    scheduler (``state_dict``/``load_state_dict``) or None; ``every``: keep every ``every``-th commit (steps
    recomputed after a failure: up to ``every - 1`` plus the one running); ``job``/``root``: where the slots
    live (``store.py``); ``replica``: ``"auto"`` (default: a replica on the next node's rank when the job
    spans more than one node, none on one node, where it would die with the own slot), ``"always"`` or
    ``"off"`` (``replica.py``); ``user_state``: small picklable values, read and set as attributes
    (``state.epoch = 3``), saved with each commit and put back by ``restore``. Raises ``SnapshotError`` for
    what cannot compose (the disk offload tier, experts on their own mesh, tensor parallelism's strided
    shards), on every rank, before anything is written.
    """

    def __init__(self, model: torch.nn.Module, optimizers, scheduler=None, *, every: int = 1,
                 job: str | None = None, root=None, replica: str = "auto", **user_state) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SnapshotError(f"State(every={every!r}): commit every 1 or more steps (an int)")
        taken = sorted(n for n in user_state if n.startswith("_") or n in _OWN_NAMES or hasattr(State, n))
        if taken:
            raise SnapshotError(f"State({taken[0]}=...): '{taken[0]}' is State's own (State.{taken[0]}); "
                                f"name the value otherwise, e.g. State(..., my_{taken[0].lstrip('_')}=...)")
        if replica not in REPLICA_MODES:
            raise SnapshotError(f"State(replica={replica!r}): pass 'auto' (a replica on the next node when "
                                "the job spans nodes), 'always' or 'off'")
        object.__setattr__(self, "_user", dict(user_state))
        self.model, self.optimizers, self.scheduler, self.every = model, optimizers, scheduler, every
        self.step = 0
        self.rank, self.world = _rank_world()
        self.job_folder = job_folder(job, root)
        self.folder = node_folder(self.job_folder)  # this node's own namespace (store.py)
        _refuse_unsharded(model, self.world)
        _refuse_missing_optimizers(model, _optimizer_list(optimizers))
        tensors, _ = checkpoint.capture(model, optimizers)
        _refuse_what_cannot_compose(model, tensors)
        self._layout = Layout()
        self._layout.entries(tensors)  # tensor parallelism's strided shards refused here
        self.store = Store(self.folder, self.rank)
        # a collective under "auto" without LOCAL_WORLD_SIZE
        self.replica = replica_wanted(replica, self.world)
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.link = ReplicaLink(self.store, self.rank, self.world, self.group) if self.replica else None
        self.copier = None  # made at the first snapshot, for the devices its tensors are on
        self._copy: InFlight | None = None
        self._blocks: tuple | None = None  # (entries, base, copier.plan's blocks), kept while they stay
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in _optimizer_list(optimizers)]
        self.last_commit_s = 0.0
        self.last_wait_s = 0.0  # what the last optimizer step waited for the copy
        self.restored = False  # restore() (or discard()) ran: a commit may write over what this job has
        self.wrote = False  # a snapshot was written: no other live State of this process writes this folder
        self.superseded = False  # a later State of this process restored from this folder: no more commits
        self.closed = False
        _live.add(self)

    # user state as attributes
    def __getattr__(self, name: str):
        user = object.__getattribute__(self, "_user")
        if name in user:
            return user[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._user:
            self._user[name] = value
        else:
            object.__setattr__(self, name, value)

    def commit(self) -> None:
        """After an optimizer step: count it, and snapshot every ``every``-th. Every rank calls it. Raises
        ``SnapshotError`` after ``close()``, and (on every rank) at the first commit of a job that holds
        snapshots from an earlier start when ``restore()`` was not called: the commit would overwrite the
        newest of them."""
        if self.closed:
            raise SnapshotError("State.commit() after close(): build a new State to snapshot again")
        if self.superseded:
            raise SnapshotError("State.commit() after a later State of this process restored this job's "
                                "snapshots: commit through that one (a restarted loop's State)")
        self.step += 1
        if self.step % self.every == 0:
            self.snapshot()

    def snapshot(self) -> None:
        """Snapshot now, as generation ``self.step``: the small values pickled into the own slot here; the
        tensors' copy, its checksum and the header in the background (``copier.py``); the replica's transfer
        announced."""
        twin = next((s for s in self._twins() if s.wrote and not s.superseded), None)
        if twin is not None:  # the same on every rank: each builds its States in the same order
            raise SnapshotError(f"another State of this process snapshots into {self.folder} (each would "
                                "overwrite the other's slots): give each model its own State(..., job='a "
                                "name'), or close() the other first")
        if not self.restored:
            self._refuse_overwriting_an_earlier_start()
        self.wrote = True
        start = time.perf_counter()
        tensors, manifest = checkpoint.capture(self.model, self.optimizers, {"step": self.step})
        entries, tensor_bytes = self._layout.entries(tensors)
        extra = pickle.dumps({"step": self.step, "user": self._user, "rng": _rng_state(),
                              "scheduler": [s.state_dict() for s in _scheduler_list(self.scheduler)]})
        raw = Description(self.rank, self.world, manifest, extra, entries).dumps()
        base = align(len(raw))
        payload_bytes = base + tensor_bytes
        sources = [local_of(v) for e, v in zip(entries, tensors.values()) if e.nbytes]
        if self._blocks is None or self._blocks[0] is not entries or self._blocks[1] != base:
            spans = [(base + e.at, e.nbytes) for e in entries if e.nbytes]
            self._blocks = (entries, base, plan(spans, payload_bytes))
        if self.copier is None:
            self.copier = copier_for(sources)
        self.finish()  # the previous commit's header and transfer: its slot is the one reused two commits on
        # and every rank's: a rank killed before its header leaves the others the slot
        if self.group is not None:
            # before it, which no rank may overwrite while its own is unfinished
            dist.barrier(group=self.group)
        slot = self.store.own(self.step % 2)
        slot.begin(payload_bytes)
        slot.map[PAYLOAD_AT:PAYLOAD_AT + len(raw)] = raw
        sizes = Header(self.step, payload_bytes, len(raw), (0, 0), self.rank, self.world)  # checksum to come
        self._copy = self.copier.start(slot, self._blocks[2], sources, sizes)
        if self.link is not None:
            self.link.send(sizes, slot, self._copy.result)
        self.last_commit_s = time.perf_counter() - start

    def _twins(self) -> list[State]:
        """The other live States of this process on this rank's slots."""
        return [s for s in _live if s is not self and s.folder == self.folder and s.rank == self.rank]

    def _refuse_overwriting_an_earlier_start(self) -> None:
        """At the first snapshot without ``restore()``: snapshots of an earlier start in this node's folder
        on any rank make every rank refuse (a collective; once)."""
        held = torch.tensor([max((h.generation for _, h in scan(self.folder)[0]), default=0)])
        if self.group is not None:
            dist.all_reduce(held, op=dist.ReduceOp.MAX, group=self.group)
        if held.item():
            raise SnapshotError(f"State.commit() before restore(): this job already holds snapshots (the "
                                f"newest of step {held.item()}, in {self.folder}) that this commit would "
                                "overwrite; call step = state.restore() before training (it returns the step "
                                "to continue from), or use another State(job=...) for a new run")
        self.restored = True

    def _before_step(self, *_) -> None:
        """Before an optimizer step changes the tensors: the copy in flight done (on CUDA: the compute stream
        waits for it), and the replica's send started from the copied slot."""
        self.last_wait_s = 0.0
        if self._copy is None:
            return
        start = time.perf_counter()
        self._copy.wait_copied()
        if self.link is not None:
            self._copy.result()  # the slot's bytes on the host: what the send reads
            self.link.post()
        self.last_wait_s = time.perf_counter() - start

    def restore(self) -> int:
        """Load the newest complete snapshot of this job onto the current mesh and return the number of steps
        it had done (0, changing nothing, when there is none). Every rank calls it, before training. Raises
        ``SnapshotError`` on every rank when snapshots exist but none is complete (a shard and its replica
        lost), naming the lost ranks; nothing is loaded then."""
        self.finish()
        self.restored = True
        for twin in self._twins():  # this one now writes the job's folder (a loop restarted in-process)
            twin.superseded = True
        collecting = gc.isenabled()
        gc.disable()  # its allocations (plans, read items, descriptions) start collections of the whole heap
        try:
            found = find(self.folder)
            if found is None:
                return 0
            gen, world, snapshots = found
            checkpoint.load_from(snapshots[0][0].manifest, SnapshotReader(snapshots), self.model,
                                 self.optimizers, source=f"the in-memory snapshot of step {gen}")
        finally:
            if collecting:
                gc.enable()
        mine = pickle.loads(snapshots[self.rank if self.rank < world else 0][0].extra)
        if mine["scheduler"] is not None:
            for scheduler, saved in zip(_scheduler_list(self.scheduler), mine["scheduler"]):
                scheduler.load_state_dict(saved)
        self._user.update(mine["user"])
        if world == self.world:  # another number of ranks: each rank's stream cannot be mapped to a new rank
            _set_rng_state(mine["rng"])
        self.step = gen
        return gen

    def bytes_mapped(self) -> int:
        """Bytes of shared memory this rank's slots take (own and held replica, both slots each)."""
        return self.store.bytes_mapped()

    def finish(self) -> None:
        """Wait for the last commit's copy, checksum and header and the replica transfer in flight (their
        slots become readable)."""
        if self._copy is not None:
            in_flight, self._copy = self._copy, None
            in_flight.result()
        if self.link is not None:
            self.link.finish()

    def close(self, remove_snapshots: bool = True) -> None:
        """At the end of training: wait for transfers, unmap the slots and (by default) delete this job's
        snapshots from this node's memory. Every rank calls it."""
        self.finish()
        for hook in self._hooks:
            hook.remove()
        if self.copier is not None:
            self.copier.close()
        self.store.close()
        if dist.is_initialized():
            dist.barrier(group=self.group)
        if remove_snapshots and self.rank == 0 or remove_snapshots and self.world > 1 and _first_on_node():
            remove(self.job_folder)  # every node folder of the job on this host, a killed agent's included
        self.closed = True
        _live.discard(self)

    def discard(self) -> None:
        """Drop every snapshot of this job on this node and start a new history at ``self.step`` (a
        collective: every rank calls it), after the loop's state came from elsewhere (a disk checkpoint,
        when ``restore()`` found no complete snapshot): the generations left on the surviving nodes
        belong to the abandoned history and must never complete one of the new. Raises nothing."""
        self.finish()
        self.store.close()
        if self.group is not None:
            dist.barrier(group=self.group)
        if self.rank == 0 or self.world > 1 and _first_on_node():
            clear(self.folder)
        if self.group is not None:
            dist.barrier(group=self.group)
        self.restored = True


def _scheduler_list(scheduler) -> list:
    if scheduler is None:
        return []
    return list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]


def _refuse_unsharded(model: torch.nn.Module, world: int) -> None:
    """A model with no parameter sharded by ``fully_shard`` on more than one rank: each rank trains its own
    copy, which a restore (one model, resharded) cannot give back."""
    params = list(model.parameters())
    if world > 1 and params and not any(isinstance(p, DTensor) for p in params):
        raise SnapshotError(f"{type(model).__name__} has no parameter sharded by perparam.fully_shard: on "
                            f"{world} ranks each holds its own copy, and a restore would give every rank one "
                            "rank's; fully_shard the model (each block, then the root) before State(...)")


def _refuse_missing_optimizers(model: torch.nn.Module, optimizers: list) -> None:
    """A trainable parameter that none of ``optimizers`` holds: the optimizer that steps it (a second one,
    Muon beside AdamW) would lose its state at a restore."""
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    missing = next((n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held), None)
    if missing is not None:
        raise SnapshotError(f"parameter '{missing}' requires grad but is in none of the optimizers given to "
                            "State: pass every optimizer that steps the model (State(model, [muon, adamw])), "
                            "or freeze it (requires_grad_(False)) if none does")


def _optimizer_list(optimizers) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _first_on_node() -> bool:
    return os.environ.get("LOCAL_RANK") == "0"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

