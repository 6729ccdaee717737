"""The flags of ``perparam finetune``'s samples, training loop and plot: their definitions, the launcher's
one-line checks (before any worker starts, exit 2) and their hand-over to the workers.

- samples (:mod:`perparam.finetune.generate`): ``--generate PROMPT`` (repeatable), ``--max-new-tokens``,
  ``--temperature``, ``--top-k``, ``--sample-seed`` (``--seed`` is the data order's);
- training loop (:mod:`perparam.finetune.steps`, :mod:`perparam.finetune.schedule`): ``--grad-accum``,
  ``--max-grad-norm``, ``--warmup-steps``, ``--min-lr``, ``--eval-every``;
- ``--plot PATH.png`` (:mod:`perparam.finetune.plot`);
- ``--step-timeout SECONDS``: the bound of the step watchdog (:class:`perparam.elastic.StepWatchdog`).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from perparam.finetune.errors import FinetuneInputError

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--generate", action="append", default=None, metavar="PROMPT",
                        help="sample a continuation of PROMPT before and after fine-tuning (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=40,
                        help="tokens sampled per prompt (default 40)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=50,
                        help="sample among the K most likely tokens; 0 = all (default 50)")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches of --batch-size "
                        "sequences per optimizer step: a step sees N x --batch-size sequences (default 1)")
    parser.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm to "
                        "this (perparam.clip_grad_norm_) and log it per step (default: no clipping)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="linear learning-rate warmup over this many steps (default 0)")
    parser.add_argument("--min-lr", type=float, default=None, help="cosine decay of the learning rate from "
                        "--lr to this at the last step (default: --lr, no decay)")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="held-out loss every N steps during training (default 0: before and after only)")
    parser.add_argument("--step-timeout", type=float, default=None, metavar="SECONDS",
                        help="a rank whose step takes longer is stopped or hung: it is named and killed "
                        "(perparam.elastic.StepWatchdog; default: 8 x the median step, at least 10 s)")
    parser.add_argument("--plot", default=None, metavar="PATH.png", help="write a PNG of the training and "
                        "held-out loss and the learning rate (needs matplotlib: the plot extra)")


def check(cfg: JobConfig) -> None:
    """One-line :class:`FinetuneInputError` for any bad value of these flags."""
    from perparam.finetune.generate import check_sampling
    from perparam.finetune.plot import check_plot_path
    from perparam.finetune.schedule import check_schedule

    check_sampling(cfg.generate or [], sampling_config(cfg))
    if cfg.grad_accum < 1:
        raise FinetuneInputError(f"--grad-accum {cfg.grad_accum} must be at least 1 (1: no accumulation)")
    norm = cfg.max_grad_norm
    if norm is not None and not (math.isfinite(norm) and norm > 0):
        raise FinetuneInputError(f"--max-grad-norm {norm} must be a positive finite number (leave it out: "
                                 "no clipping)")
    check_schedule(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.min_lr)
    if cfg.eval_every < 0 or cfg.eval_every > max(cfg.steps, 1):
        raise FinetuneInputError(f"--eval-every {cfg.eval_every} must be between 1 and --steps {cfg.steps} "
                                 "(or 0: no evaluation during training)")
    if cfg.step_timeout is not None and not (math.isfinite(cfg.step_timeout) and cfg.step_timeout > 0):
        raise FinetuneInputError(f"--step-timeout {cfg.step_timeout} must be a positive number of seconds "
                                 "(leave it out: 8 x the median step time, at least 10 s)")
    check_plot_path(cfg.plot)  # its path is proven writable with the other outputs (cli.check_outputs)


def check_prompts(cfg: JobConfig, tokenizer, context: int) -> None:
    """Launcher, once the tokenizer is known: every prompt plus ``--max-new-tokens`` fits the context."""
    from perparam.finetune.generate import check_prompt_lengths

    check_prompt_lengths(cfg.generate or [], tokenizer, cfg.max_new_tokens, context)


def sampling_config(cfg: JobConfig):
    from perparam.finetune.generate import SamplingConfig

    return SamplingConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.sample_seed)


def worker_argv(cfg: JobConfig) -> list[str]:
    """These flags, as the launcher passes them on to each worker."""
    argv = [f"--generate={p}" for p in (cfg.generate or [])]
    argv += ["--max-new-tokens", str(cfg.max_new_tokens), "--temperature", repr(cfg.temperature),
             "--top-k", str(cfg.top_k), "--sample-seed", str(cfg.sample_seed),
             "--grad-accum", str(cfg.grad_accum), "--warmup-steps", str(cfg.warmup_steps),
             "--eval-every", str(cfg.eval_every)]
    if cfg.max_grad_norm is not None:
        argv += ["--max-grad-norm", repr(cfg.max_grad_norm)]
    if cfg.min_lr is not None:
        argv += ["--min-lr", repr(cfg.min_lr)]
    if cfg.plot:
        argv += ["--plot", cfg.plot]
    if cfg.step_timeout is not None:
        argv += ["--step-timeout", repr(cfg.step_timeout)]
    return argv
