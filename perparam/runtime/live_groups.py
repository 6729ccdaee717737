"""The one registry of the groups ``fully_shard`` made in this process (``GROUPS``), weak on each group, so a
group dies with its modules; what is looked up through them (which group and ``ShardedParam`` a parameter
object is) and what the registration hooks keep per group.

One object for the process, because what reads it is process-wide: ``fully_shard``'s check that a parameter
is not sharded twice (``api_checks``) and torch's global parameter/module registration hooks
(``registration``), which see every module of the process. Ranks run as threads of one process (torch's
threaded process group) add their groups at once: the set is guarded by a lock.
"""

from __future__ import annotations

import threading
import weakref


class LiveGroups:
    """The live groups (a weak set), a lock over it, and an id table of their parameter objects rebuilt only
    after ``bump``; ``watched``: group -> (ids of its ``ignored_params``, ``fully_shard``'s set-up of a place)
    for the registration hooks (weak on the group); ``hooks``: those hooks' handles once installed."""

    def __init__(self) -> None:
        self._groups: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._generation = 0
        self._table: tuple[int, dict, dict] = (-1, {}, {})  # (generation, ids, meshes) when built
        self.watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.hooks: list = []

    def add(self, group) -> None:
        """Record ``group`` (a ``ParamGroup``; idempotent) and mark the id table stale."""
        with self._lock:
            self._groups.add(group)
        self.bump()

    def snapshot(self) -> list:
        """The live groups now (a list: another thread may add one meanwhile)."""
        with self._lock:
            return list(self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def bump(self) -> None:
        """Perparam created or moved parameter objects (a group, ``ShardedParam._ensure_buffers``, a move)."""
        self._generation += 1

    def generation(self) -> int:
        """How many times ``bump`` ran: a cache of anything derived from parameter objects or names
        (``MeshPart._what``) is current while this is unchanged."""
        return self._generation

    def _ids(self) -> tuple[dict, dict]:
        """id -> weak (group, ShardedParam) of every sharded and unsharded parameter object of the live
        groups, and id -> weak mesh of their meshes; rebuilt only after ``bump()``."""
        generation = self._generation  # read first: a bump while the table is built (another rank's thread)
        built, ids, meshes = self._table  # leaves it marked stale, never a stale table marked current
        if built != generation:
            ids, meshes = {}, {}
            for g in self.snapshot():
                for sp in g.params:
                    entry = (weakref.ref(g), weakref.ref(sp))
                    ids[id(sp.sharded)] = entry
                    if sp.unsharded is not None:
                        ids[id(sp.unsharded)] = entry
                    meshes.update({id(m): weakref.ref(m) for m in (sp.mesh, sp.dp_mesh)})
            self._table = (generation, ids, meshes)
        return ids, meshes

    def lookup(self, tensor) -> tuple | None:
        """``(group, ShardedParam)`` when ``tensor`` is a sharded or unsharded parameter object of a live
        group, else ``None``."""
        entry = self._ids()[0].get(id(tensor))
        group, sp = (entry[0](), entry[1]()) if entry is not None else (None, None)
        if group is None or sp is None or not (tensor is sp.sharded or tensor is sp.unsharded):
            return None
        return group, sp

    def sharded_param(self, tensor):
        """The ``ShardedParam`` whose sharded parameter ``tensor`` is, else ``None``."""
        hit = self.lookup(tensor)
        return hit[1] if hit is not None and hit[1].sharded is tensor else None

    def holds_mesh(self, mesh) -> bool:
        """``mesh`` is the mesh (or data-parallel mesh) of a parameter of a live group."""
        ref = self._ids()[1].get(id(mesh))
        return ref is not None and ref() is mesh


#: the process's one registry of groups
GROUPS = LiveGroups()
