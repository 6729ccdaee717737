"""DDP for the rest of a model: ``torch.distributed._composable.replicate`` on the root of a model whose
blocks perparam shards replicates only the parameters perparam does not manage (perparam records
``fully_shard`` in torch's composable-API registry, as FSDP2 does, and ``replicate`` skips such modules)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.tensor import DTensor

import perparam
from tests.distributed import one_process, run_distributed
from tests.models import full_params, regression_batches, train_steps

STEPS, GLOBAL_BATCH = 3, 8


def train(rank: int, world_size: int) -> dict:
    """Linear(4, 6) and Linear(6, 3) (3 rows: uneven over 2 ranks) sharded by perparam, the head
    Linear(3, 2) replicated by ``replicate`` on the root; SGD. ``world_size == 0``: one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 2))
    if world_size:
        perparam.fully_shard(model[0])
        perparam.fully_shard(model[2])
        replicate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_steps(model, opt, regression_batches(STEPS, GLOBAL_BATCH, 4, 2), rank, world_size)
    out = {"params": full_params(model)}
    if world_size:
        out["head_plain"] = not isinstance(model[4].weight, DTensor)
        with pytest.raises(RuntimeError, match="already managed by `fully_shard`"):
            replicate(model[0])  # a module perparam shards: replicate refuses it, as for FSDP2's
    return out


def test_perparam_blocks_with_replicate_on_the_root_train_like_one_process():
    want = one_process(train)
    for got in run_distributed(train, 2):
        assert got["head_plain"]
        assert got["params"].keys() == want["params"].keys()
        for name, ref in want["params"].items():
            torch.testing.assert_close(got["params"][name], ref, atol=1e-5, rtol=1e-5, msg=name)
