"""Pipeline parallelism (torch.distributed.pipelining) over stages sharded by perparam on the dp axis of a
(pp, dp) mesh, 4 gloo ranks, against one process: ``perparam.pipelining.PipelineStage`` hands the
schedules FSDP2's knobs, so micro-batches accumulate without communication and each group reduces once per
step."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import perparam
from perparam import CommCounter
from perparam.pipelining import PipelineStage
from tests.distributed import one_process, run_distributed

STEPS, GLOBAL_BATCH, MICRO_BATCHES, DP, PP = 3, 8, 2, 2, 2
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def _layers() -> list[nn.Module]:
    """Four layers; on 2 dp ranks Linear(4, 3) and Linear(5, 3) shard unevenly (2 + 1 rows) and
    Linear(3, 1) leaves dp rank 1 an empty shard."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Sequential(nn.Linear(3, 5), nn.Tanh()),
            nn.Sequential(nn.Linear(5, 3), nn.Tanh()), nn.Linear(3, 1)]


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def train(rank: int, world_size: int, schedule: str, optimizer: str, reshard_after_forward: bool = True,
          stage_class=PipelineStage) -> dict:
    """``STEPS`` optimizer steps; ``world_size == 0``: one process, the whole model on the global batch."""
    layers = _layers()
    if world_size == 0:
        model = nn.Sequential(*layers)
        opt = _optimizer(optimizer, model.parameters())
        for step in range(STEPS):
            x, y = _data(step)
            _loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return {"params": {f"{i}.{n}": p.detach().clone() for i, layer in enumerate(layers)
                           for n, p in layer.named_parameters()}}
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    n_stages = 2 * PP if schedule == "interleaved" else PP
    per_stage = len(layers) // n_stages
    stages, mine = [], []
    for s in range(pp_rank, n_stages, PP):  # stage s on pp rank s % PP (the interleaved schedule: 2 each)
        module = nn.Sequential(*layers[s * per_stage:(s + 1) * per_stage])
        for layer in module:
            perparam.fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        perparam.fully_shard(module, mesh=mesh["dp"])
        stages.append(stage_class(module, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
        mine += range(s * per_stage, (s + 1) * per_stage)
    kind = SCHEDULES[schedule]
    sched = kind(stages if schedule == "interleaved" else stages[0], n_microbatches=MICRO_BATCHES,
                 loss_fn=_loss)
    opt = _optimizer(optimizer, [p for s in stages for p in s.submod.parameters()])
    counts = []
    n = GLOBAL_BATCH // DP
    for step in range(STEPS):
        x, y = (t[dp_rank * n:(dp_rank + 1) * n] for t in _data(step))
        with CommCounter() as comm:
            if pp_rank == 0:
                sched.step(x)
            else:
                sched.step(target=y)
        counts.append(comm.by_kind())
        opt.step()
        opt.zero_grad()
    refusal = None
    try:  # a zero-bubble schedule's split backward (local: refused before anything runs)
        if stage_class is PipelineStage:
            stages[0].backward_maybe_with_nosync("input", {})
            refusal = "accepted"
    except NotImplementedError as e:
        refusal = str(e)
    return {"params": {f"{i}.{n}": p.full_tensor() for i in mine for n, p in layers[i].named_parameters()},
            "counts": counts, "split_backward": refusal}


#: (schedule, the layers' reshard_after_forward, all-gathers per step and rank from step 2 on): each rank
#: holds 2 groups (2 layers of one stage, or 1 layer of each of its 2 interleaved stages); kept from forward
#: to backward, each group all-gathers once per step; resharded after forward, once per micro-batch's
#: forward plus once for the backwards (kept gathered through them)
CASES = [("gpipe", True, 2 * (MICRO_BATCHES + 1)), ("1f1b", False, 2), ("interleaved", False, 2)]
OPTIMIZERS = ("adamw", "sgd")


def train_all(rank: int, world_size: int) -> dict:
    runs = {(schedule, opt): train(rank, world_size, schedule, opt, raf)
            for schedule, raf, _ in CASES for opt in OPTIMIZERS}
    runs["torch stage"] = train(rank, world_size, "gpipe", "sgd", False, TorchPipelineStage)
    return runs


@functools.cache
def _runs() -> list[dict]:
    """Every case in one set of 4 processes (each imports torch.distributed.pipelining, and so dynamo,
    once: most of a run's time)."""
    return run_distributed(train_all, PP * DP)


@pytest.mark.parametrize(("schedule", "reshard_after_forward", "all_gathers"), CASES)
def test_pipeline_stages_sharded_on_dp_match_one_process_reducing_once_per_step(schedule,
                                                                                reshard_after_forward,
                                                                                 all_gathers):
    results = _runs()
    for optimizer in OPTIMIZERS:
        want = one_process(train, schedule, optimizer)["params"]
        seen = set()
        for r in results:
            for name, got in r[schedule, optimizer]["params"].items():
                torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=f"{optimizer} {name}")
                seen.add(name)
        assert seen == set(want)
        for r in results:  # step 1 also runs torch's shape inference (a real forward and backward)
            # one reduce-scatter per group per step: the micro-batches accumulate without communication
            counts = r[schedule, optimizer]["counts"]
            assert counts[1:] == [{"all_gather": all_gathers, "reduce_scatter": 2}] * (STEPS - 1)


def test_a_split_backward_of_a_zero_bubble_schedule_is_refused_naming_the_schedules_to_use():
    for r in _runs():
        message = r["1f1b", "sgd"]["split_backward"]
        assert "split backward ('input'" in message and "Schedule1F1B" in message, message


def test_torchs_own_stage_treats_a_perparam_stage_as_a_plain_module_correct_but_reducing_every_micro_batch():
    want = one_process(train, "gpipe", "sgd")["params"]
    for r in _runs():
        run = r["torch stage"]
        for name, got in run["params"].items():
            torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=name)
        assert [c["reduce_scatter"] for c in run["counts"][1:]] == [2 * MICRO_BATCHES] * (STEPS - 1)
