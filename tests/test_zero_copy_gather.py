"""The zero-copy all-gather (``paths/gather_zero_copy.py``: per-parameter sends and receives into the
unsharded buffers) gathers exactly what the packed row all-gather gathers, bit for bit, and trains alike:
uneven and empty shards, mixed compute dtypes in one all-gather, and a group it cannot take (``Shard(1)``),
which falls back to the row path."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import perparam
from perparam import ParamPolicy
from tests.distributed import CountingAllGather, c10d_calls, run_distributed

pytestmark = pytest.mark.fast


def _model() -> nn.Sequential:
    # on 3 ranks: Linear(4, 2) leaves rank 2 without rows, Linear(2, 5) splits 2/2/1; the root's group
    # mixes fp32 and bf16 pieces in one all-gather; the last block's Shard(1) weight takes the row path
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 5), nn.Linear(5, 3), nn.Sequential(nn.Linear(3, 6)))


def _shard(model: nn.Sequential) -> None:
    perparam.fully_shard(model[0])
    perparam.fully_shard(model[3], param_policy={"0.weight": ParamPolicy(placement=Shard(1))})
    perparam.fully_shard(model, param_policy={"1.*": ParamPolicy(param_dtype=torch.bfloat16)})


def _train(rank: int, world_size: int, algorithm: str) -> dict:
    # the reduce-scatter packed (all-to-all): the point-to-point calls counted are the all-gather's
    previous = perparam.configure(gloo_all_gather=algorithm, gloo_reduce_scatter="all_to_all")
    try:
        model = _model()
        _shard(model)
        gathered = []  # every unsharded weight and bias a forward computed with
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(lambda mod, _args: gathered.append(
                    (mod.weight.detach().clone(), mod.bias.detach().clone())))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        with c10d_calls() as raw:
            for _ in range(2):
                x = torch.randn(2 * world_size, 4, generator=g)[2 * rank:2 * rank + 2]
                opt.zero_grad(set_to_none=True)
                model(x).float().pow(2).sum().backward()
                opt.step()
        return {"gathered": gathered, "raw": dict(raw),
                "params": [p.to_local().clone() for p in model.parameters()],
                "grads": [p.grad.to_local().clone() for p in model.parameters()]}
    finally:
        perparam.configure(gloo_all_gather=previous.gloo_all_gather,
                           gloo_reduce_scatter=previous.gloo_reduce_scatter)


def _switching(rank: int, world_size: int) -> dict:
    """One model, one forward and backward per all-gather setting in turn (zero-copy, all-to-all,
    zero-copy, zero-copy with a custom all-gather on the root's group), then ``to_empty(device="cpu")`` and
    a load of the state it had (new local shard objects) and one more: the raw calls of each run, the
    custom all-gather's calls, and the outputs before and after the load."""
    previous = perparam.configure(gloo_reduce_scatter="all_to_all")  # p2p calls counted: the all-gather's
    try:
        model = _model()
        _shard(model)
        x = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(1))[2 * rank:2 * rank + 2]
        custom = CountingAllGather()
        raw_per_run, outputs = [], []

        def run() -> None:
            with c10d_calls() as raw:
                out = model(x).float()
                out.pow(2).sum().backward()
            raw_per_run.append(dict(raw))
            outputs.append(out.detach())

        for algorithm in ("zero_copy", "all_to_all", "zero_copy"):
            perparam.configure(gloo_all_gather=algorithm)
            run()
        model.set_custom_all_gather(custom)
        run()
        model.set_custom_all_gather(None)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.to_empty(device="cpu")
        model.load_state_dict(state)
        run()
        return {"raw": raw_per_run, "custom_calls": custom.calls,
                "same": all(torch.equal(outputs[0], out) for out in outputs)}
    finally:
        perparam.configure(gloo_all_gather=previous.gloo_all_gather,
                           gloo_reduce_scatter=previous.gloo_reduce_scatter)


def both_paths(rank: int, world_size: int) -> dict:
    return {**{alg: _train(rank, world_size, alg) for alg in ("all_to_all", "zero_copy")},
            "switching": _switching(rank, world_size)}


@functools.cache
def _results() -> tuple[dict, ...]:
    return tuple(run_distributed(both_paths, 3))


def test_zero_copy_all_gather_is_bitwise_the_row_all_gather_on_uneven_empty_shard1_and_mixed_dtypes():
    for rank, res in enumerate(_results()):
        rows, direct = res["all_to_all"], res["zero_copy"]
        assert len(rows["gathered"]) == len(direct["gathered"]) == 2 * 4
        for (w0, b0), (w1, b1) in zip(rows["gathered"], direct["gathered"]):
            assert w0.dtype == w1.dtype and torch.equal(w0, w1) and torch.equal(b0, b1)
        assert any(w.dtype == torch.bfloat16 for w, _ in direct["gathered"])  # mixed dtypes were gathered
        for key in ("params", "grads"):  # after 2 AdamW steps
            assert all(torch.equal(a, b) for a, b in zip(rows[key], direct[key])), (rank, key)
        # the row path sends no point-to-point message; the zero-copy one does, and still runs the Shard(1)
        # group's all-gathers (forward and backward) as all-to-alls of rows: 3 of a step's 5 go zero-copy
        assert rows["raw"]["send"] == rows["raw"]["recv"] == 0
        assert direct["raw"]["send"] > 0 and direct["raw"]["recv"] > 0
        assert direct["raw"]["all_to_all_single"] == rows["raw"]["all_to_all_single"] - 2 * 3


def test_the_all_gather_path_follows_configure_a_custom_all_gather_and_to_empty_between_steps():
    # the path is decided at each unshard from what can change (the setting, a custom all-gather, the
    # local shards), the rest kept per group: zero-copy, all-to-all, zero-copy again, the root's group
    # through its custom all-gather (the others still zero-copy), then after to_empty() and a load
    for rank, res in enumerate(_results()):
        zc, rows, again, custom, loaded = res["switching"]["raw"]
        assert zc["send"] > 0 and rows["send"] == rows["recv"] == 0, rank
        assert again == zc and loaded == zc, rank
        assert (res["switching"]["custom_calls"] == 1 and custom["send"] < zc["send"]
                and custom["recv"] > 0), rank
        assert res["switching"]["same"], rank  # every run computed the same outputs
