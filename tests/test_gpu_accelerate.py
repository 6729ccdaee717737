"""The CPU part of ``benchmarks/gpu_accelerate.py`` (the GPU check's accelerate section): torch's FSDP2
policies as ``fully_shard`` takes them, and ``ShardedAccelerator``'s loop against plain ``Accelerator`` on one
rank; accelerate's FSDP2 plugin itself is active on GPU backends only."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(n) for n in ("transformers", "accelerate")),
                                reason="transformers and accelerate are test dependencies: pip install -e '.[dev]'")


def test_torch_fsdp2_policies_convert_to_perparams():
    from benchmarks.gpu_accelerate import policies

    got = policies()
    assert got["mp"] == ("MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, "
                         "output_dtype=None, cast_forward_inputs=False, master_dtype=None)")
    assert got["offload"] == "OffloadPolicy(tier='device', state='optimizer', path=None, pin_memory=True)"
    assert got["cpu_offload"] == "OffloadPolicy(tier='cpu', state='all', path=None, pin_memory=False)"


def torch_policies_and_loop(rank: int, world: int):
    import os

    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from benchmarks.gpu_accelerate import loop
    from perparam import ShardingError, fully_shard
    from perparam.module import group_of

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    net = nn.Linear(3, 5)
    fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), offload_policy=OffloadPolicy())
    dtype = group_of(net).mp_policy.param_dtype
    try:
        fully_shard(nn.Linear(3, 5), mp_policy={"param_dtype": torch.bfloat16})
        refused = None
    except ShardingError as e:
        refused = str(e)
    return {"dtype": dtype, "refused": refused, "loop": loop("cpu")}


def test_fully_shard_takes_torch_policies_and_the_sharded_accelerator_loop_matches_on_one_rank():
    [got] = run_distributed(torch_policies_and_loop, 1, timeout=180)
    assert got["dtype"] == torch.bfloat16
    assert "torch's torch.distributed.fsdp.MixedPrecisionPolicy, got dict" in got["refused"]
    assert got["loop"]["loss_max_diff"] < 1e-5 and got["loop"]["param_max_diff"] < 1e-5
