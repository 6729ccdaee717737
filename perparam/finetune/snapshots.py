"""``perparam finetune --max-restarts N``: a worker that dies is restarted by torch's elastic agent, and the
new workers continue from the in-memory snapshot of the last completed step (``perparam.elastic``).

- ``--max-restarts N`` (launcher): the agent restarts the worker group up to N times (``LaunchConfig``'s
  ``max_restarts``); under plain ``torchrun --max-restarts N`` the same, read from the agent's
  ``TORCHELASTIC_MAX_RESTARTS``. Snapshots are taken whenever restarts are allowed.
- ``--snapshot-every N``: commit every N steps (default 1: no completed step is recomputed).
- ``--snapshot-replica auto|always|off``: where a replica of each rank's snapshot is kept
  (``State(replica=...)``; ``auto``: on the next node's rank when the job spans nodes, none on one node).

When no complete snapshot is left (a shard and its replica both lost: two nodes that held each other's
replicas, a corrupted own copy and a corrupted replica), the workers fall back to the newest complete
checkpoint in ``--save DIR``, saying so in one line (``restart 1: no complete in-memory snapshot: rank(s) [3]
of the newest (step 7, 4 ranks) have neither ...; continuing from the disk checkpoint of step 4 in DIR``),
and the snapshots left of the abandoned history are dropped (``State.discard``); with no ``--save``, or no
complete checkpoint in it, every rank stops with one line ending ``no disk checkpoint to continue from
(--save DIR keeps one): stopped`` (exit 2), and the agent's later attempts, if any, stop at once without
repeating it (a ``stopped`` file in the node's snapshot folder). Nothing is loaded in either case before the
choice is made: never a half-restored model.

What the loop reports is part of the snapshot (the losses, learning rates, gradient norms and held-out losses
so far, the held-out loss before training, the schedule), so a run that lost a rank reports the uninterrupted
run's numbers. The summary records ``restarts`` (the agent's restart count at the end),
``restored_at_step`` (the step each restart continued from) and ``restart_times``: per restart, its
``restart`` number, ``restored_at_step``, the wall-clock times (``time.time()``) the fault was ``detected``
(the earliest a worker of the failed group knew of it; None if none could note it), the new workers
``started``, the snapshot was restored (``ready``) and the ``first_step`` after it completed, and
``restore_s`` (``State.restore()`` alone) (:mod:`perparam.finetune.restart_times`; kept in the snapshot, so
every restart of the job is listed).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from perparam.elastic.store import STOPPED_FILE
from perparam.finetune import lifecycle, restart_times
from perparam.finetune.errors import FinetuneInputError

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart the workers up to N "
                        "times when one dies; they continue from in-memory snapshots of the last step "
                        "(default 0)")
    parser.add_argument("--snapshot-every", type=int, default=1, metavar="N",
                        help="with --max-restarts: snapshot every N steps (default 1)")
    parser.add_argument("--snapshot-replica", choices=("auto", "always", "off"), default="auto",
                        help="with --max-restarts: keep a replica of each rank's snapshot on another rank: "
                        "'auto' (default) when the job spans nodes (on one node it would die with the own "
                        "copy), 'always', or 'off'")


def check(cfg: JobConfig) -> None:
    """One-line :class:`FinetuneInputError` for bad values and what cannot compose with the snapshots."""
    if cfg.max_restarts < 0:
        raise FinetuneInputError(f"--max-restarts {cfg.max_restarts} must be 0 or more")
    if cfg.snapshot_every < 1:
        raise FinetuneInputError(f"--snapshot-every {cfg.snapshot_every} must be 1 or more")
    if cfg.max_restarts and cfg.tp > 1:
        raise FinetuneInputError(f"--max-restarts with --tp {cfg.tp}: in-memory snapshots do not hold "
                                 "tensor-parallel shards; run without --tp, or use --save/--resume")
    if cfg.max_restarts and any("disk" in spec for spec in cfg.offload or ()):
        raise FinetuneInputError("--max-restarts with --offload ...=disk: in-memory snapshots would bring "
                                 "the disk tier back into memory every step; offload to 'cpu', or use "
                                 "--save/--resume")


def worker_argv(cfg: JobConfig) -> list[str]:
    return ["--snapshot-every", str(cfg.snapshot_every), "--snapshot-replica", cfg.snapshot_replica]


def enabled() -> bool:
    """Whether the agent that started this worker may restart it."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class JobSnapshots:
    """The job's ``perparam.elastic.State``: the model, the optimizers and what the loop reports."""

    def __init__(self, cfg: JobConfig, model, optimizers) -> None:
        from perparam.elastic import State

        self.fell_back: list | None = None  # [step, --save DIR] of a fallback to the disk checkpoint
        self.state = State(model, optimizers, every=cfg.snapshot_every, replica=cfg.snapshot_replica,
                           losses=[], lrs=[], norms=[], evals=[], loss_before=None, schedule=None,
                           restored_at_step=[], restart_times=[])
        self.pending: dict | None = None  # this restart's record, until its first step is committed
        lifecycle.note_stops_in(self.state.folder)  # when this group stops: for the next restart's record

    def restore(self, cfg: JobConfig, model, optimizer, scheduler, rank: int, first_step: int) -> int:
        """The step the last snapshot completed (0 when there is none: steps then count from ``first_step``,
        ``--resume``'s); the schedule continues there. No complete snapshot left: the ``--save`` checkpoint's
        step (``self.fell_back``), or :class:`FinetuneInputError` (module docstring)."""
        from perparam.elastic import SnapshotError

        began = time.perf_counter()
        try:
            step = self.state.restore()
        except SnapshotError as exc:
            if not exc.lost:
                raise
            return self._fall_back(cfg, model, optimizer, scheduler, rank, exc.reason)
        restore_s = time.perf_counter() - began
        if not step:
            self.state.step = first_step
        else:
            scheduler.restore(self.state.schedule, step, cfg.lr)
            self.state.restored_at_step = [*self.state.restored_at_step, step]
            self.pending = {"restart": restarts(), "restored_at_step": step,
                            "detected": restart_times.detected(self.state.folder, restarts() - 1),
                            "restore_s": restore_s}
            if rank == 0:
                print(f"restart {restarts()}: continuing from the in-memory snapshot of step {step}",
                      flush=True)
        return step

    def _fall_back(self, cfg: JobConfig, model, optimizer, scheduler, rank: int, reason: str) -> int:
        from perparam import checkpoint
        from perparam.finetune.checkpointing import resume_from

        stopped = self.state.folder / STOPPED_FILE
        if stopped.exists():  # an earlier attempt of this agent said why already
            raise SystemExit(2)
        intact = cfg.save and any(problem is None for _, problem in checkpoint.survey(cfg.save))
        if not intact:
            line = (f"restart {restarts()}: {reason}; no disk checkpoint to continue from (--save DIR keeps "
                    "one): stopped")
            if rank == 0 or os.environ.get("LOCAL_RANK") == "0":
                stopped.write_text(line + "\n")
            raise FinetuneInputError(line)
        # rank -1: resume_from's own lines unsaid; this one says where from and why
        step = resume_from(replace(cfg, resume=cfg.save), model, optimizer, -1, scheduler)
        if rank == 0:
            print(f"restart {restarts()}: {reason}; continuing from the disk checkpoint of step {step} in "
                  f"{cfg.save}", flush=True)
        self.state.step = step
        self.state.discard()  # the generations of the abandoned history never complete one of the new
        self.fell_back = [step, str(cfg.save)]
        return step

    def commit(self, losses: list, lrs: list, norms: list, evals: list, loss_before: float, scheduler,
               clock: restart_times.StartClock | None = None) -> None:
        """After a step: what the loop reports, and (the first step after a restart) that restart's times."""
        s = self.state
        s.losses, s.lrs, s.norms, s.evals = list(losses), list(lrs), list(norms), [list(e) for e in evals]
        s.loss_before, s.schedule = loss_before, scheduler.state_dict()
        if self.pending is not None and clock is not None and clock.first_step_at is not None:
            s.restart_times = [*s.restart_times, {**self.pending, **clock.record()}]
            self.pending = None
        s.commit()

    def summary(self) -> dict:
        return {"restarts": restarts(), "restored_at_step": self.state.restored_at_step,
                "restored_from_checkpoint": self.fell_back, "restart_times": self.state.restart_times}

    def close(self) -> None:
        self.state.close()
