"""``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` (FSDP2's names): the listed
all-gathers are issued right after the module's own, instead of the recorded order's one group ahead; the
collectives stay the same in number and on every rank, and training is bitwise the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam import CommCounter
from tests.distributed import run_distributed


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    # 5, 6, 7 and 1 rows on 2 ranks: uneven, and the last leaves rank 1 an empty shard
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 6), nn.Linear(6, 7), nn.Linear(7, 1))
    for layer in model:
        perparam.fully_shard(layer)
    perparam.fully_shard(model)
    return model


def _timeline(model: nn.Sequential, explicit: bool, rank: int) -> tuple[list[list[str]], dict]:
    """Per step: the all-gathers (``AG<layer>``) and reduce-scatters (``RS``) in issue order, with
    ``c<layer>`` where each layer's forward starts computing; and the parameters after two SGD steps."""
    sizes = {}
    for i, layer in enumerate(model):  # which layer an all-gather belongs to, by its bytes
        with CommCounter() as comm:
            layer.unshard()
            layer.reshard()
        sizes[comm.records[0].nbytes] = i
    if explicit:
        model.set_modules_to_forward_prefetch([model[0], model[1]])
        model[1].set_modules_to_forward_prefetch([model[2], model[3]])
        model[3].set_modules_to_backward_prefetch([model[2], model[1]])
    events: list[str] = []
    with CommCounter() as comm:
        for i, layer in enumerate(model):
            layer.register_forward_pre_hook(lambda m, a, i=i: events.append((len(comm.records), f"c{i}")))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for step in range(2):
            events.clear()
            comm.clear()
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            F.mse_loss(model(x), torch.zeros(2, 1)).backward()
            opt.step()
            opt.zero_grad()
            names = [f"AG{sizes[r.nbytes]}" if r.kind == "all_gather" else "RS" for r in comm.records]
            for pos, label in reversed(events):
                names.insert(pos, label)
            steps.append(names)
    return steps, {n: p.full_tensor() for n, p in model.named_parameters() if isinstance(p, DTensor)}


def default_and_explicit(rank: int, world_size: int) -> tuple:
    return _timeline(_layers(), False, rank), _timeline(_layers(), True, rank)


def test_explicit_prefetch_issues_listed_all_gathers_after_the_modules_own_and_trains_bitwise_the_same():
    for (default, default_params), (explicit, explicit_params) in run_distributed(default_and_explicit, 2):
        fwd = ["AG0", "c0", "AG1", "c1", "AG2", "c2", "AG3", "c3"]  # first step: no recorded order yet
        bwd = ["AG3", "AG2", "RS", "AG1", "RS", "AG0", "RS", "RS"]  # one group ahead, reverse forward order
        assert default == [fwd + bwd, ["AG0", "AG1", "c0", "AG2", "c1", "AG3", "c2", "c3"] + bwd]
        # root -> [0, 1] and 1 -> [2, 3] from the first step; in backward 3 -> [2, 1], then one ahead again
        explicit_fwd = ["AG0", "AG1", "c0", "AG2", "AG3", "c1", "c2", "c3"]
        assert explicit == [explicit_fwd + ["AG3", "AG2", "AG1", "RS", "RS", "AG0", "RS", "RS"]] * 2
        for name, value in default_params.items():
            assert torch.equal(explicit_params[name], value), name


class Branches(nn.Module):
    """``stem`` feeds ``left`` and ``right``; each rank's loss uses one branch only."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.left, self.right = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 3)

    def forward(self, x):
        h = self.stem(x)
        return self.left(h), self.right(h)


def branch_used_by_one_rank(rank: int, world_size: int, explicit: bool) -> tuple[dict, list[int]]:
    torch.manual_seed(0)
    model = Branches()
    for m in (model.stem, model.left, model.right):
        perparam.fully_shard(m)
    perparam.fully_shard(model)
    if explicit:  # right's backward runs on rank 1 only: rank 0 must still issue stem's all-gather there
        model.right.set_modules_to_backward_prefetch([model.stem])
    with CommCounter() as comm:
        for _ in range(2):
            left, right = model(torch.ones(2, 3))
            (left.sum() if rank == 0 else right.sum()).backward()
    gathers = [r.nbytes for r in comm.records if r.kind == "all_gather"]  # bytes tell the groups apart
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}, gathers


def branch_default_and_explicit(rank: int, world_size: int) -> tuple:
    return branch_used_by_one_rank(rank, world_size, False), branch_used_by_one_rank(rank, world_size, True)


def test_explicit_backward_prefetch_of_a_branch_one_rank_skips_keeps_the_ranks_all_gathers_in_step():
    default, explicit = zip(*run_distributed(branch_default_and_explicit, 2))
    assert explicit[0][1] == explicit[1][1]  # the same all-gathers in the same order on both ranks
    assert explicit[0][1] != default[0][1] and sorted(explicit[0][1]) == sorted(default[0][1])
    for (grads, _), (ref_grads, _) in zip(explicit, default):
        for name, value in ref_grads.items():
            assert torch.equal(grads[name], value), name


def not_sharded_entry(rank: int, world_size: int) -> list[str]:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    perparam.fully_shard(model[0])
    perparam.fully_shard(model)
    other = perparam.fully_shard(nn.Linear(2, 2))
    messages = []
    for call in (lambda: model.set_modules_to_forward_prefetch([model[0], model[1]]),
                 lambda: model.set_modules_to_backward_prefetch(model[0])):
        with pytest.raises(perparam.ShardingError) as e:
            call()
        messages.append(str(e.value))
    model.set_modules_to_forward_prefetch([other])
    with pytest.raises(perparam.PrefetchError) as e:
        model(torch.ones(1, 2))
    return [*messages, str(e.value)]


@pytest.mark.fast
def test_a_prefetch_list_with_an_unsharded_or_foreign_module_is_refused_naming_it():
    (messages,) = run_distributed(not_sharded_entry, 1)
    assert "entry 1 (Linear) is not a module fully_shard was applied to" in messages[0]
    assert "takes a list of sharded modules, got Linear" in messages[1]
    assert "lists [Linear] (weight, bias), which is not sharded inside the model" in messages[2]
