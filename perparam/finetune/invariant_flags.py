"""``perparam finetune --invariant-units U``: the same bits on any number of ranks.

The global batch of every micro-batch (``--batch-size B`` rows) is cut into ``U`` units of ``B / U``
contiguous rows, the same units whatever ``--nproc`` (:func:`units`); rank ``r`` of ``K`` takes the
contiguous units ``[r*U/K, (r+1)*U/K)`` (:func:`rank_units`), one backward each. The data position is the
step (the stream is a function of the seed and the step alone, :class:`~perparam.finetune.data.BatchStream`),
so a checkpoint saved at one ``--nproc`` resumes at another at the same rows. Every worker computes with
:data:`THREADS` intra-op thread(s) whatever ``K`` (the order of a matmul's partial sums follows the thread
count).

The rule, checked by the launcher before any worker starts (one line each): ``U`` a power of two, ``K``
(``--nproc``, the data-parallel ranks) dividing ``U``, ``U`` dividing ``--batch-size``, ``--grad-accum`` a
power of two (a step's ``U x N`` units form one tree); tensor parallelism (``--tp`` above 1: a layer's matmul
summed across ranks), quantized gradient reduction (``--grad-quant``: blocks scaled per rank's shard) and a
quantized all-gather (``--quant``: blocks over each rank's flattened shard) refused, each named. The job's
step and held-out loss under the flag: :mod:`~perparam.finetune.invariant_steps`.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import TYPE_CHECKING

import torch

from perparam.finetune.errors import FinetuneInputError

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig

#: intra-op threads of every worker under ``--invariant-units``, whatever ``--nproc``
THREADS = 1
#: perparam's K-invariant mode (fixed binary tree over units, unit-keyed RNG, fixed-order norms and means)
MODE_MODULE = "perparam.invariant"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--invariant-units", type=int, default=None, metavar="U",
                        help="cut each global batch into U units (a power of two that --nproc divides) so "
                        "that any --nproc gives the same losses, checkpoints and export bit for bit "
                        "(docs/finetune.md, docs/invariant.md)")


def check(cfg: JobConfig, world: int) -> None:
    """One-line :class:`FinetuneInputError` for a ``--invariant-units`` that cannot work on ``world``
    ranks, or a flag the mode cannot compose with. No-op without the flag."""
    u = cfg.invariant_units
    if u is None:
        return
    if u < 1 or u & (u - 1):
        raise FinetuneInputError(f"--invariant-units {u} must be a power of two (1, 2, 4, 8, ...): the units "
                                 "are summed in one fixed binary tree")
    if u % world:
        raise FinetuneInputError(f"--invariant-units {u} is not divisible by --nproc {world}: each rank "
                                 f"takes U / nproc whole units; pass an --nproc that divides {u} (a power of "
                                 f"two up to {u})")
    if cfg.batch_size % u:
        raise FinetuneInputError(f"--batch-size {cfg.batch_size} cannot be cut into --invariant-units {u} "
                                 f"equal units: pass a multiple of {u}")
    if cfg.tp > 1:
        raise FinetuneInputError(f"--invariant-units with --tp {cfg.tp}: tensor parallelism sums each "
                                 "layer's matmul across ranks, in an order that depends on the rank count; "
                                 "pass --tp 1")
    if cfg.grad_quant:
        raise FinetuneInputError(f"--invariant-units with --grad-quant {cfg.grad_quant}: quantized gradient "
                                 "reduction scales blocks of each rank's shard, which moves with the rank "
                                 "count; drop --grad-quant")
    if cfg.grad_accum & (cfg.grad_accum - 1):
        raise FinetuneInputError(f"--invariant-units with --grad-accum {cfg.grad_accum}: a step's U x "
                                 "grad-accum units are summed in one binary tree; pass a power of two (1, 2, "
                                 "4, ...)")
    if cfg.quant != "none":
        raise FinetuneInputError(f"--invariant-units with --quant {cfg.quant}: a quantized all-gather's "
                                 "blocks run over each rank's flattened shard, so the gathered weights move "
                                 "with the rank count; drop --quant (--qlora's NF4-stored base gathers "
                                 "exactly and is accepted)")
    if importlib.util.find_spec(MODE_MODULE) is None:
        raise FinetuneInputError(f"--invariant-units {u}: this perparam has no K-invariant mode "
                                 f"({MODE_MODULE}, docs/invariant.md) to run the units with; drop "
                                 "--invariant-units")


def check_device(cfg: JobConfig, world: int, cuda: bool) -> None:
    """One-line :class:`FinetuneInputError` for ``--invariant-units`` on CUDA with more than one rank: the
    same bits at every ``--nproc`` are measured on CPU hosts (gloo) only; on CUDA they would also need
    ``torch.use_deterministic_algorithms`` (atomic-add backward kernels) and have never run (the library's
    sums travel on the mesh's device, so the collectives themselves are not the obstacle)."""
    if cfg.invariant_units is not None and cuda and world > 1:
        raise FinetuneInputError(f"--invariant-units on CUDA with --nproc {world}: the same bits at every "
                                 "--nproc are measured on CPU hosts only (CUDA kernels need deterministic "
                                 "algorithms, not yet run); run on CPU (CUDA_VISIBLE_DEVICES=) or with "
                                 "--nproc 1")


def worker_argv(cfg: JobConfig) -> list[str]:
    return [] if cfg.invariant_units is None else ["--invariant-units", str(cfg.invariant_units)]


def fix_threads() -> None:
    """Every worker of an invariant run: :data:`THREADS` intra-op threads (CPU and CUDA hosts alike)."""
    torch.set_num_threads(THREADS)


def units(rows: torch.Tensor, n_units: int) -> list[torch.Tensor]:
    """``rows`` ``[B, ...]`` (one global micro-batch) cut into ``n_units`` units of ``B / n_units``
    contiguous rows each, in order: unit ``i`` is rows ``[i*B/U, (i+1)*B/U)``, whatever the rank count.
    Raises ``ValueError`` when ``B`` is not a multiple of ``n_units``."""
    if rows.shape[0] % n_units:
        raise ValueError(f"{rows.shape[0]} rows cannot be cut into {n_units} equal units")
    return list(rows.chunk(n_units))


def rank_units(n_units: int, rank: int, world: int) -> range:
    """The unit indices data-parallel rank ``rank`` of ``world`` computes: ``[rank*U/K, (rank+1)*U/K)``."""
    if n_units % world:
        raise ValueError(f"{n_units} units cannot be split evenly over {world} ranks")
    per = n_units // world
    return range(rank * per, (rank + 1) * per)
