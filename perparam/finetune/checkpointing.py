"""``perparam finetune --save/--resume``: checkpoints of the main job through ``perparam.checkpoint``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from perparam.finetune import lifecycle, lora
from perparam.finetune.errors import FinetuneInputError

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig


def resume_from(cfg: JobConfig, model, optimizer, rank: int, scheduler=None) -> int:
    """``--resume DIR``: load the newest intact checkpoint (any world size or mesh) and return its step;
    ``optimizer``: the job's ``optimizers.JobOptimizers`` (each one's state is restored) or one torch
    optimizer; ``scheduler`` (its ``JobSchedule``) continues at that step (:func:`schedule.restore`).
    Newer checkpoints that are damaged (a manifest that cannot be read, a file missing, cut short or changed
    since the save: ``perparam.checkpoint.survey`` and the checksums ``load`` verifies, on every rank alike)
    are skipped, and rank 0 says which and why in one line; none intact: :class:`FinetuneInputError`."""
    if not cfg.resume:
        return 0
    from perparam import checkpoint

    finish_saves(cfg, rank)  # a checkpoint of this process still being written may be the newest

    skipped, extra, chosen = [], None, None
    for path, problem in checkpoint.survey(cfg.resume):
        if problem is None:
            try:
                extra, chosen = checkpoint.load(path, model, _saved(optimizer)), path
                break
            except checkpoint.CheckpointDamagedError as exc:  # raised on every rank: nothing was loaded
                problem = f"{exc.file} {exc.what}"
        skipped.append(f"{path.name} ({problem})")
    if rank == 0 and skipped:
        print(f"--resume {cfg.resume}: skipped {'; '.join(skipped)}; "
              + (f"resuming from {chosen.name}" if chosen else "no intact checkpoint left"), flush=True)
    if chosen is None:
        raise FinetuneInputError(f"--resume {cfg.resume}: no intact checkpoint in it (skipped: "
                                 f"{'; '.join(skipped)}); pass the --save folder of an earlier run")
    if scheduler is not None:
        scheduler.restore(extra.get("lr_scheduler"), int(extra["step"]), cfg.lr)
    lifecycle.checkpoint_done(int(extra["step"]), cfg.resume)  # named if stopped before the next save
    if rank == 0:
        print(f"resumed from {chosen} at step {extra['step']}", flush=True)
    return int(extra["step"])


def save_if_due(cfg: JobConfig, model, optimizer, step: int, rank: int, scheduler=None) -> None:
    """``--save DIR``: a checkpoint every ``--save-every`` steps and after the last one (keep 2); a
    collective. Written in the background (``perparam.checkpoint.async_save``: the state is copied to CPU,
    training goes on while the files are written); the previous one is waited for first. Called after
    every step: a checkpoint found complete is announced then. Raises :class:`FinetuneInputError` (one
    line) when the file system refuses the write."""
    _announce_finished(cfg, rank, wait=False)
    if not cfg.save or not (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
        return
    from perparam import checkpoint

    _announce_finished(cfg, rank, wait=True)  # async_save would wait too, but a failure reads better here
    extra = {"step": step, "seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
             "config": cfg.config, "lr": cfg.lr, "grad_accum": cfg.grad_accum,
             "lora": lora.record(cfg.lora_config()), "optimizer": cfg.optimizer,
             "invariant_units": cfg.invariant_units}  # recorded, not checked: --resume may change it
    if scheduler is not None:
        extra["lr_scheduler"] = scheduler.state_dict()  # JSON: a LambdaLR's lambdas are not in it
    try:
        pending = checkpoint.async_save(Path(cfg.save) / f"step-{step:06d}", model, _saved(optimizer),
                                        extra=extra, keep=2)
    except OSError as exc:
        raise _unwritable(cfg, step, exc.strerror or str(exc)) from None
    except checkpoint.CheckpointError as exc:  # refused on every rank before anything was written
        raise FinetuneInputError(f"--save {cfg.save}: {exc}") from None
    _in_flight.append((pending, step))


def finish_saves(cfg: JobConfig, rank: int) -> None:
    """Wait for the checkpoint still being written (every rank, before the process group goes) and announce
    it; raises :class:`FinetuneInputError` if its write failed."""
    _announce_finished(cfg, rank, wait=True)


_in_flight: list = []  # (perparam.checkpoint.PendingSave, step) of this process, oldest first


def _announce_finished(cfg: JobConfig, rank: int, wait: bool) -> None:
    from perparam.checkpoint import CheckpointError

    while _in_flight and (wait or _in_flight[0][0].done()):
        pending, step = _in_flight.pop(0)
        try:
            path = pending.wait()
        except CheckpointError as exc:
            from perparam.finetune.peers import PEER_LOST

            why = str(exc)
            if any(s in why for s in PEER_LOST):  # a peer died during the background write: not the disk;
                inner = why.split("RuntimeError: ", 1)[-1]  # the job's lost-peer line names who is gone
                raise RuntimeError(inner) from None
            raise _unwritable(cfg, step, why) from None
        lifecycle.checkpoint_done(step, cfg.save)  # the interruption / lost-peer line names it from now on
        if rank == 0:
            print(f"checkpoint: step {step} in {path}", flush=True)


def optimizers_saved(optimizer):
    """What ``perparam.checkpoint`` (and ``perparam.elastic.State``) take for the job's optimizers."""
    return _saved(optimizer)


def _saved(optimizer):
    """What ``perparam.checkpoint`` takes: a ``JobOptimizers``' ``saved`` (one optimizer, or Muon and AdamW
    as a list), or a torch optimizer as it is."""
    return getattr(optimizer, "saved", optimizer)


def _unwritable(cfg: JobConfig, step: int, why: str) -> FinetuneInputError:
    return FinetuneInputError(f"--save {cfg.save}: the checkpoint of step {step} could not be written "
                              f"({why}): free space or pass another folder")
