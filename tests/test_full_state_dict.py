"""Full state dicts: gathered on rank 0 one tensor at a time; loaded from rank 0 into a sharded (also
meta-device, also tensor-parallel with an uneven dp split) model, one tensor at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import perparam
from perparam import checkpoint
from perparam.checkpoint import CheckpointError
from tests.distributed import run_distributed
from tests.models import TinyNet, sharded_tiny


def reference() -> dict:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in TinyNet().state_dict().items()}


def gather(rank: int, world_size: int):
    model = sharded_tiny()
    return checkpoint.full_state_dict(model)


def test_full_state_dict_gathers_plain_cpu_tensors_on_rank_0_only():
    got = run_distributed(gather, 3)  # Embedding(5, 6) and Linear(6, 2) on 3 ranks: uneven and empty shards
    assert all(g is None for g in got[1:])
    want = reference()
    assert got[0].keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[0][k], v) and got[0][k].device.type == "cpu", k


class Rope(nn.Module):
    """A non-persistent buffer computed from constructor arguments (as a RoPE table)."""

    def __init__(self, n: int, reset: bool) -> None:
        super().__init__()
        self.n = n
        self.register_buffer("table", torch.arange(n, dtype=torch.float32), persistent=False)
        if reset:
            self.reset_non_persistent_buffers = lambda: self.table.copy_(
                torch.arange(self.n, dtype=torch.float32))

    def forward(self, x):
        return x + self.table[: x.shape[-1]].sum()


class WithRope(TinyNet):
    def __init__(self, reset: bool = True) -> None:
        super().__init__()
        self.rope = Rope(6, reset)

    def forward(self, idx):
        return super().forward(idx) + self.rope(torch.zeros(1, 2))


def load_into_meta(rank: int, world_size: int, reset: bool) -> dict:
    torch.manual_seed(0)
    full = WithRope().state_dict() if rank == 0 else None
    with torch.device("meta"):
        model = WithRope(reset)
    for block in model.blocks:
        perparam.fully_shard(block)
    perparam.fully_shard(model)
    try:
        checkpoint.load_full_state_dict(model, full)
    except CheckpointError as e:
        return {"error": str(e)}
    idx = torch.tensor([[0, 1, 4]])
    return {"out": model(idx).detach(), "sd": checkpoint.full_state_dict(model)}


@pytest.mark.fast
def test_load_full_state_dict_from_rank_0_into_a_meta_device_sharded_model():
    torch.manual_seed(0)
    plain = WithRope()
    want_out = plain(torch.tensor([[0, 1, 4]])).detach()
    got = run_distributed(load_into_meta, 2, True)
    for g in got:
        torch.testing.assert_close(g["out"], want_out, atol=0, rtol=0)
    for k, v in plain.state_dict().items():
        assert torch.equal(got[0]["sd"][k], v), k


def test_a_meta_model_with_non_persistent_buffers_and_no_reset_hook_is_refused():
    for g in run_distributed(load_into_meta, 2, False):
        assert "'rope'" in g["error"] and "reset_non_persistent_buffers" in g["error"], g["error"]


def tp_uneven(rank: int, world_size: int) -> dict:
    # ColwiseParallel Linear(4, 6) on tp=2: 3 rows per tp rank, split 2 + 1 over dp=2 (_StridedShard)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    full = nn.Linear(4, 6).state_dict() if rank == 0 else None
    torch.manual_seed(1)
    lin = nn.Linear(4, 6)
    parallelize_module(lin, mesh["tp"], ColwiseParallel())
    perparam.fully_shard(lin, mesh=mesh["dp_shard"])
    checkpoint.load_full_state_dict(lin, full)
    return {k: v.full_tensor() for k, v in lin.state_dict().items()}


def test_load_full_state_dict_on_dp2_tp2_with_an_uneven_dp_split_of_a_tp_shard():
    torch.manual_seed(0)
    want = nn.Linear(4, 6).state_dict()
    for got in run_distributed(tp_uneven, 4):
        for k, v in want.items():
            assert torch.equal(got[k], v), k


def wrong_keys(rank: int, world_size: int) -> str:
    model = TinyNet()
    perparam.fully_shard(model)
    full = {"embed.weight": torch.zeros(5, 6)} if rank == 0 else None
    before = model.embed.weight.to_local().clone()
    try:
        checkpoint.load_full_state_dict(model, full)
    except CheckpointError as e:
        assert torch.equal(model.embed.weight.to_local(), before)
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [2])
def test_a_state_dict_that_does_not_fit_is_refused_on_every_rank(world):
    for message in run_distributed(wrong_keys, world):
        assert "missing 14: ['blocks.0.norm.weight'" in message and "Nothing was loaded" in message


def load_plain(rank: int, world_size: int) -> dict:
    model = sharded_tiny(1)
    result = model.load_state_dict(reference())  # plain tensors, on every rank
    return {"sd": checkpoint.full_state_dict(model), "missing": result.missing_keys}


def test_load_state_dict_with_plain_full_tensors_shards_them_on_the_fly():
    got = run_distributed(load_plain, 3)[0]
    assert got["missing"] == []
    for k, v in reference().items():
        assert torch.equal(got["sd"][k], v), k


def stored_fp8(rank: int, world_size: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    perparam.fully_shard(model, param_policy={"0.weight": perparam.ParamPolicy(
        requires_grad=False, quant=perparam.QuantPolicy(torch.float8_e4m3fn, store_quantized=True))})
    local = model[0].weight.to_local().view(torch.uint8).clone()
    return checkpoint.full_state_dict(model), local


def test_full_state_dict_gathers_stored_fp8_codes_on_gloo():
    got = run_distributed(stored_fp8, 2)  # gloo has no float8 all-gather: the codes travel as bytes
    sd = got[0][0]
    assert sd["0.weight"].dtype == torch.float8_e4m3fn and sd["0.weight"].shape == (3, 4)
    assert torch.equal(sd["0.weight"][:2].view(torch.uint8), got[0][1])
    assert torch.equal(sd["0.weight"][2:].view(torch.uint8), got[1][1])


def dcp_load_into_meta(rank: int, world_size: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(0)
    full = TinyNet().state_dict()
    with torch.device("meta"):
        model = TinyNet()
    for block in model.blocks:
        perparam.fully_shard(block)
    perparam.fully_shard(model)
    before = [id(p) for p in model.parameters()]
    # on meta, torch loads with assign=True: the values become the shards of the same parameter objects
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))
    return {"kept": [id(p) for p in model.parameters()] == before,
            "out": model(torch.tensor([[0, 1, 4]])).detach()}


def test_set_model_state_dict_into_a_meta_sharded_model_loads_without_to_empty():
    torch.manual_seed(0)
    want = TinyNet()(torch.tensor([[0, 1, 4]])).detach()
    for got in run_distributed(dcp_load_into_meta, 3):
        assert got["kept"]
        assert torch.allclose(got["out"], want, atol=1e-6)
