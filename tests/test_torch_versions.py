"""perparam on the older torch it supports: where ``torch.distributed`` lacks 2.13's ``all_gather_single`` /
``reduce_scatter_single`` (torch 2.11, 2.12), the older ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
are chosen once and every all-gather and reduce-scatter goes through them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import perparam
from perparam import CommCounter
from perparam.comm import c10d
from tests.distributed import run_distributed
from tests.models import TinyNet, full_params, make_batches, train_steps

pytestmark = pytest.mark.fast

NEW, OLD = ("all_gather_single", "reduce_scatter_single"), ("all_gather_into_tensor", "reduce_scatter_tensor")


def _steps_on_the_older_names(rank: int, world_size: int) -> dict:
    # torch 2.11 as far as perparam can tell: the new names are gone from torch.distributed
    for name in NEW:
        delattr(dist, name)
    chosen = c10d.choose()
    calls = dict.fromkeys(OLD, 0)

    def counting(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for name in OLD:
        setattr(dist, name, counting(name, getattr(dist, name)))
    perparam.configure(gloo_all_gather="native", gloo_reduce_scatter="native")  # c10d's own collectives
    torch.manual_seed(0)
    model = TinyNet(n_blocks=2)
    reference = copy.deepcopy(model)
    for block in model.blocks:
        perparam.fully_shard(block)
    perparam.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = make_batches(3, 12)  # 12: equal shares on 2 and 3 ranks
    with warnings.catch_warnings(), CommCounter() as comm:
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates the older names
        train_steps(model, opt, batches, rank, world_size)
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, 0, 0)
    got, want = full_params(model), dict(reference.named_parameters())
    return {"chosen": chosen, "calls": calls, "counted": comm.by_kind(),
            "err": max((got[n] - want[n]).abs().max().item() for n in want)}


def test_without_torch_2_13_names_the_older_c10d_names_run_every_collective_with_parity():
    for world in (2, 3):
        for r in run_distributed(_steps_on_the_older_names, world):
            assert r["chosen"] == {"all_gather": OLD[0], "reduce_scatter": OLD[1]}
            # every collective perparam counted went through the older names: none hidden, none elsewhere
            assert r["calls"] == {OLD[0]: r["counted"]["all_gather"], OLD[1]: r["counted"]["reduce_scatter"]}
            assert r["calls"][OLD[0]] > 0 and r["calls"][OLD[1]] > 0
            assert r["err"] < 1e-5, r


def test_the_new_c10d_names_are_chosen_where_torch_has_them():
    assert c10d.choose() == {"all_gather": NEW[0], "reduce_scatter": NEW[1]}
    assert c10d.choose(prefer_old=True) == {"all_gather": OLD[0], "reduce_scatter": OLD[1]}
    c10d.choose()
