"""Evaluation on a sharded model when the ranks run different numbers of no-grad batches: with the
parameters gathered once and kept (``perparam.finetune.evaluation``, the recipe of docs/evaluation.md) it
finishes, with the results of one process. (docs/evaluation.md's snippet runs in
tests/test_readme_snippets.py with every page's.)"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.distributed import run_distributed
from tests.models import TinyNet, sharded_tiny

#: no-grad batches per rank: unequal, and one rank with none (3 ranks: the 5-row embedding and the
#: 2-row head leave rank 2 with empty shards)
BATCHES = {2: [3, 5], 3: [3, 5, 0]}


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 5, (2, 3), generator=g) for _ in range(n)]  # [batch, tokens] each


def _unequal_eval_rank(rank: int, world: int) -> dict:
    import perparam
    from perparam.finetune.evaluation import parameters_kept_gathered

    model = sharded_tiny(d=4)
    counts = BATCHES[world]
    first = sum(counts[:rank])
    mine = _batches(sum(counts))[first:first + counts[rank]]
    with perparam.CommCounter() as comm, parameters_kept_gathered(model), torch.no_grad():
        outputs = [model(x) for x in mine]  # [2, 2] each
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"outputs": outputs, "all_gathers": comm.count("all_gather"), "sharded": sharded}


@pytest.mark.fast
def test_unequal_no_grad_batches_finish_with_the_results_of_one_process():
    torch.manual_seed(0)
    reference = TinyNet(d=4)
    for world, counts in BATCHES.items():
        with torch.no_grad():
            want = [reference(x) for x in _batches(sum(counts))]
        results = run_distributed(_unequal_eval_rank, world, timeout=60)
        got = [y for r in results for y in r["outputs"]]  # the ranks' batches, in order
        assert len(got) == len(want)
        assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(got, want, strict=True)), world
        # every group gathered once, on every rank (the empty one included); resharded at the end
        assert [r["all_gathers"] for r in results] == [3] * world and all(r["sharded"] for r in results)


def _heldout_rank(rank: int, world: int, rows: torch.Tensor, counts: list[int]) -> float:
    from perparam.finetune.evaluation import heldout_loss
    from perparam.finetune.model import Llama, LlamaConfig
    from perparam.finetune.train import build_meshes, shard_model

    torch.manual_seed(0)
    model = shard_model(Llama(LlamaConfig.tiny()), build_meshes(world, 1, 1, "cpu"))
    first = sum(counts[:rank])
    return heldout_loss(model, rows[first:first + counts[rank]], torch.device("cpu"), micro_batch=1)


def test_the_jobs_heldout_loss_over_unequal_rows_matches_one_process():
    from perparam.finetune.model import Llama, LlamaConfig, next_token_loss

    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 256, (8, 9), generator=g)  # [rows, seq + 1] tokens
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    with torch.no_grad():
        want = next_token_loss(model(rows[:, :-1]), rows[:, 1:]).item()
    losses = run_distributed(_heldout_rank, 2, rows, [3, 5], timeout=60)
    assert losses[0] == losses[1] and abs(losses[0] - want) < 1e-5, (losses, want)


def _tp_heldout_rank(rank: int, world: int, rows: torch.Tensor) -> float:
    from perparam.finetune.evaluation import heldout_loss
    from perparam.finetune.model import Llama, LlamaConfig
    from perparam.finetune.train import build_meshes, shard_model

    torch.manual_seed(0)
    meshes = build_meshes(world, 1, 2, "cpu")  # tp 2, dp 1: both ranks read every row
    model = shard_model(Llama(LlamaConfig.tiny()), meshes)
    return heldout_loss(model, rows, torch.device("cpu"), micro_batch=2)


@pytest.mark.fast
def test_the_jobs_heldout_loss_under_tensor_parallel_matches_one_process():
    """The ranks of a TP group hold the same rows and the same loss: counting them tp times in the world
    all-reduce multiplies the sum and the token count alike, so the mean stays one process's."""
    from perparam.finetune.model import Llama, LlamaConfig, next_token_loss

    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (4, 9), generator=g)  # [rows, seq + 1] tokens
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    with torch.no_grad():
        want = next_token_loss(model(rows[:, :-1]), rows[:, 1:]).item()
    losses = run_distributed(_tp_heldout_rank, 2, rows, timeout=60)
    assert losses[0] == losses[1] and abs(losses[0] - want) < 1e-5, (losses, want)


def _invariant_heldout_rank(rank: int, world: int, rows: list[torch.Tensor]) -> float:
    import torch.distributed as dist

    from perparam.finetune.invariant_steps import heldout_loss
    from perparam.finetune.model import Llama, LlamaConfig

    groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    return heldout_loss(model, rows[rank], torch.device("cpu"), chunk=1, pieces=2, dp_rank=0, dp_size=1,
                        group=groups[rank])


@pytest.mark.fast
def test_the_invariant_heldout_loss_reduces_over_the_data_parallel_group_only():
    """Two ranks that are not data-parallel peers (each its own dp group of 1, as pipeline stages or
    tensor-parallel ranks beside the dp axis are) evaluate different rows: each gets its own rows' loss,
    not the mean of both (the world all-reduce gave that)."""
    from perparam.finetune.model import Llama, LlamaConfig, next_token_loss

    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 256, (4, 9), generator=g) for _ in range(2)]  # [rows, seq + 1] per rank
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    with torch.no_grad():
        want = [next_token_loss(model(r[:, :-1]), r[:, 1:]).item() for r in rows]
    losses = run_distributed(_invariant_heldout_rank, 2, rows, timeout=60)
    assert all(abs(a - b) < 1e-6 for a, b in zip(losses, want, strict=True)), (losses, want)
