"""A new reduction path is its file, one row of the chooser and its test: this file is all three. The path
(``AllReduceRows``: the packed ``[K, n]`` input all-reduced whole, this rank keeping its row, counting what
it issues) is defined here, its row is added through the chooser's public extension point
(``choose.REDUCE_RULES.add``, documented in ``perparam/runtime/paths/choose.py``), and a 2-rank run on gloo
matches one process: the common tail (division, accumulation, used flags) needs nothing of it."""

from __future__ import annotations

import torch

import perparam
from perparam import CommCounter
from perparam.comm import collectives
from perparam.runtime.paths import choose
from perparam.runtime.reduction import PendingReduce, pack_reduce_scatter_input, used_flags
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, full_params, make_batches, train_steps


class AllReduceRows:
    """A reduce-scatter as an all-reduce: every gradient's rank-r piece and the used flags in row r of one
    ``[K, n]`` input (as the packed path's), the whole input summed over the shard axis, this rank's row
    kept as the reduction's output (``[n]``: the padded pieces at ``plan.offsets``, then the used flags)."""

    name = "all-reduce rows"

    def __init__(self) -> None:
        self.issued = 0

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        self.issued += 1
        pg = part.reduce_shard_pg
        flags = used_flags(used, dtype, grads[0].device)
        rows = pack_reduce_scatter_input(list(grads), pg.size(), None, flags)  # [K, n]
        work = collectives.all_reduce_sum(rows, pg, async_op=True, what=f"{self.name} [{dtype}]")
        return PendingReduce(work, None, rows[pg.rank()], params, plan.offsets, used=used)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        return 0  # a fresh input, outside the pool


def _train(rank: int, world_size: int) -> dict:
    path = AllReduceRows()
    # the one row: every sharded reduction that no earlier row (whole, owner, qgZ, invariant) takes
    with choose.REDUCE_RULES.add(lambda facts: True, path, before="custom reduce-scatter"):
        torch.manual_seed(0)
        model = TinyNet()  # Embedding(5, 6), Linear(6, 13): uneven shards on 2 ranks
        if world_size:
            for block in model.blocks:
                perparam.fully_shard(block)
            perparam.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        with CommCounter() as comm:
            train_steps(model, opt, make_batches(3, 4), rank, world_size)
    return {"params": full_params(model), "issued": path.issued, "comm": comm.by_kind()}


def test_a_reduction_path_added_by_one_row_trains_as_one_process():
    want = one_process(_train)
    for got in run_distributed(_train, 2):
        assert got["issued"] == 3 * 3  # 3 groups x 3 steps: every reduction went through the new path
        assert got["comm"].get("all_reduce") == 9 and "reduce_scatter" not in got["comm"]
        for name, w in want["params"].items():
            torch.testing.assert_close(got["params"][name], w, rtol=1e-5, atol=1e-5, msg=name)
    assert want["issued"] == 0  # one process: nothing to reduce
    assert all(path.name != "all-reduce rows" for _, path in choose.REDUCE_RULES)  # it left with the block
