"""``perparam finetune --save/--resume``: checkpoints of the main job through ``perparam.checkpoint``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from perparam.finetune import lifecycle, lora
from perparam.finetune.errors import FinetuneInputError

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig


def resume_from(cfg: JobConfig, model, optimizer, rank: int, scheduler=None) -> int:
    """``--resume DIR``: load the newest complete checkpoint (any world size or mesh) and return its step;
    ``scheduler`` (the learning-rate ``LambdaLR``) continues at that step (:func:`schedule.restore`)."""
    if not cfg.resume:
        return 0
    from perparam import checkpoint

    newest = checkpoint.latest(cfg.resume)
    extra = checkpoint.load(newest, model, optimizer)
    if scheduler is not None:
        from perparam.finetune.schedule import restore

        restore(scheduler, extra.get("lr_scheduler"), int(extra["step"]), cfg.lr)
    lifecycle.checkpoint_done(int(extra["step"]), cfg.resume)  # named if stopped before the next save
    if rank == 0:
        print(f"resumed from {newest} at step {extra['step']}", flush=True)
    return int(extra["step"])


def save_if_due(cfg: JobConfig, model, optimizer, step: int, rank: int, scheduler=None) -> None:
    """``--save DIR``: a checkpoint every ``--save-every`` steps and after the last one (keep 2); a
    collective. Raises :class:`FinetuneInputError` (one line) when the file system refuses the write."""
    if not cfg.save or not (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
        return
    from perparam import checkpoint

    extra = {"step": step, "seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
             "config": cfg.config, "lr": cfg.lr, "grad_accum": cfg.grad_accum,
             "lora": lora.record(cfg.lora_config())}
    if scheduler is not None:
        extra["lr_scheduler"] = scheduler.state_dict()  # JSON: a LambdaLR's lambdas are not in it
    try:
        path = checkpoint.save(Path(cfg.save) / f"step-{step:06d}", model, optimizer, extra=extra, keep=2)
    except OSError as exc:
        raise FinetuneInputError(f"--save {cfg.save}: the checkpoint of step {step} could not be written "
                                 f"({exc.strerror or exc}): free space or pass another folder") from None
    lifecycle.checkpoint_done(step, cfg.save)  # the interruption / lost-peer line names it from now on
    if rank == 0:
        print(f"checkpoint: step {step} in {path}", flush=True)
