"""The optimizer step and the held-out loss of ``perparam finetune --invariant-units U``, through
``perparam.InvariantUnits`` (``docs/invariant.md``): the same bits at every ``--nproc`` that divides ``U``.

One step takes the global rows of ``--batch-size B x --grad-accum N`` sequences (the same rows as the normal
mode), cut into ``U x N`` units of ``B / U`` rows (:func:`~perparam.finetune.invariant_flags.units`); rank
``r`` of ``K`` runs its contiguous ``U N / K`` units one forward and backward each, inside
``InvariantUnits.unit`` (sync off; the RNG keyed by the seed, the step and the unit). ``reduce()`` adds the
units' gradients in one binary tree, divided by ``U N`` once; ``--max-grad-norm`` clips by the invariant
global norm; the reported loss is the units' mean loss summed in the tree (:meth:`InvariantUnits.mean`).

The held-out rows (a multiple of ``U``, :func:`~perparam.finetune.data.prepare_data`) are cut into ``U``
pieces; rank ``r`` evaluates its ``U / K`` pieces, each in chunks of ``B / U`` rows (the forward of a
training unit), and the pieces' float64 sums of token losses are added in piece order after one
all-reduce in which each entry has one non-zero term (exact).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from perparam.finetune import invariant_flags
from perparam.finetune.errors import FinetuneInputError
from perparam.finetune.evaluation import parameters_kept_gathered
from perparam.finetune.model import next_token_loss
from perparam.finetune.steps import StepResult


def build(model: torch.nn.Module, units: int, grad_accum: int, seed: int):
    """``perparam.InvariantUnits`` over ``units x grad_accum`` units per optimizer step of the sharded
    ``model``; what it refuses (checked by the launcher where it can be known) becomes one
    :class:`FinetuneInputError` line."""
    from perparam import InvariantError, InvariantUnits

    try:
        return InvariantUnits(model, units=units * grad_accum, seed=seed)
    except InvariantError as exc:
        raise FinetuneInputError(f"--invariant-units {units}: {exc}") from None


def optimizer_step(model: torch.nn.Module, optimizer, scheduler, iu, inputs: torch.Tensor,
                   targets: torch.Tensor, step: int, device: torch.device,
                   max_grad_norm: float | None = None) -> StepResult:
    """One K-invariant optimizer step on the global rows ``inputs``/``targets`` ``[B N, seq]`` (every rank
    passes the same); ``iu`` from :func:`build`. ``StepResult.loss`` is the step's mean loss over all
    ranks (the same bits on every rank and at every K), ``grad_norm`` the invariant norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    xs, ys = invariant_flags.units(inputs, iu.units), invariant_flags.units(targets, iu.units)
    losses = []
    for u in iu.indices:
        with iu.unit(u, step):
            loss = next_token_loss(model(xs[u].to(device)), ys[u].to(device))  # the unit's mean: not / U
            loss.backward()
        losses.append(loss.detach())
    iu.reduce()
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = iu.clip_grad_norm_(max_grad_norm).item()
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return StepResult(iu.mean(losses), grad_norm, lr)


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: torch.Tensor, device: torch.device, chunk: int, pieces: int,
                 dp_rank: int, dp_size: int, group=None) -> float:
    """Mean next-token loss (nats/token) over every data-parallel rank's held-out ``rows`` ``[n, seq+1]``
    (this rank's: pieces ``dp_rank * pieces / dp_size ..`` of ``pieces`` equal pieces of the whole), the
    same bits at every ``dp_size`` dividing ``pieces``; a collective (the parameters gathered once, one
    all-reduce over ``group``, the ``dp_size`` data-parallel ranks: ``None`` is the world, right only when
    every rank is a data-parallel one; the world summed ranks beside the dp axis into the pieces)."""
    mine = pieces // dp_size
    if rows.shape[0] % mine:
        raise ValueError(f"{rows.shape[0]} held-out rows cannot be cut into {mine} equal pieces")
    per = rows.shape[0] // mine
    sums = torch.zeros(pieces + 1, dtype=torch.float64, device=device)  # [piece sums..., token count]
    was_training = model.training
    model.eval()
    try:
        with parameters_kept_gathered(model):
            for i in range(mine):
                piece = rows[i * per:(i + 1) * per]
                total = torch.zeros((), dtype=torch.float64, device=device)
                for start in range(0, per, chunk):  # the same chunks of the same piece at every K
                    part = piece[start:start + chunk].to(device)
                    total += next_token_loss(model(part[:, :-1]), part[:, 1:], reduction="sum").double()
                sums[dp_rank * mine + i] = total
                sums[pieces] += piece[:, 1:].numel()
    finally:
        model.train(was_training)
    if dist.get_world_size(group) != dp_size:
        raise ValueError(f"dp_size {dp_size} but the reduction group has {dist.get_world_size(group)} ranks: "
                         "pass the data-parallel process group")
    # each piece's entry: one rank's sum plus zeros (exact); the count: integers
    dist.all_reduce(sums, group=group)
    return (sum(sums[i] for i in range(pieces)) / sums[pieces]).item()  # in piece order
