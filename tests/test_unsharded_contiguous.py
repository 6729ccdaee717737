"""The unsharded parameter a module computes with is contiguous whatever its dp placement.

``Shard(d > 0)`` pieces arrive with the split dim first; they are copied (the copy-out every all-gather
does anyway) into their slices of a contiguous tensor of the global shape, so kernels and ``.view``
callers get what an unsharded model gives them. Uneven and empty shards: 5 and 3 columns over 3-4 ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import perparam
from perparam import ParamPolicy, QuantPolicy
from tests.distributed import one_process, run_distributed
from tests.models import full_params, regression_batches, train_steps

pytestmark = pytest.mark.fast

STEPS, GLOBAL_BATCH = 3, 12


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 5))


def _policy(quantize_last: bool):
    def policy(name: str, p: nn.Parameter):
        if p.ndim != 2:
            return None
        quant = QuantPolicy("int8") if quantize_last and name.startswith("4.") else None
        return ParamPolicy(placement=Shard(1), quant=quant)
    return policy


def train_shard1(rank: int, world_size: int, quantize_last: bool = False) -> dict:
    """SGD steps; every weight (Linear(5, 3), Linear(3, 2), Linear(2, 5)) sharded ``Shard(1)``. Records,
    in each forward, whether the weight the module computes with is contiguous and viewable."""
    model = _model()
    seen = []

    def check(module, args):
        w = module.weight
        seen.append(w.is_contiguous() and w.view(-1).numel() == w.numel())

    for layer in model[0::2]:
        layer.register_forward_pre_hook(check)
    if world_size:
        perparam.fully_shard(model, param_policy=_policy(quantize_last))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_steps(model, opt, regression_batches(STEPS, GLOBAL_BATCH, 5, 5), rank, world_size)
    if world_size:
        model.unshard()
        gathered = [m.weight.is_contiguous() for m in model[0::2]]
        model.reshard()
        seen.append(all(gathered))
    return {"contiguous": seen, "params": full_params(model)}


def both(rank: int, world_size: int) -> tuple[dict, dict]:
    """The plain run and the run with the last weight's all-gather quantized (int8), on the same ranks."""
    return train_shard1(rank, world_size), train_shard1(rank, world_size, True)


def test_shard1_parameters_are_contiguous_in_forward_and_train_like_one_process():
    """4 ranks: Linear(5, 3)'s 5 columns split 2, 2, 1, 0; plain weights match one process within 1e-5; an
    int8-quantized all-gather of a ``Shard(1)`` weight (dequantized into a scratch tensor, then copied in:
    the one extra copy of that path) within 2e-2."""
    want = one_process(train_shard1)
    for plain, quantized in run_distributed(both, 4):
        for got, tol in ((plain, 1e-5), (quantized, 2e-2)):
            assert got["contiguous"] and all(got["contiguous"])
            for name, ref in want["params"].items():
                torch.testing.assert_close(got["params"][name], ref, atol=tol, rtol=tol, msg=name)
