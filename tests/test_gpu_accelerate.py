"""The CPU part of ``benchmarks/gpu/accelerate.py`` (the GPU check's accelerate section): torch's FSDP2
policies as ``fully_shard`` takes them, and ``ShardedAccelerator``'s loop against plain ``Accelerator`` on one
rank; accelerate's FSDP2 plugin itself is active on GPU backends only."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(n) for n in ("transformers", "accelerate")),
                                reason="transformers and accelerate are test dependencies: pip install -e "
                                       "'.[dev]'")


@pytest.mark.fast
def test_torch_fsdp2_policies_convert_to_perparams():
    from benchmarks.gpu.accelerate import policies

    got = policies()
    assert got["mp"] == ("MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, "
                         "output_dtype=None, cast_forward_inputs=False, master_dtype=None)")
    assert got["offload"] == "OffloadPolicy(tier='device', state='optimizer', path=None, pin_memory=True)"
    assert got["cpu_offload"] == "OffloadPolicy(tier='cpu', state='all', path=None, pin_memory=False)"


def torch_policies_and_loop(rank: int, world: int):
    import os

    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from benchmarks.gpu.accelerate import loop
    from perparam import ShardingError, fully_shard
    from perparam.module import group_of

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    net = nn.Linear(3, 5)
    fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                offload_policy=OffloadPolicy())
    dtype = group_of(net).mp_policy.param_dtype
    try:
        fully_shard(nn.Linear(3, 5), mp_policy={"param_dtype": torch.bfloat16})
        refused = None
    except ShardingError as e:
        refused = str(e)
    return {"dtype": dtype, "refused": refused, "loop": loop("cpu"), "fsdp2": _as_fsdp2_module()}


def _as_fsdp2_module() -> dict:
    """The opt-in for accelerate's FSDP2 plugin: the checks it and Trainer make, on CPU."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule

    from benchmarks.gpu.accelerate import make_llama
    from perparam import ShardedModule, fully_shard
    from perparam.hf_accelerate import as_fsdp2_module

    model = make_llama("cpu")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    names = [type(m).__name__ for m in model.modules()]
    as_fsdp2_module(model)
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    before = model.model.layers[0].self_attn.q_proj.weight.full_tensor().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.set_requires_gradient_sync(False)  # perparam's method, under FSDP2's name
    model(input_ids=torch.arange(7)[None], labels=torch.arange(7)[None]).loss.backward()
    model.set_requires_gradient_sync(True)
    model(input_ids=torch.arange(7)[None], labels=torch.arange(7)[None]).loss.backward()
    opt.step()
    for m in fsdp:  # Trainer's loop before creating its optimizer
        m.reshard()
    return {"count": len(fsdp), "same_names": names == [type(m).__name__ for m in model.modules()],
            "accelerate_keeps_it": fsdp2_prepare_model(object(), model) is model,
            "perparam_methods": (type(model).set_requires_gradient_sync
                                 is ShardedModule.set_requires_gradient_sync),
            "stepped": not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight.full_tensor())}


def test_torch_policies_the_sharded_accelerator_loop_and_the_fsdp2_module_opt_in_on_one_rank():
    [got] = run_distributed(torch_policies_and_loop, 1, timeout=180)
    assert got["dtype"] == torch.bfloat16
    assert "torch's torch.distributed.fsdp.MixedPrecisionPolicy, got dict" in got["refused"]
    assert got["loop"]["loss_max_diff"] < 1e-5 and got["loop"]["param_max_diff"] < 1e-5
    assert got["fsdp2"] == {"count": 3, "same_names": True, "accelerate_keeps_it": True,
                            "perparam_methods": True, "stepped": True}


def test_gpu_check_runs_the_accelerate_section_on_cpu_and_skips_the_plugin_there(tmp_path):
    from benchmarks.gpu.check import main

    result = main(["--device", "cpu", "--quick", "--steps", "1", "--warmup", "1", "--sim-steps", "1",
                   "--batch", "2", "--sections", "accelerate", "--json", str(tmp_path / "gpu.json")])
    out = result["accelerate"]
    assert out["ok"], out.get("traceback")
    assert out["loop"]["loss_max_diff"] < 1e-5 and "skipped" in out["fsdp2_plugin"]
