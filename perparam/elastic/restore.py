"""At start: the newest generation that every rank of the run that took it has complete somewhere (its own
slot, or a replica on another node), read back onto the current mesh.

Every rank lists the slot files it can see (whole headers only); the lists are gathered, so every rank
chooses alike: the newest ``(generation, world size)`` for which each of its ranks has a copy. Each chosen
copy is then checked against its checksum by one rank that sees it (the checks spread over the ranks); a
copy that fails is dropped and the choice made again, so a torn or corrupted slot is never loaded. A
snapshot that no rank of a node sees (its node is gone, its replica lives elsewhere) is broadcast from a rank
that holds it. ``perparam.checkpoint.load_from`` then reslices the snapshots onto the current mesh through
``reader.SnapshotReader``: any number of ranks.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .description import Description, loads
from .errors import SnapshotError
from .slots import Header, Slot, align
from .store import scan


@dataclass(frozen=True)
class Copy:
    host: str
    path: str
    header: Header

    @property
    def key(self) -> tuple[str, str]:
        return self.host, self.path


def _gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _choose(seen, refused: set) -> tuple[int, int, dict[int, list[tuple[int, Copy]]]] | None:
    """``(generation, world size, origin -> [(rank that sees it, copy)])`` of the newest complete
    generation."""
    by_gen: dict[tuple[int, int], dict[int, list[tuple[int, Copy]]]] = {}
    for rank, copies in enumerate(seen):
        for c in copies:
            if c.key not in refused:
                by_gen.setdefault((c.header.generation, c.header.world_size), {}).setdefault(
                    c.header.origin, []).append((rank, c))
    complete = [(g, w) for (g, w), origins in by_gen.items() if set(origins) == set(range(w))]
    if not complete:
        return None
    gen, world = max(complete)
    return gen, world, by_gen[(gen, world)]


def _missing(seen, folder: Path, refused: set) -> SnapshotError:
    """The error naming the ranks of the newest generation with no copy left that passed its checksum
    (``refused``: the keys of the copies that failed it)."""
    newest = max((c.header.generation, c.header.world_size) for copies in seen for c in copies)
    have = {c.header.origin for copies in seen for c in copies
            if (c.header.generation, c.header.world_size) == newest and c.key not in refused}
    lost = sorted(set(range(newest[1])) - have)
    reason = (f"no complete in-memory snapshot: rank(s) {lost} of the newest (step {newest[0]}, {newest[1]} "
              "ranks) have neither their own copy nor a replica that passes its checksum")
    return SnapshotError(f"{reason} (in {folder} on the surviving nodes); resume from your last disk "
                         "checkpoint, or remove that folder to start afresh", reason, lost=True)


def find(folder: Path) -> tuple[int, int, list[tuple[Description, torch.Tensor]]] | None:
    """``(generation, world size that took it, [(description, payload)] by origin rank)`` of the newest
    complete generation, or None when no snapshot of this job exists. A collective. Raises
    ``SnapshotError`` (on every rank alike) when snapshots exist but none is complete."""
    host = socket.gethostname()
    found, damaged = scan(folder)
    mine = [Copy(host, str(p), h) for p, h in found]
    seen, damaged_everywhere = zip(*_gather((mine, damaged)))
    if not any(seen):
        names = sorted({n for d in damaged_everywhere for n in d})
        if names:  # not a job that never committed: every slot's header is damaged
            reason = (f"no in-memory snapshot can be read: the headers of {', '.join(names[:4])} in {folder} "
                      "are damaged")
            raise SnapshotError(f"{reason}; resume from your last disk checkpoint, or remove that folder to "
                                "start afresh", reason, lost=True)
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    refused: set = set()
    while True:
        chosen = _choose(seen, refused)
        if chosen is None:
            raise _missing(seen, folder, refused)
        gen, world, origins = chosen
        # one copy per origin, preferring the origin's own slot; checked by the origin's rank where it sees it
        # (the checks spread over the ranks: on one host every rank sees every slot), else the first that does
        picks = {o: sorted(copies, key=lambda rc: ("-own-" not in rc[1].path, rc[0] != o, rc[0]))[0]
                 for o, copies in origins.items()}
        verdicts = {}
        for o, (checker, c) in picks.items():
            if checker == rank:
                slot = Slot(Path(c.path), c.header)
                verdicts[o] = slot.verify()
                slot.close()
        failed = {picks[o][1].key for v in _gather(verdicts) for o, ok in v.items() if not ok}
        if not failed:
            break
        refused |= failed
    return gen, world, _read(picks, {c.key for c in mine}, rank)


def _read(picks: dict[int, tuple[int, Copy]], visible: set, rank: int):
    """Each origin's description and payload: mapped where this rank sees the chosen copy, else broadcast."""
    sees = _gather(sorted(o for o, (_, c) in picks.items() if c.key in visible))
    out = []
    for o in sorted(picks):
        holder, c = picks[o]
        if all(o in s for s in sees):
            payload = Slot(Path(c.path), c.header).payload()
        else:
            payload = (Slot(Path(c.path), c.header).payload().clone() if rank == holder
                       else torch.empty(c.header.payload_bytes, dtype=torch.uint8))
            dist.broadcast(payload, src=holder)
        description = loads(payload[:c.header.description_bytes].numpy().tobytes())
        description.tensors_at = align(c.header.description_bytes)
        out.append((description, payload))
    return out
