"""FSDP2 habits that work: attributes on parameters, an optimizer built before sharding, reassigned
parameters refused, reshard_after_forward's values, register_forward_method, unshard(async_op=True), and
evaluation forwards that keep the parameters gathered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import perparam
from perparam import CommCounter
from perparam.runtime.group import group_of
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, local_slice, make_batches, shard_blocks_then_root, train_steps


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def optimizer_before_sharding(rank: int, world_size: int, before: bool) -> dict:
    torch.manual_seed(0)
    model = TinyNet()
    for name, p in model.named_parameters():
        p.no_decay = name.endswith("bias")  # a habit for building optimizer groups
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if before else None
    shard_blocks_then_root(model)
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in make_batches(3, 4):
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    return {"params": {n: _full(p) for n, p in model.named_parameters()},
            "no_decay": {n: getattr(p, "no_decay", None) for n, p in model.named_parameters()},
            "in_optimizer": all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])}


@pytest.mark.fast
def test_an_optimizer_built_before_sharding_trains_exactly_like_one_built_after():
    after = run_distributed(optimizer_before_sharding, 2, False)
    before = run_distributed(optimizer_before_sharding, 2, True)
    for a, b in zip(after, before):
        assert b["in_optimizer"]
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name
        # attributes set on the parameters before sharding are on the sharded parameters
        assert b["no_decay"] == {n: n.endswith("bias") for n in a["params"]}


def optimizer_that_stepped(rank: int, world_size: int) -> str:
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    perparam.fully_shard(model)
    model(torch.ones(1, 2)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_an_optimizer_with_state_from_before_sharding_is_refused():
    (message,) = run_distributed(optimizer_that_stepped, 1)
    assert "AdamW holds state" in message and "after fully_shard" in message


def reassigned(rank: int, world_size: int) -> list:
    model = nn.Sequential(nn.Linear(2, 2))
    perparam.fully_shard(model)
    sharded = model[0].weight
    try:  # an assignment is refused at the call, the model unchanged
        model[0].weight = nn.Parameter(torch.zeros(2, 2))
        at_call = "no error"
    except RuntimeError as e:
        at_call = str(e)
    unchanged = model[0].weight is sharded
    model(torch.ones(1, 2))
    # a write no registration hook sees is refused at every forward, never silently put back
    mine = model[0]._parameters["weight"] = nn.Parameter(torch.zeros(2, 2))
    messages = []
    for _ in range(2):
        try:
            model(torch.ones(1, 2))
            messages.append("no error")
        except RuntimeError as e:
            messages.append(str(e))
    return [at_call, unchanged, *messages, model[0].weight is mine]


def test_a_parameter_assigned_after_sharding_is_refused_at_the_call_or_the_next_forward():
    at_call, unchanged, first, second, still_mine = run_distributed(reassigned, 1)[0]
    for message in (at_call, first):
        assert "'0.weight'" in message and "replaced after fully_shard" in message and "copy_" in message
    assert unchanged and second == first and still_mine


def reshard_values(rank: int, world_size: int, value) -> str:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    try:
        perparam.fully_shard(model[0], reshard_after_forward=value)
    except perparam.ShardingError as e:
        return f"error: {e}"
    perparam.fully_shard(model)
    model(torch.ones(1, 2))
    return "kept" if group_of(model[0]).storage_alive else "freed"


@pytest.mark.parametrize(("value", "want"), [(True, "freed"), (False, "kept"), (None, "freed"), (1, "kept"),
                                             (2, "freed"), (3, "error"), (0, "error"), ("yes", "error")])
def test_reshard_after_forward_takes_fsdp2_values(value, want):
    got = run_distributed(reshard_values, 2, value)[0]
    assert got.split(":")[0] == want, got
    if want == "error":
        assert "reshard_after_forward" in got and "True or False" in got


class Generator(nn.Module):
    """A root with one sharded block; ``generate`` runs ``steps`` forwards, feeding each output back."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.block(self.inp(x)))

    def generate(self, x, steps: int):
        outs = []
        for _ in range(steps):
            x = self(x)
            outs.append(x)
        return torch.stack(outs)


def generate(rank: int, world_size: int, keep: bool, async_unshard: bool) -> dict:
    torch.manual_seed(0)
    model = Generator()
    x = torch.ones(1, 4)
    if not world_size:
        with torch.no_grad():
            return {"out": model.generate(x, 5)}
    perparam.fully_shard(model.block)
    perparam.fully_shard(model)
    perparam.register_forward_method(model, "generate")
    if keep:
        model.set_reshard_after_forward(False)
    with CommCounter() as comm, torch.no_grad():
        if async_unshard:
            handle = model.unshard(async_op=True)
            handle.wait()
        out = model.generate(x, 5)
        again = model.generate(x, 5)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"out": out, "again": again, "all_gathers": comm.count("all_gather"), "sharded": sharded}


@pytest.mark.parametrize(("keep", "async_unshard", "gathers"),
                         [(False, False, 2 * (1 + 5)),  # root once per generate, the block per forward
                          (True, False, 2),  # kept across both generates: one all-gather per group
                          (True, True, 2)],  # the async unshard is the root's only all-gather
                         ids=["default", "keep", "async_unshard"])
def test_generate_through_register_forward_method(keep, async_unshard, gathers):
    want = one_process(generate, keep, async_unshard)["out"]
    for got in run_distributed(generate, 2, keep, async_unshard):
        torch.testing.assert_close(got["out"], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(got["again"], want, atol=1e-6, rtol=0)
        assert got["all_gathers"] == gathers and got["sharded"]


def evaluation_then_training(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyNet()
    shard_blocks_then_root(model)
    model.set_reshard_after_forward(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_batches(1, 4)[0]
    with CommCounter() as evals, torch.no_grad():
        first = model(x)
        for _ in range(3):
            model(x)
    with CommCounter() as train:
        F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    with CommCounter() as after_step, torch.no_grad():
        updated = model(x)
        model(x)
    return {"evals": evals.count("all_gather"), "train": train.count("all_gather"),
            "after_step": after_step.count("all_gather"), "first": first, "updated": updated}


def test_evaluation_forwards_keep_parameters_gathered_until_the_next_training_forward():
    for out in run_distributed(evaluation_then_training, 2):
        assert out["evals"] == 3  # one all-gather per group for 4 evaluation forwards
        assert out["train"] == 3  # the training forward gathers afresh; kept into backward
        assert out["after_step"] == 3  # the step changed the shards: gathered again, then kept
        assert not torch.equal(out["first"], out["updated"])


def kept_across_steps(rank: int, world_size: int, foreach: bool) -> list:
    torch.manual_seed(0)
    model = TinyNet()
    if world_size:
        shard_blocks_then_root(model)
        model.set_reshard_after_backward(False)  # kept gathered across the optimizer step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    return train_steps(model, opt, make_batches(3, 4), rank, world_size)


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_parameters_kept_after_backward_are_gathered_again_after_an_optimizer_step(foreach):
    # foreach updates do not bump a DTensor's version counter: the step itself must invalidate them
    want = one_process(kept_across_steps, foreach)
    for got in run_distributed(kept_across_steps, 1, foreach):
        torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-6, rtol=0)


def late_handle_wait(rank: int, world_size: int, case: str) -> dict:
    model = nn.Linear(4, 4)
    perparam.fully_shard(model)
    handle = model.unshard(async_op=True)
    if case == "forward":
        model(torch.ones(2, 4)).sum().backward()
    else:
        model.reshard()
    handle.wait()  # the all-gather was finished by someone else: nothing to do
    handle.wait()
    return {"sharded": isinstance(model.weight, DTensor), "value": model.weight.full_tensor().sum().item()}


@pytest.mark.parametrize("case", ["forward", "reshard"])
def test_a_late_unshard_handle_wait_is_a_no_op(case):
    for out in run_distributed(late_handle_wait, 2, case):
        assert out["sharded"]


def kept_then_updated_by_hand(rank: int, world_size: int, how: str) -> list:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.ones(2, 4)
    if world_size:
        perparam.fully_shard(model)
        model.set_reshard_after_backward(False)
    outs = []
    for _ in range(3):
        out = model(x)
        out.sum().backward()
        outs.append(out.detach())
        with torch.no_grad():
            for p in model.parameters():
                if how == "to_local" and world_size:
                    p.to_local().sub_(0.1 * p.grad.to_local())
                else:
                    p.sub_(0.1 * p.grad)
                p.grad = None
    return outs


@pytest.mark.parametrize("how", ["inplace", "to_local"])
def test_kept_parameters_see_in_place_updates_of_the_shards(how):
    want = one_process(kept_then_updated_by_hand, how)
    for got in run_distributed(kept_then_updated_by_hand, 2, how):
        torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-6, rtol=0)


def between_forward_and_backward(rank: int, world_size: int) -> dict:
    """A loss that reads ``model.parameters()`` between forward and backward (a weight penalty), with
    ``reshard_after_forward=False``: perparam keeps the sharded DTensors registered there (FSDP2 registers
    its unsharded tensors), and ``unshard()`` is the fix that gives the plain gathered tensors."""
    torch.manual_seed(0)
    model = TinyNet()
    x, _ = make_batches(1, 12)[0]
    if world_size:
        shard_blocks_then_root(model, reshard_after_forward=False)
        x = local_slice(x, rank, world_size)
    before = list(model.parameters())
    out = model(x)
    registered = {"same": all(p is q for p, q in zip(model.parameters(), before)),
                  "dtensors": all(isinstance(p, DTensor) for p in model.parameters())}
    with CommCounter() as comm:
        # the fix (docs/fsdp2-differences.md): the gathered storage, kept, is registered
        for m in model.modules():
            if isinstance(m, perparam.ShardedModule):
                m.unshard()
    registered["plain"] = not any(isinstance(p, DTensor) for p in model.parameters())
    (out.mean() + 0.1 * sum(p.pow(2).sum() for p in model.parameters())).backward()
    return {**registered, "unshard_comm": comm.by_kind(),
            "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
            "after": all(isinstance(p, DTensor) for p in model.parameters())}


def test_after_a_forward_kept_unsharded_sharded_parameters_stay_registered_and_unshard_gives_the_gathered():
    want = one_process(between_forward_and_backward)
    for got in run_distributed(between_forward_and_backward, 3):
        assert got["same"] and got["dtensors"] and got["plain"] and got["after"]
        assert got["unshard_comm"] == {}, got["unshard_comm"]  # the storage kept from the forward, registered
        for name, value in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], value, rtol=0, atol=1e-6, msg=name)
