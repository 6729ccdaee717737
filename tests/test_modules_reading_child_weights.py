"""Modules that read a sharded module's parameters without calling it: refused at fully_shard where torch's
own module is known to (MultiheadAttention's out_proj), named with the fix at run time otherwise; a
MultiheadAttention sharded whole matches one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import perparam
from perparam import ShardingError, UsedWhileShardedError
from tests.distributed import run_distributed
from tests.models import local_slice


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)  # 2 rows: empty shards on 3 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, tokens, 4] -> [batch, 2]
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(dim=1))


def shard_every_linear(rank: int, world: int, parent: str) -> tuple[str, str]:
    torch.manual_seed(0)
    model = Attention() if parent == "MultiheadAttention" else nn.Sequential(nn.LinearCrossEntropyLoss(4, 3))
    for module in list(model.modules()):
        if type(module) in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear):
            perparam.fully_shard(module)
    try:
        perparam.fully_shard(model)
    except ShardingError as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.fast
@pytest.mark.parametrize("parent", ["MultiheadAttention", "LinearCrossEntropyLoss"])
def test_sharding_a_child_its_stock_parent_reads_directly_is_refused_at_fully_shard(parent):
    if not hasattr(nn, parent):
        pytest.skip(f"this torch has no nn.{parent}")
    kind, message = run_distributed(shard_every_linear, 2, parent)[0]
    child = "attn.out_proj" if parent == "MultiheadAttention" else "0.linear"
    assert kind == "ShardingError", message
    assert f"'{child}'" in message and parent in message and "whole" in message, message


class TiedHead(nn.Module):
    """Weight tying by reading the embedding's weight in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.body = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(self.body(self.embed(idx)), self.embed.weight)


class ReadsHead(nn.Module):
    """User code reading a child's weight instead of calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.body(x)), self.head.weight)


def read_outside(rank: int, world: int, case: str) -> tuple[str, str]:
    torch.manual_seed(0)
    if case == "tied":
        model, x = TiedHead(), torch.tensor([[1, 2]])
        perparam.fully_shard(model.embed)
    else:
        model, x = ReadsHead(), torch.randn(2, 4)
        perparam.fully_shard(model.head)
    perparam.fully_shard(model)
    try:
        model(x).sum().backward()
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("case,param,user", [
    ("tied", "'embed.weight' of group 'embed'", "TiedHead.forward"),
    ("reads_head", "'head.weight' of group 'head'", "ReadsHead.forward")])
def test_a_sharded_weight_read_outside_its_groups_forward_is_named_with_the_fix(case, param, user):
    kind, message = run_distributed(read_outside, 2, case)[0]
    assert kind == UsedWhileShardedError.__name__, message
    assert param in message and user in message, message
    assert "fully_shard([module_a, module_b])" in message and "Shard the module that uses it whole" in message


def attention_steps(rank: int, world: int, sharded: bool) -> dict:
    torch.manual_seed(0)
    model = Attention()
    if sharded:
        perparam.fully_shard(model.attn)
        perparam.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(6, 3, 4, generator=g), torch.randn(6, 2, generator=g)
        if sharded:
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():  # MultiheadAttention's inference fast path, on the gathered parameters
        out = model(torch.randn(2, 3, 4, generator=g))
    return {"params": {n: (p.full_tensor() if sharded else p).detach() for n, p in model.named_parameters()},
            "eval": out}


@pytest.mark.parametrize("world", [3])
def test_multihead_attention_sharded_whole_matches_one_process(world):
    ref = attention_steps(0, 1, False)
    got = run_distributed(attention_steps, world, True)[0]
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-5, msg=name)
    torch.testing.assert_close(got["eval"], ref["eval"], rtol=0, atol=1e-5)


class Predicts(nn.Module):
    """A root whose own parameters (``b``) are used by its forward, and a method of its own that calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 2)  # 2 rows: an empty shard on 3 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, 3] -> [batch, 2]
        return self.b(torch.relu(self.a(x)))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class CallsChildForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Predicts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(x)


def forward_without_hooks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = CallsChildForward()
    perparam.fully_shard(model.inner.a)
    perparam.fully_shard(model.inner)
    perparam.fully_shard(model)
    inner, x, out = model.inner, torch.randn(4, 3), {}
    bound = inner.forward
    for case, call in (("forward", lambda: inner.forward(x)), ("bound", lambda: bound(x)),
                       ("method", lambda: inner.predict(x)), ("child", lambda: model(x))):
        try:
            call()
            out[case] = ("no error", "")
        except RuntimeError as e:
            out[case] = (type(e).__name__, str(e))
    inner(x).sum().backward()  # the model works on after each refusal
    out["signature"] = str(__import__("inspect").signature(inner.forward))
    return out


def test_a_sharded_modules_forward_called_directly_is_named_with_both_fixes():
    got = run_distributed(forward_without_hooks, 3)[0]
    # what Hugging Face's signature readers see: the class's own
    assert got.pop("signature") == str(__import__("inspect").signature(Predicts().forward))
    for case, (kind, message) in got.items():
        assert kind == UsedWhileShardedError.__name__, (case, message)
        assert "Predicts.forward was called directly" in message and "model(x)" in message, (case, message)
        assert "perparam.register_forward_method(model, " in message, (case, message)
    assert "by Predicts.predict" in got["method"][1] and "'predict')" in got["method"][1]
    assert "by CallsChildForward.forward" in got["child"][1]
