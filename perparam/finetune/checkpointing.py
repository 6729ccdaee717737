"""``perparam finetune --save/--resume``: checkpoints of the main job through ``perparam.checkpoint``."""

from __future__ import annotations

from pathlib import Path

from perparam.finetune import lora


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
    """``--save DIR``: a checkpoint every ``--save-every`` steps and after the last one (keep 2)."""
    folder, every = getattr(args, "save", None), getattr(args, "save_every", 0)
    if not folder or not (step == args.steps or (every and step % every == 0)):
        return
    from perparam import checkpoint

    extra = {"step": step, "seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
             "config": args.config, "lr": args.lr, "grad_accum": getattr(args, "grad_accum", 1),
             **lora.checkpoint_extra(args)}
    if scheduler is not None:
        extra["lr_scheduler"] = scheduler.state_dict()  # JSON: a LambdaLR's lambdas are not in it
    path = checkpoint.save(Path(folder) / f"step-{step:06d}", model, optimizer, extra=extra, keep=2)
    if rank == 0:
        from perparam.finetune import lifecycle

        lifecycle.checkpoint_done(step, folder)  # the interruption line names it from now on
        print(f"checkpoint: step {step} in {path}", flush=True)
