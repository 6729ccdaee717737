"""One optimizer step of ``perparam finetune``: gradient accumulation, clipping, the learning-rate schedule.

``--batch-size B`` is the global batch of one forward/backward (a micro-batch, split over the data-parallel
ranks); ``--grad-accum N`` runs ``N`` of them per optimizer step, so one step sees ``B x N`` sequences: global
rows ``s*B*N .. (s+1)*B*N - 1`` of the data stream, micro-batch ``i`` the ``i``-th ``B`` of them (each cut
over the data-parallel ranks as usual). Each micro-batch's mean loss is scaled by ``1/N``, so the
accumulated gradient is that of the mean over the step's ``B x N`` sequences: ``--batch-size 4 --grad-accum
2`` takes the same step as ``--batch-size 8`` (up to fp32 rounding). Gradients are reduce-scattered once per
step: ``set_requires_gradient_sync(False)`` for the first ``N - 1`` micro-batches (unsharded gradients
accumulate locally) and ``True`` for the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perparam.finetune.data import BatchStream, rank_slice
from perparam.finetune.model import next_token_loss


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # 0-dim: this rank's mean loss over the step's micro-batches (nats/token)
    grad_norm: float | None  # the global gradient norm before clipping (``--max-grad-norm`` only)
    lr: float  # the learning rate this step used


def step_stream(rows: torch.Tensor, batch_size: int, grad_accum: int, seed: int) -> BatchStream:
    """The data stream of the optimizer steps: ``batch_size x grad_accum`` rows per step."""
    return BatchStream(rows, batch_size * grad_accum, seed)


def micro_batches(stream: BatchStream, step: int, grad_accum: int, dp_rank: int, dp_size: int):
    """The ``grad_accum`` ``(inputs, targets)`` of this data-parallel rank for optimizer step ``step``, each
    ``[batch_size / dp_size, seq]``."""
    inputs, targets = stream.global_batch(step)  # [batch_size * grad_accum, seq] each
    for x, y in zip(inputs.chunk(grad_accum), targets.chunk(grad_accum), strict=True):
        yield rank_slice(x, dp_rank, dp_size), rank_slice(y, dp_rank, dp_size)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, batches,
                   device: torch.device, grad_accum: int = 1,
                   max_grad_norm: float | None = None) -> StepResult:
    """Zero the gradients, forward/backward each micro-batch of ``batches`` (``grad_accum`` of them), clip
    to ``max_grad_norm`` (``perparam.clip_grad_norm_``, across meshes), step the optimizer, then the
    ``scheduler`` (``None``: no schedule)."""
    from perparam import clip_grad_norm_

    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for i, (inputs, targets) in enumerate(batches):
        last = i == grad_accum - 1
        if grad_accum > 1:
            model.set_requires_gradient_sync(last)
        loss = next_token_loss(model(inputs.to(device)), targets.to(device))
        if grad_accum > 1:
            loss = loss / grad_accum
        loss.backward()
        total += loss.detach()
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = clip_grad_norm_(model.parameters(), max_grad_norm).item()
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return StepResult(total, grad_norm, lr)
