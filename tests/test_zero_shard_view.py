"""ZeRO stages 1 and 2 at Table 7-2's P (``perparam/runtime/shard_view.py``): where the stored and compute
dtypes match, the shard is a view of the kept copy's own rows, so a rank holds P for a parameter, not P + P/K;
training, accumulation, checkpoints and ``model.to(dtype)`` still match one process on uneven and empty
shards, with the collectives of before (``tests/test_zero_stages.py`` counts them per stage)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam import ParamPolicy
from perparam.memory.measure import model_state_bytes
from perparam.memory.plan import plan_module
from perparam.runtime.group import group_of
from tests.distributed import one_process, run_distributed

TOL = 1e-5


def _model() -> nn.Sequential:
    """Over 4 ranks: 0.weight's 5 rows as 2, 2, 1 and none; 2.bias's 2 rows leave ranks 2-3 empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


#: stages 1 and 2 in one group with stage 3 (2.weight)
_POLICY = {"0.weight": ParamPolicy(zero_stage=1), "0.bias": ParamPolicy(zero_stage=2),
           "2.bias": ParamPolicy(zero_stage=1)}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _views(model) -> dict[str, bool]:
    """Per parameter: its local shard lies in its kept copy's storage."""
    out = {}
    for sp in group_of(model).params:
        local, kept = sp.local_shard(), sp._padded
        alive = kept is not None and kept.untyped_storage().size() > 0
        out[sp.fqn] = alive and local.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
    return out


def _steps(model, opt, rank: int, world_size: int, steps: int, seed: int, dtype=torch.float32) -> None:
    """``steps`` steps, each two micro-batches accumulated (the first without gradient sync)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for micro in range(2):
            x = torch.randn(8, 3, generator=g).to(dtype)
            if world_size:
                x = x.chunk(world_size)[rank]
                model.set_requires_gradient_sync(micro == 1)
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def train(rank: int, world_size: int, path: str | None = None) -> dict:
    """AdamW: two steps, (``path``: a checkpoint, one more, the checkpoint loaded back,)
    ``model.to(torch.float64)``, two steps in float64 (``world_size == 0``: one process, the whole batch, the
    same schedule)."""
    model = _model()
    if world_size:
        perparam.fully_shard(model, param_policy=lambda name, p: _POLICY.get(name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"views": _views(model) if world_size else {}}
    _steps(model, opt, rank, world_size, 2, seed=1)
    out["saved"] = {n: _full(p) for n, p in model.named_parameters()}
    if path is not None:
        from perparam import checkpoint

        checkpoint.save(path, model, opt)
        _steps(model, opt, rank, world_size, 1, seed=2)
        checkpoint.load(path, model, opt)
        out["loaded"] = {n: _full(p) for n, p in model.named_parameters()}
    # the optimizer's state cast with the model (perparam's refusal names it)
    for state in opt.state.values():
        state.update({k: v.to(torch.float64) for k, v in state.items() if v.is_floating_point() and v.dim()})
    model.to(torch.float64)
    _steps(model, opt, rank, world_size, 2, seed=3, dtype=torch.float64)
    out["float64"] = {n: _full(p) for n, p in model.named_parameters()}
    out["views64"] = _views(model) if world_size else {}
    with torch.no_grad():
        out["forward"] = model(torch.ones(2, 3, dtype=torch.float64))
    return out


@pytest.mark.fast
def test_shards_view_their_kept_copies_and_train_as_one_process_through_a_checkpoint_and_a_cast(tmp_path):
    """K = 4 with empty shards, AdamW, accumulation (SGD and K = 1-4: ``tests/test_zero_stages.py``, whose
    stage-1/2 ``Shard(0)`` parameters are views too)."""
    want = one_process(train)
    for rank, run in enumerate(run_distributed(train, 4, str(tmp_path / "ckpt"))):
        # stage 1/2: views (empty shards included), in float64 after the cast too; stage 3: a shard of its own
        assert run["views"] == run["views64"] == {"0.weight": True, "0.bias": True, "2.weight": False,
                                                  "2.bias": True}, run
        for stage in ("saved", "float64"):
            for n, p in want[stage].items():
                torch.testing.assert_close(run[stage][n], p, atol=TOL, rtol=0, msg=f"{stage} {n} rank {rank}")
        for n, p in run["loaded"].items():  # the checkpoint of step 2 loaded back over step 3
            assert torch.equal(p, run["saved"][n]), (n, rank)
        torch.testing.assert_close(run["forward"], want["forward"], atol=TOL, rtol=0)


def measure(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 40))  # P = 1,864 fp32 = 7,456 bytes
    perparam.fully_shard(model, param_policy=ParamPolicy(zero_stage=stage))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    with torch.no_grad():
        model(torch.ones(1, 16))
    return model_state_bytes(model, opt).as_dict()


def measure_stages(rank: int, world_size: int) -> list[dict]:
    return [measure(rank, world_size, stage) for stage in (1, 2)]


def test_stages_1_and_2_hold_table_7_2s_p_for_the_parameters_and_the_plan_says_so():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 40))
    for per_stage in run_distributed(measure_stages, 2):
        for stage, got in zip((1, 2), per_stage):
            assert got["params"] == 7456, (stage, got)  # was 11,184: the kept copy and a shard beside it
            plan = plan_module(meta, 2, dtype=None, optim_bytes=8, param_policy=ParamPolicy(zero_stage=stage))
            assert plan.rank(0).params == 7456
