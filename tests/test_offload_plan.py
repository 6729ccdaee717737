"""The offload planner: within a per-rank byte budget with the least traffic, compared with largest
parameters first, said when nothing fits, and applied by fully_shard through the policy it writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import perparam
from perparam import OffloadPolicy, ParamPolicy, fully_shard
from perparam.cli import main
from perparam.memory.budget import (
    largest_first,
    load_policy,
    param_policy,
    parse_bytes,
    plan_budget,
    write_policy,
)
from perparam.memory.measure import model_state_bytes
from perparam.memory.plan import plan_model, plan_module
from tests.distributed import run_distributed
from tests.models import TinyNet, local_slice, make_batches


def _tiny_plan(k: int = 4):
    return plan_model("gpt2-tiny", k, dtype=torch.float32, optim_bytes=8)


def test_budget_plan_fits_every_rank_and_moves_no_more_than_largest_parameters_first():
    plan = _tiny_plan()
    total = plan.max_rank.total
    for fraction in (0.9, 0.6, 0.4):
        budget = int(total * fraction)
        ours, baseline = plan_budget(plan, budget), largest_first(plan, budget)
        assert ours.fits and baseline.fits
        assert all(kept <= budget for kept in ours.kept)
        assert ours.max_moved <= baseline.max_moved, (fraction, ours.max_moved, baseline.max_moved)
        # while optimizer state alone can make room, no shard leaves the device
        optimizer_bytes = plan.max_rank.optimizer
        if total - budget <= optimizer_bytes * 0.9:
            assert ours.by_place["all"] == 0
    assert plan_budget(plan, total).by_place == {"device": len(plan.params), "optimizer": 0, "all": 0}


@pytest.mark.fast
def test_a_zero_budget_offloads_shards_gradients_and_optimizer_state_and_kept_copies_say_nothing_fits():
    plan = _tiny_plan()
    result = plan_budget(plan, 0)
    assert result.fits and result.kept == [0] * 4 and result.stage2 == 0
    # moved per step: 2 O + 3 S + 2 G for every trainable parameter (the gradient counted in "all")
    r = plan.rank(0)
    assert result.moved[0] == 2 * r.optimizer + 3 * r.params + 2 * r.grads
    with torch.device("meta"):
        model = TinyNet()
    kept_copies = plan_module(model, 2, dtype=torch.float32, optim_bytes=8,
                              param_policy={"*": ParamPolicy(zero_stage=2)})
    refused = plan_budget(kept_copies, 0)
    assert not refused.fits and "nothing fits" in refused.message and "stage-1/2" in refused.message


def test_parse_bytes_reads_decimal_and_binary_units():
    assert parse_bytes("20e9") == parse_bytes("20GB") == 20 * 10**9
    assert (parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("512MiB") == 2**29
            and parse_bytes("1000") == 1000)


def test_plan_cli_prints_both_rules_and_writes_a_policy(tmp_path, capsys):
    out = tmp_path / "plan.json"
    plan = _tiny_plan()
    budget = int(plan.max_rank.total * 0.6)
    assert main(["plan", "--preset", "gpt2-tiny", "-K", "4", "--dtype", "fp32", "--optim-bytes", "8",
                 "--budget", str(budget), "--write-policy", str(out), "--offload-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "least traffic" in text and "largest parameters first" in text and out.exists()
    assert "zero_stage 2:" in text and "moves" in text


def train_with_planned_offload(rank: int, world_size: int, root: str, planned: bool) -> list:
    torch.manual_seed(0)
    model = TinyNet()
    policy = load_policy(f"{root}/plan.json", model, offload_dir=root) if planned else None
    for block in model.blocks:
        fully_shard(block, param_policy=policy)
    fully_shard(model, param_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in make_batches(3, 8):
        loss = nn.functional.mse_loss(model(local_slice(x, rank, world_size)),
                                      local_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    perparam.offload.flush()
    files = len(list(Path(root).glob("perparam-offload-*/*.bin")))
    return [losses, {n: p.full_tensor() for n, p in model.named_parameters()}, files]


def test_a_written_plan_applies_through_fully_shard_and_trains_bitwise_as_without(tmp_path):
    with torch.device("meta"):
        model = TinyNet()
    plan = plan_module(model, 2, dtype=torch.float32, optim_bytes=8)
    budget = int(plan.max_rank.total * 0.4)
    result = plan_budget(plan, budget)
    assert result.fits and result.by_place["all"] > 0 and result.by_place["optimizer"] > 0
    write_policy(tmp_path / "plan.json", result, "disk", str(tmp_path))
    probe = TinyNet()
    policy = param_policy(probe, result.places, "disk", str(tmp_path))
    for name, p in probe.named_parameters():
        got = policy(name, p)
        place = result.places[name]
        assert (got is None) == (place == "device"), name
        assert got is None or got.offload == OffloadPolicy("disk", place, path=str(tmp_path)), name
    planned = run_distributed(train_with_planned_offload, 2, str(tmp_path), True)
    device = run_distributed(train_with_planned_offload, 2, str(tmp_path), False)
    for (losses, params, files), (want_losses, want_params, _) in zip(planned, device):
        assert losses == want_losses and files > 0
        for name, want in want_params.items():
            assert torch.equal(params[name], want), name


def stage_mix_measured(rank: int, world_size: int, root: str) -> list:
    """The planned mix of stages 2 and 3 applied to TinyNet on 2 ranks: one AdamW step; this rank's live
    model-state bytes and losses, and the losses of the same training at stage 3."""
    import json

    out = []
    for planned in (True, False):
        torch.manual_seed(0)
        model = TinyNet()
        data = json.loads(Path(f"{root}/plan.json").read_text())
        policy = param_policy(model, {}, "disk", root, stages=data["zero_stages"]) if planned else None
        for block in model.blocks:
            fully_shard(block, param_policy=policy)
        fully_shard(model, param_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in make_batches(2, 8):
            loss = nn.functional.mse_loss(model(local_slice(x, rank, world_size)),
                                          local_slice(y, rank, world_size))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        got = model_state_bytes(model, opt).as_dict()
        got["steps"] = sum(1 for st in opt.state.values() if "step" in st)
        out.append([losses, got])
    return out


def test_plan_picks_stage_2_where_the_budget_leaves_room_and_its_bytes_are_the_live_bytes(tmp_path):
    with torch.device("meta"):
        model = TinyNet()
    plan = plan_module(model, 2, dtype=torch.float32, optim_bytes=8)
    all_stage2 = plan_module(model, 2, dtype=torch.float32, optim_bytes=8,
                             param_policy={"*": ParamPolicy(zero_stage=2)})
    budget = (plan.max_rank.total + all_stage2.max_rank.total) // 2  # room for some kept copies, not all
    result = plan_budget(plan, budget)
    assert result.fits and result.by_place["device"] == len(plan.params)  # no offload: stage 2 fits as it is
    assert 0 < result.stage2 < len(plan.params) and max(result.kept) <= budget
    # fewer all-gather bytes than stage 3
    assert result.collective_bytes < 2 * plan.padded_param_bytes_per_rank
    assert plan_budget(plan, budget, stage2=False).stage2 == 0
    write_policy(tmp_path / "plan.json", result, "disk", str(tmp_path))
    mix = plan_module(model, 2, dtype=torch.float32, optim_bytes=8,
                      param_policy={n: ParamPolicy(zero_stage=v) for n, v in result.stages.items()})
    assert [mix.rank(r).total for r in range(2)] == result.kept  # the planner's bytes are plan_module's
    measured = run_distributed(stage_mix_measured, 2, str(tmp_path))
    for r, ((losses, got), (want_losses, _)) in enumerate(measured):
        want = mix.rank(r)
        assert losses == want_losses
        assert (got["params"] == want.params
                and got["optimizer"] == want.optimizer + 4 * got["steps"]), (got, want)
        assert got["grads"] >= want.grads  # reduce-scatter outputs: padded, plus used flags
