"""hpZ (ZeRO++'s secondary partition; FSDP2's ``reshard_after_forward=int``) on 4 gloo ranks: after forward
each block keeps a secondary shard over 2 ranks, so its backward all-gather runs on 2 ranks instead of 4.
Parity with one process, and bytes and memory per rank against ZeRO++'s model."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import perparam
from perparam import CommCounter, ParamPolicy, QuantPolicy
from perparam.memory.hpz import hpz_model
from perparam.runtime.group import group_of
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, local_slice, make_batches

STEPS, GLOBAL_BATCH, WORLD, SECONDARY = 3, 8, 4, 2


def _sent(records: list[tuple[int, int]]) -> float:
    """Bytes one rank sends in ring all-gathers of ``(group size, output bytes)``: (g - 1) / g of each."""
    return sum(n * (g - 1) / g for g, n in records)


def train(rank: int, world_size: int, optimizer: str, reshard_after_forward=SECONDARY, quant: bool = False,
          hsdp: bool = False, call_twice: bool = False) -> dict:
    """TinyNet (Embedding(5, 6) and Linear(6, 2) leave empty shards on 4 ranks); the blocks reshard to
    ``reshard_after_forward`` ranks after forward, the root keeps its parameters (its default).
    ``quant``: the blocks' fc1 weights all-gathered in int8 (blocks of 4). ``hsdp``: a 2D (1, 4) mesh.
    ``call_twice``: each block runs twice per forward."""
    torch.manual_seed(0)
    model = TinyNet(call_twice=call_twice)
    if world_size:
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("rep", "shard")) if hsdp else None
        for block in model.blocks:
            perparam.fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, param_policy={
                "fc1.weight": ParamPolicy(quant=QuantPolicy("int8", 4))} if quant else None)
        perparam.fully_shard(model, mesh=mesh)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    out: dict = {"forward": [], "backward": [], "kept": [], "gathered": []}
    for x, y in make_batches(STEPS, GLOBAL_BATCH):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        with CommCounter() as fwd:
            loss = F.mse_loss(model(x), y)
        if world_size:
            out["kept"].append([group_of(b).own.hpz.kept_bytes() if group_of(b).own.hpz else 0
                                for b in model.blocks])
            out["gathered"] = [group_of(b).own.layout.all_gather_bytes for b in model.blocks]
        with CommCounter() as bwd:
            loss.backward()
        out["forward"].append([(r.group_size, r.nbytes) for r in fwd.records if r.kind == "all_gather"])
        out["backward"].append([(r.group_size, r.nbytes) for r in bwd.records if r.kind == "all_gather"])
        opt.step()
        opt.zero_grad()
    out["params"] = {n: (p.full_tensor() if world_size else p).detach().clone()
                     for n, p in model.named_parameters()}
    if world_size and optimizer == "adamw" and reshard_after_forward == SECONDARY and not hsdp:
        # set_reshard_after_forward: True turns hpZ off (FSDP2's setter), None restores fully_shard's int
        out["setter"] = []
        for value in (True, None):
            for b in model.blocks:
                b.set_reshard_after_forward(value)
            loss = F.mse_loss(model(x), y)
            with CommCounter() as bwd:
                loss.backward()
            out["setter"].append([r.group_size for r in bwd.records if r.kind == "all_gather"])
        opt.zero_grad()
    if world_size:  # nothing kept once backward is done
        out["kept_after_backward"] = [group_of(b).own.hpz.kept_bytes() if group_of(b).own.hpz else 0
                                      for b in model.blocks]
    return out


def train_both(rank: int, world_size: int) -> dict:
    runs = {opt: train(rank, world_size, opt) for opt in ("adamw", "sgd")}
    for raf in (SECONDARY, True):
        runs["int8", raf] = train(rank, world_size, "sgd", raf, quant=True)
    runs["hsdp"] = train(rank, world_size, "sgd", hsdp=True)
    runs["twice"] = train(rank, world_size, "sgd", call_twice=True)
    return runs


@functools.cache
def _runs() -> list[dict]:
    return run_distributed(train_both, WORLD)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_hpz_blocks_match_one_process(optimizer):
    want = one_process(train, optimizer)["params"]
    for r in _runs():
        for name, got in r[optimizer]["params"].items():
            torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.fast
def test_hpz_backward_all_gathers_stay_on_the_secondary_group_with_zeropp_bytes_and_memory():
    for r in _runs():
        run = r["adamw"]
        gathered = run["gathered"]  # P per block: the packed all-gather's bytes, padding included
        models = [hpz_model(p, WORLD, SECONDARY) for p in gathered]
        for step in range(STEPS):
            root, *blocks = run["forward"][step]
            assert root[0] == WORLD and blocks == [(WORLD, p) for p in gathered]
            # the root kept its parameters; each block all-gathers once, over its 2-rank secondary group
            assert run["backward"][step] == [(SECONDARY, p) for p in gathered[::-1]]
            assert _sent(blocks) == sum(m.forward_sent for m in models)
            assert _sent(run["backward"][step]) == sum(m.backward_sent for m in models)
            # between forward and backward each block holds one secondary shard of P / k' bytes
            assert run["kept"][step] == [m.secondary_bytes for m in models]
        assert sum(m.backward_sent for m in models) < sum(m.zero3_backward_sent for m in models)
        assert run["kept_after_backward"] == [0, 0]
        assert run["setter"] == [[WORLD, WORLD], [SECONDARY, SECONDARY]]


def refused(rank: int, world_size: int, value) -> str:
    try:
        perparam.fully_shard(TinyNet().blocks[0], reshard_after_forward=value)
    except perparam.ShardingError as e:
        return str(e)
    return "accepted"


def test_a_secondary_size_that_does_not_divide_the_shard_axis_is_refused_at_fully_shard():
    message = run_distributed(refused, WORLD, 3)[0]
    assert "reshard_after_forward=3" in message and "[1, 2, 4]" in message, message


def test_hpz_regathers_the_bytes_of_the_forward_so_a_quantized_all_gather_trains_bitwise_as_without_it():
    for r in _runs():
        hpz, plain = r["int8", SECONDARY], r["int8", True]
        assert [len(b) for b in hpz["backward"]] == [2] * STEPS and hpz["backward"][0][0][0] == SECONDARY
        assert plain["backward"][0][0][0] == WORLD
        for name, got in hpz["params"].items():
            assert torch.equal(got, plain["params"][name]), name


def test_hpz_on_a_2d_mesh_keeps_the_secondary_groups_inside_the_shard_axis():
    want = one_process(train, "sgd")["params"]
    for r in _runs():
        run = r["hsdp"]
        assert all(g == SECONDARY for step in run["backward"] for g, _ in step)
        for name, got in run["params"].items():
            torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=name)


def test_hpz_blocks_called_twice_per_forward_match_one_process():
    want = one_process(train, "sgd", SECONDARY, False, False, True)["params"]
    for r in _runs():
        run = r["twice"]
        assert all(g == SECONDARY for step in run["backward"] for g, _ in step)
        for name, got in run["params"].items():
            torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=name)
