"""Collective counts: one all-gather per group per unshard, one reduce-scatter per group per backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import perparam
from perparam import CommCounter
from perparam.runtime.group import group_of
from tests.distributed import c10d_calls, run_distributed
from tests.models import (
    TinyNet,
    comm_per_micro_batch,
    local_slice,
    make_batches,
    shard_blocks_then_root,
    sharded_tiny,
)


def count_one_step(rank: int, world_size: int, reshard_after_forward: bool | None) -> dict:
    model = sharded_tiny(n_blocks=3, reshard_after_forward=reshard_after_forward)
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 8)[0])
    F.mse_loss(model(x), y).backward()  # a first step: from the second on, the next group is prefetched
    with c10d_calls() as raw:  # at the c10d level too, so the counter cannot hide a collective
        with CommCounter() as fwd:
            loss = F.mse_loss(model(x), y)
        with CommCounter() as bwd:
            loss.backward()
    # the zero-copy all-gather (K = 2, no empty shard): per parameter one send and one receive
    sizes = {"root": len(group_of(model).own.gathered), "block": len(group_of(model.blocks[0]).own.gathered),
             # the zero-copy reduce-scatter: per trainable parameter and its used flags one send and one
             # receive
             "reduced": sum(len(group_of(m).trainable()) + 1 for m in (model, *model.blocks))}
    return {"fwd": fwd.by_kind(), "bwd": bwd.by_kind(), "raw": raw, "gathered": sizes}


@pytest.mark.fast
def test_one_all_gather_per_group_and_one_reduce_scatter_per_group():
    # 4 groups: 3 blocks + root. Forward: 4 all-gathers. Backward: the 3 blocks gather again (the root
    # keeps its parameters for the backward that follows), 4 reduce-scatters.
    for counts in run_distributed(count_one_step, 2, None):
        assert counts["fwd"] == {"all_gather": 4}
        assert counts["bwd"] == {"all_gather": 3, "reduce_scatter": 4}
        # on gloo (zero-copy, perparam.comm.collectives) each all-gather is per parameter one send to the peer
        # and one receive into the parameter: the root's parameters once, each block's twice; each
        # reduce-scatter per parameter (and its used flags) one send and one receive; nothing else
        p2p = counts["gathered"]["root"] + 2 * 3 * counts["gathered"]["block"] + counts["gathered"]["reduced"]
        assert counts["raw"] == {"all_gather_single": 0, "reduce_scatter_single": 0, "all_to_all_single": 0,
                                 "all_reduce": 0, "send": p2p, "recv": p2p}


def test_an_explicit_reshard_after_forward_frees_the_root_too_one_all_gather_more_per_step():
    # asked for explicitly, the root frees after forward and gathers again in backward (FSDP2's rule);
    # left to the default (None, the test above) it keeps its parameters: 3 backward all-gathers
    for counts in run_distributed(count_one_step, 2, True):
        assert counts["fwd"] == {"all_gather": 4}
        assert counts["bwd"] == {"all_gather": 4, "reduce_scatter": 4}


def root_set_to_reshard(rank: int, world_size: int, value) -> int:
    model = sharded_tiny(n_blocks=3)
    model.set_reshard_after_forward(value, recurse=False)
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 8)[0])
    F.mse_loss(model(x), y).backward()
    with CommCounter() as step:
        F.mse_loss(model(x), y).backward()
    return step.count("all_gather")


def test_set_reshard_after_forward_true_on_the_root_is_honoured_and_none_restores_the_default():
    # 4 in forward; backward: 3 blocks, plus the root when True was set (None: fully_shard's default)
    assert run_distributed(root_set_to_reshard, 2, True) == [8, 8]
    assert run_distributed(root_set_to_reshard, 2, None) == [7, 7]


def test_no_reshard_after_forward_gathers_once_per_step():
    for counts in run_distributed(count_one_step, 3, False):
        assert counts["fwd"] == {"all_gather": 4}
        assert counts["bwd"] == {"reduce_scatter": 4}


def accumulate_counts(rank: int, world_size: int) -> list[dict]:
    model = sharded_tiny()
    return comm_per_micro_batch(model, rank, world_size)


def test_no_sync_micro_batches_do_not_reduce():
    for counts in run_distributed(accumulate_counts, 2):
        assert [c.get("reduce_scatter", 0) for c in counts] == [0, 0, 3]


def step_bytes(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyNet(n_blocks=2)
    groups = [[p.shape for p in block.parameters()] for block in model.blocks]
    groups.append([p.shape for n, p in model.named_parameters() if not n.startswith("blocks.")])
    shard_blocks_then_root(model)
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 6)[0])
    with CommCounter() as comm:
        F.mse_loss(model(x), y).backward()
    return {"groups": groups, "all_gather": comm.bytes("all_gather"),
            "reduce_scatter": comm.bytes("reduce_scatter"), "sizes": {r.group_size for r in comm.records}}


def test_a_zero3_step_moves_exactly_the_layouts_bytes():
    from perparam.sharding.layout import GroupLayout, ShardLayout

    world_size = 3
    out = run_distributed(step_bytes, world_size)[0]
    layouts = [[ShardLayout(tuple(s), torch.float32, world_size) for s in shapes] for shapes in out["groups"]]
    gather = [GroupLayout.plain(ls, [torch.float32] * len(ls)).all_gather_bytes for ls in layouts]
    # forward gathers every group; backward gathers the blocks again (the root kept its parameters)
    assert out["all_gather"] == sum(gather) + sum(gather[:-1])
    # one reduce-scatter per group, over every rank's padded chunk and one used flag per parameter
    assert out["reduce_scatter"] == sum(world_size * (lay.padded_local_numel + 1) * 4 for ls in layouts
                                        for lay in ls)
    assert out["sizes"] == {world_size}


def grouped_step(rank: int, world_size: int) -> dict:
    """TinyNet wrapped as torchtitan wraps a model: a list of modules as one group, a root without
    parameters of its own; one step after a first one (prefetching on). Returns the all-gather sizes in
    forward and backward, and the sharded gradients' full tensors."""
    torch.manual_seed(0)
    model = TinyNet(n_blocks=2)
    perparam.fully_shard([model.embed, model.blocks[0]])
    perparam.fully_shard(model.blocks[1])
    perparam.fully_shard(model.head)
    perparam.fully_shard(model)
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 8)[0])
    F.mse_loss(model(x), y).backward()
    model.zero_grad()
    with CommCounter() as fwd:
        loss = F.mse_loss(model(x), y)
    with CommCounter() as bwd:
        loss.backward()
    sizes = {n: [r.nbytes for r in c.records if r.kind == "all_gather"]
             for n, c in (("fwd", fwd), ("bwd", bwd))}
    return {**sizes, "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


def test_a_list_of_modules_gathers_once_and_a_root_without_parameters_is_not_first_in_backward():
    # groups: [embed, blocks.0], blocks.1, head, and the root (no parameters, no collective). Forward: one
    # all-gather per group with parameters (the list's modules share one); backward: the reverse order
    # (head, blocks.1, [embed, blocks.0]): the first group of the forward is gathered last, not first
    torch.manual_seed(0)
    ref = TinyNet(n_blocks=2)
    x, y = make_batches(1, 8)[0]
    F.mse_loss(ref(x), y).backward()
    for res in run_distributed(grouped_step, 2):
        assert len(res["fwd"]) == 3 and res["bwd"] == res["fwd"][::-1]
        for name, p in ref.named_parameters():
            torch.testing.assert_close(res["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


def accumulate(rank: int, world_size: int, lib: str, variant: str, raf: bool | None) -> dict:
    """3 steps of 3 micro-batches without sync but the last, SGD; ``variant``: ``set_reshard_after_backward``
    ``"always"`` True, ``"last"`` only for the last micro-batch (FSDP2's pattern), ``"never"``. All-gathers
    per step: ``CommCounter``'s for perparam, the c10d calls for torch's FSDP2 (``lib == "fsdp2"``)."""
    from tests.models import full_params

    if lib == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = perparam.fully_shard
    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=raf)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gathers = []
    for step in range(3):
        with c10d_calls() as raw, CommCounter() as comm:
            batches = make_batches(3, 6, seed=step)
            for i, (x, y) in enumerate(batches):
                last = i == len(batches) - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward({"always": True, "last": last, "never": False}[variant])
                F.mse_loss(model(local_slice(x, rank, world_size)),
                           local_slice(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
        gathers.append(raw["all_gather_single"] if lib == "fsdp2" else comm.by_kind().get("all_gather", 0))
    return {"gathers": gathers, "params": full_params(model)}


@pytest.mark.parametrize("raf", [None, False])
def test_reshard_after_backward_off_but_for_the_last_micro_batch_gathers_no_more_than_fsdp2(raf):
    fsdp2 = run_distributed(accumulate, 3, "fsdp2", "last", raf)[0]
    got = {v: run_distributed(accumulate, 3, "perparam", v, raf)[0] for v in ("always", "last", "never")}
    # perparam's measured: 9 per step (raf None: 3 forward + 2 backward, then 2 + 2), 3 with raf=False
    assert got["last"]["gathers"] == fsdp2["gathers"] == [9 if raf is None else 3] * 3, (got["last"], fsdp2)
    # never resharding: gathered again after each optimizer step (FSDP2 computes with its pre-step copies)
    assert got["never"]["gathers"] == [9 if raf is None else 3] * 3, got["never"]["gathers"]
    for variant in ("last", "never"):  # the same training as resharding after every backward, bit for bit
        for name, value in got["always"]["params"].items():
            assert torch.equal(got[variant]["params"][name], value), (variant, name)
