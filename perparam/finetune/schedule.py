"""The learning-rate schedule of ``perparam finetune``: linear warmup, then cosine decay to ``--min-lr``.

The learning rate of optimizer step ``n`` (1-based, as the progress line prints it) of ``N`` (``--steps``),
with ``W`` = ``--warmup-steps``, peak ``lr`` (``--lr``) and floor ``min_lr`` (``--min-lr``, default ``lr``:
no decay)::

    n <= W:  lr * n / W
    n >  W:  min_lr + (lr - min_lr) * (1 + cos(pi * (n - W) / (N - W))) / 2

so step ``W`` is the first at the full ``lr`` and step ``N`` (the last) takes ``min_lr``. It is a
``torch.optim.lr_scheduler.LambdaLR`` stepped once after each optimizer step; its ``state_dict()`` (JSON) is
saved in the checkpoint's ``extra`` and loaded on ``--resume``.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from perparam.finetune.errors import FinetuneInputError


def lr_factor(step: int, *, steps: int, warmup_steps: int, min_ratio: float) -> float:
    """The multiplier of ``--lr`` for the optimizer step at 0-based index ``step`` (1-based ``step + 1``);
    ``min_ratio`` = ``min_lr / lr`` in [0, 1]."""
    n = step + 1
    if n <= warmup_steps:
        return n / warmup_steps
    progress = min(1.0, (n - warmup_steps) / max(1, steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, lr: float, steps: int, warmup_steps: int = 0, min_lr: float | None = None) -> float:
    """The learning rate of the optimizer step at 0-based index ``step`` (see the module docstring)."""
    min_ratio = 1.0 if min_lr is None else min_lr / lr
    return lr * lr_factor(step, steps=steps, warmup_steps=warmup_steps, min_ratio=min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, lr: float, steps: int, warmup_steps: int = 0,
                    min_lr: float | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` on ``optimizer`` (whose groups' ``lr`` is ``lr``) following :func:`lr_at`; sets the
    first step's learning rate at once."""
    min_ratio = 1.0 if min_lr is None else min_lr / lr
    factor = partial(lr_factor, steps=steps, warmup_steps=warmup_steps, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict | None, step: int, lr: float) -> None:
    """After ``--resume`` at ``step`` (optimizer steps done): load the saved ``state``
    (``scheduler.state_dict()``; a checkpoint saved without one is moved to ``step``), then set the
    optimizer's learning rate to the next step's under this run's flags (``lr`` = ``--lr``; a changed
    ``--steps`` moves the end of the cosine)."""
    if state is not None:
        scheduler.load_state_dict(state)
    scheduler.last_epoch = step
    scheduler.base_lrs = [lr for _ in scheduler.optimizer.param_groups]
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, group_lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["initial_lr"], group["lr"] = lr, group_lr
    scheduler._last_lr = lrs  # what get_last_lr() reports


def check_schedule(lr: float, steps: int, warmup_steps: int, min_lr: float | None) -> None:
    """One-line :class:`FinetuneInputError` for schedule flags that cannot work (before any worker starts)."""
    if warmup_steps < 0:
        raise FinetuneInputError(f"--warmup-steps {warmup_steps} must be 0 or more")
    if warmup_steps and warmup_steps >= steps:
        raise FinetuneInputError(f"--warmup-steps {warmup_steps} must be below --steps {steps}: pass at most "
                                 f"{max(0, steps - 1)} (or more --steps)")
    if min_lr is not None:
        if not (math.isfinite(min_lr) and min_lr >= 0):
            raise FinetuneInputError(f"--min-lr {min_lr} must be a finite number >= 0")
        if min_lr > lr:
            raise FinetuneInputError(f"--min-lr {min_lr} is above --lr {lr}: the cosine decays from --lr "
                                     f"down to --min-lr; pass a --min-lr of at most {lr}")
