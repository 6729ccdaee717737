"""Forwards without grad on the sharded model that cannot hang, whatever each rank evaluates
(``docs/evaluation.md``).

Every forward of a sharded module all-gathers its parameters: a collective. Ranks that run different
numbers of evaluation batches would leave one rank waiting in an all-gather its peers never issue, until
the process-group timeout (FSDP2 and ZeRO-3 behave the same). Within :func:`parameters_kept_gathered`
every group is all-gathered once, up front and in the same order on every rank, and kept until the block
ends: the forwards inside issue no all-gather, so each rank may run any number of them (none included).
The held-out loss and the samples of ``perparam finetune`` are computed this way.

Under tensor parallelism the forwards still run the tensor-parallel collectives inside each layer: the
ranks of one tensor-parallel group must run the same batches (in the main job they read the same rows).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from perparam.finetune.model import next_token_loss


def sharded_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``fully_shard`` was called on (each owns one parameter group), in ``modules()`` order."""
    from perparam import ShardedModule

    return [m for m in model.modules() if isinstance(m, ShardedModule)]


@contextmanager
def parameters_kept_gathered(model: torch.nn.Module):
    """All-gather every group of ``model`` now (a collective: every rank enters the block) and keep the
    parameters gathered through the forwards inside (``set_reshard_after_forward(False)``); on exit every
    group is resharded (storage freed, no communication) and ``reshard_after_forward`` is set back to
    ``fully_shard``'s default (the main job's: the root keeps its parameters from a training forward to its
    backward). Memory: the whole unsharded model on each rank meanwhile."""
    modules = sharded_modules(model)
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in modules:
            m.unshard()
        yield
    finally:
        for m in modules:
            m.set_reshard_after_forward(None, recurse=False)
            m.reshard()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: torch.Tensor, device: torch.device, micro_batch: int) -> float:
    """Mean next-token loss (nats/token) over this rank's ``rows`` ``[n, seq+1]`` and all other ranks'; a
    collective (every rank calls it, with any number of rows: the parameters are gathered once, then
    one all-reduce of ``[sum of token losses, token count]``)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of token losses, token count]
    try:
        with parameters_kept_gathered(model):
            for start in range(0, rows.shape[0], micro_batch):  # (split() of 0 rows gives one empty chunk)
                chunk = rows[start:start + micro_batch].to(device)
                logits = model(chunk[:, :-1])  # [micro, seq, vocab]
                total[0] += next_token_loss(logits, chunk[:, 1:], reduction="sum").double()
                total[1] += chunk[:, 1:].numel()
    finally:
        model.train(was_training)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def mean_over_ranks(x: torch.Tensor) -> float:
    """The mean of the scalar ``x`` over all ranks (one all-reduce in float64)."""
    x = x.detach().clone().double()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()
