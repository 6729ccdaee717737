"""What cannot compose with in-memory snapshots is refused by ``perparam.elastic.State`` at start, on every
rank alike, in one line naming the fix: parameters on the disk offload tier, experts on their own
``ParamPolicy(mesh=...)`` mesh, pipeline stages (each stage's model sharded over its own ranks), a model not
sharded at all (each rank's own copy)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from perparam import OffloadPolicy, ParamPolicy, fully_shard
from perparam.elastic import SnapshotError, State
from tests.distributed import run_distributed


def refusals(rank: int, world_size: int, root: str) -> dict:
    whole = init_device_mesh("cpu", (world_size,))
    own = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("other", "own"))["own"]  # this rank alone
    cases = {
        "disk": lambda m: fully_shard(m, mesh=whole, offload_policy=OffloadPolicy("disk", "all", path=root)),
        "experts": lambda m: fully_shard(m, mesh=whole, param_policy={"*": ParamPolicy(mesh=own)}),
        "stages": lambda m: fully_shard(m, mesh=own),  # a pipeline stage: its own model over its own ranks
        "unsharded": lambda m: None,  # each rank its own copy: a restore would give each rank one rank's
    }
    out = {}
    for name, shard in cases.items():
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            State(model, opt, root=root, job=name)
            out[name] = "accepted"
        except SnapshotError as exc:
            out[name] = str(exc)
    return out


@pytest.fixture(scope="module")
def said(tmp_path_factory) -> list[dict]:
    return run_distributed(refusals, 2, str(tmp_path_factory.mktemp("refusals")))


@pytest.mark.parametrize("case,expect,fix", [
    ("disk", "is offloaded to the disk tier", "use OffloadPolicy('cpu') or no offload"),
    ("experts", "is a different tensor on each rank (experts on their own", "shard the experts on the"),
    ("stages", "is sharded over 1 of the job's 2 ranks (pipeline stages", "save each stage to disk"),
    ("unsharded", "Sequential has no parameter sharded by perparam.fully_shard: on 2 ranks each holds",
     "fully_shard the model (each block, then the root) before State"),
])
def test_what_cannot_compose_with_snapshots_is_refused_on_every_rank_in_one_line(said, case, expect, fix):
    lines = [r[case] for r in said]
    assert lines[0] == lines[1] or case != "stages" and all(expect in x for x in lines), lines
    for line in lines:
        assert "\n" not in line and expect in line and fix in line, line
