"""``perparam finetune --save/--resume``: checkpoints of the main job through ``perparam.checkpoint``."""

from __future__ import annotations

from pathlib import Path

from perparam.finetune import lora
from perparam.finetune.errors import FinetuneInputError


def resume_from(args, model, optimizer, rank: int, scheduler=None) -> int:
    """``--resume DIR``: load the newest complete checkpoint (any world size or mesh) and return its step;
    ``scheduler`` (the learning-rate ``LambdaLR``) continues at that step (:func:`schedule.restore`)."""
    if not getattr(args, "resume", None):
        return 0
    from perparam import checkpoint

    newest = checkpoint.latest(args.resume)
    extra = checkpoint.load(newest, model, optimizer)
    if scheduler is not None:
        from perparam.finetune.schedule import restore

        restore(scheduler, extra.get("lr_scheduler"), int(extra["step"]), args.lr)
    if rank == 0:
        from perparam.finetune import lifecycle

        lifecycle.checkpoint_done(int(extra["step"]), args.resume)  # named if interrupted before the next save
        print(f"resumed from {newest} at step {extra['step']}", flush=True)
    return int(extra["step"])


def save_if_due(args, model, optimizer, step: int, rank: int, scheduler=None) -> None:
    """``--save DIR``: a checkpoint every ``--save-every`` steps and after the last one (keep 2); a
    collective. Raises :class:`FinetuneInputError` (one line) when the file system refuses the write."""
    folder, every = getattr(args, "save", None), getattr(args, "save_every", 0)
    if not folder or not (step == args.steps or (every and step % every == 0)):
        return
    from perparam import checkpoint

    extra = {"step": step, "seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
             "config": args.config, "lr": args.lr, "grad_accum": getattr(args, "grad_accum", 1),
             **lora.checkpoint_extra(args)}
    if scheduler is not None:
        extra["lr_scheduler"] = scheduler.state_dict()  # JSON: a LambdaLR's lambdas are not in it
    try:
        path = checkpoint.save(Path(folder) / f"step-{step:06d}", model, optimizer, extra=extra, keep=2)
    except OSError as exc:
        raise FinetuneInputError(f"--save {folder}: the checkpoint of step {step} could not be written "
                                 f"({exc.strerror or exc}): free space or pass another folder") from None
    if rank == 0:
        from perparam.finetune import lifecycle

        lifecycle.checkpoint_done(step, folder)  # the interruption line names it from now on
        print(f"checkpoint: step {step} in {path}", flush=True)
