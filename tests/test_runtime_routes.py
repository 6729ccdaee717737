"""Every route through forward and backward reduces each gradient exactly once: checkpointing inside a
sharded unit, accumulation across groups without sync, the manual unshard path, second-order gradients,
backward prefetching that follows the real order, a shared submodule's error, empty stored-quantized
shards, and exceptions in flight."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import perparam
from perparam.runtime.group import group_of
from perparam.runtime.state import TrainingState
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, local_slice, make_batches


def _full(t):
    return None if t is None else (t.full_tensor() if isinstance(t, DTensor) else t.detach().clone())


def _grads(model: nn.Module) -> dict:
    return {n: _full(p.grad) for n, p in model.named_parameters()}


def _assert_grads(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert (got[name] is None) == (g is None), name
        if g is not None:
            torch.testing.assert_close(got[name], g, atol=atol, rtol=0, msg=name)


# -- activation checkpointing of a submodule inside a sharded unit -------------------------------------
class Wrap(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.how = how
        if how == "checkpoint_wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.lin = checkpoint_wrapper(self.lin)

    def forward(self, x):
        if self.how == "checkpoint":
            return checkpoint(self.lin, x, use_reentrant=False)
        return self.lin(x)


def checkpoint_inside(rank: int, world_size: int, how: str, dtype) -> dict:
    torch.manual_seed(0)
    wrap = Wrap(how)
    x = torch.randn(2, 8, requires_grad=True)
    if world_size:
        mp = perparam.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        perparam.fully_shard(wrap, mp_policy=mp)
    elif dtype != torch.float32:
        wrap.to(dtype)
    out = wrap(x.to(dtype) if not world_size else x)
    (out.float() ** 2).mean().backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad).float()
             for n, p in wrap.named_parameters()}
    return {"grads": grads, "x": x.grad.clone()}


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpointing_a_submodule_inside_a_sharded_unit_matches_no_checkpointing(how, dtype):
    want = one_process(checkpoint_inside, "none", dtype)
    for world in (1, 2):
        for got in run_distributed(checkpoint_inside, world, how, dtype):
            if world == 1 and dtype == torch.float32:  # one rank: no reduction, bit-exact
                _assert_grads(got["grads"], want["grads"], atol=0)
            tol = 0 if dtype == torch.float32 and world == 1 else (1e-6 if dtype == torch.float32 else 2e-2)
            _assert_grads(got["grads"], want["grads"], atol=tol)
            torch.testing.assert_close(got["x"], want["x"], atol=tol, rtol=0)


# -- gradient accumulation across groups without sync --------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        x = self.a(x)
        return self.b(x) if use_b else x


def accumulate_across_groups(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    net = Net()
    xs = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1))
    if world_size:
        perparam.fully_shard(net.b)
        perparam.fully_shard(net)
        xs = xs.chunk(world_size, dim=1)[rank]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = {}
    for step in range(2):
        if world_size:
            net.set_requires_gradient_sync(False)
        net(xs[0], True).square().mean().backward()
        if world_size:
            net.set_requires_gradient_sync(True)
        net(xs[1], False).square().mean().backward()
        out[f"step{step}"] = _grads(net)
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _full(p) for n, p in net.named_parameters()}
    return out


def test_accumulation_without_sync_is_reduced_at_the_next_sync_even_if_the_group_is_unused():
    want = one_process(accumulate_across_groups)
    assert want["step0"]["b.weight"] is not None
    for world in (1, 2):
        for got in run_distributed(accumulate_across_groups, world):
            for key in ("step0", "step1", "params"):
                _assert_grads(got[key], want[key], atol=1e-6)


# -- the manual path: unshard(), a method other than forward, backward, reshard() ------------------------
class WithMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def score(self, x):
        return self.fc(x).tanh().sum()


def manual_path(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = WithMethod()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    if not world_size:
        model.score(x).backward()
        return {"first": _grads(model), "second": _grads(model)}
    perparam.fully_shard(model)
    x = x.chunk(world_size)[rank]
    model.unshard()
    model.score(x).backward()
    model.reshard()
    first = _grads(model)
    model.zero_grad()
    model.unshard()
    model.score(x).backward()
    model.reshard()
    return {"first": first, "second": _grads(model),
            "sharded": all(isinstance(p, DTensor) for p in model.parameters())}


@pytest.mark.fast
def test_the_manual_unshard_path_reduces_gradients_exactly_once():
    want = one_process(manual_path)
    for got in run_distributed(manual_path, 2):
        assert got["sharded"]
        # each rank's loss is a sum over its half: the mean over ranks is half the full-batch gradient
        half = {n: g / 2 for n, g in want["first"].items()}
        _assert_grads(got["first"], half)
        _assert_grads(got["second"], half)  # nothing leaked from the first step


# -- second-order gradients, torch.func ---------------------------------------------------------------
def gradient_penalty(rank: int, world_size: int, keep: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    if world_size:
        perparam.fully_shard(model[0])
        perparam.fully_shard(model)
        if keep:
            model.set_reshard_after_backward(False)
        x = x.chunk(world_size)[rank]
    x.requires_grad_(True)
    out = model(x).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    gx.square().sum().backward()
    grads = _grads(model)
    if world_size:
        alive = [group_of(m).storage_alive for m in (model[0], model)]
        model.reshard()
        model[0].reshard()
        grads["alive_after"] = torch.tensor([float(a) for a in alive])
    return grads


@pytest.mark.parametrize("keep", [False, True], ids=["default", "reshard_after_backward_false"])
def test_a_gradient_penalty_through_a_sharded_model_matches_the_unsharded_one(keep):
    want = one_process(gradient_penalty, keep)
    for got in run_distributed(gradient_penalty, 2, keep):
        alive = got.pop("alive_after")
        _assert_grads(got, {n: None if g is None else g / 2 for n, g in want.items()}, atol=1e-6)
        assert alive.tolist() == ([1.0, 1.0] if keep else [0.0, 0.0])


def func_transform(rank: int, world_size: int) -> str:
    model = nn.Linear(2, 2)
    perparam.fully_shard(model)
    try:
        torch.func.jvp(model, (torch.ones(1, 2),), (torch.ones(1, 2),))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_torch_func_transforms_get_a_clear_error():
    for message in run_distributed(func_transform, 1):
        assert "torch.func transform" in message and "Jvp" in message and "[Linear]" in message


# -- backward prefetch follows the real order ----------------------------------------------------------
class RootAfterChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.child(x)))  # the root's own head runs after the child


def prefetch_counts(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = RootAfterChild()
    perparam.fully_shard(model.child)
    perparam.fully_shard(model)
    counts = []
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        model(x).sum()  # a forward without backward first must not confuse the order either
        loss = model(x).sum()
        with perparam.CommCounter() as comm:
            loss.backward()
        counts.append(comm.count("all_gather"))
    return counts


def test_backward_prefetch_never_gathers_a_group_whose_backward_is_done():
    for counts in run_distributed(prefetch_counts, 2):
        assert counts == [1, 1, 1]  # the child again; the root kept its parameters


# -- a shared submodule sharded by two calls -----------------------------------------------------------
def shared_submodule(rank: int, world_size: int, remedy: str) -> dict:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), shared)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(4))
    if remedy == "reference":
        (a(x).sum() + b(x).sum()).backward()
        return {"grad": _full(shared.weight.grad)}
    if remedy == "error":
        perparam.fully_shard(a)
        try:
            perparam.fully_shard(b)
        except perparam.ShardingError as e:
            return {"message": str(e)}
        return {"message": "no error"}
    if remedy == "list":
        perparam.fully_shard([a, b])
    else:
        perparam.fully_shard(shared)
        perparam.fully_shard(a)
        perparam.fully_shard(b)
    (a(x).sum() + b(x).sum()).backward()
    return {"grad": _full(shared.weight.grad)}


def test_a_submodule_shared_by_two_calls_is_refused_with_the_remedies_that_work():
    (out,) = run_distributed(shared_submodule, 1, "error")
    message = out["message"]
    assert "shared" in message and "Sequential" in message and "'0.weight'" in message
    assert "bottom-up" not in message and "fully_shard([" in message
    want = one_process(shared_submodule, "reference")["grad"]
    for remedy in ("list", "shard_shared_first"):
        for got in run_distributed(shared_submodule, 2, remedy):
            torch.testing.assert_close(got["grad"], want, atol=1e-6, rtol=0)


# -- stored quantization on a rank whose shard is empty ------------------------------------------------
def empty_stored_quantized(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    lin = nn.Linear(6, 2, bias=False)
    want = lin(torch.ones(1, 6)).detach()
    policy = perparam.ParamPolicy(requires_grad=False,
                                  quant=perparam.QuantPolicy(torch.int8, block_size=4, store_quantized=True))
    perparam.fully_shard(lin, param_policy={"weight": policy})
    got = lin(torch.ones(1, 6)).detach()
    return {"codes": tuple(lin.weight.to_local().shape), "dtype": lin.weight.dtype,
            "scales": tuple(lin.weight_qscale.to_local().shape), "err": (got - want).abs().max().item()}


def test_stored_quantization_handles_an_empty_shard():
    outs = run_distributed(empty_stored_quantized, 3)
    assert [o["codes"] for o in outs] == [(1, 6), (1, 6), (0, 6)]
    assert [o["scales"] for o in outs] == [(1, 2), (1, 2), (0, 2)]
    assert all(o["dtype"] == torch.int8 and o["err"] < 0.05 for o in outs)


# -- exceptions in flight ------------------------------------------------------------------------------
class Boom(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("boom in backward")
        return g


class Fragile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()
        self.raise_in_forward = False

    def forward(self, idx):
        x = self.net.embed(idx).mean(dim=1)
        x = self.net.blocks[0](x)
        x = Boom.apply(x)  # raises in backward between the two blocks' backwards when armed
        if self.raise_in_forward:
            raise RuntimeError("boom in forward")
        return self.net.head(self.net.blocks[1](x))


def errors_in_flight(rank: int, world_size: int, reset: str | None) -> dict:
    torch.manual_seed(0)
    model = Fragile()
    batches = make_batches(6, 4)
    if world_size:
        for block in model.net.blocks:
            perparam.fully_shard(block)
        perparam.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(batches):
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        model.raise_in_forward, Boom.armed = step == 1, step == 3
        try:
            loss = F.mse_loss(model(x), y)
            loss.backward()
        except RuntimeError as e:
            assert "boom" in str(e)
            if reset and world_size:
                getattr(model, reset)()  # reset() or FSDP2's name for it, reset_iter_state()
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.raise_in_forward = Boom.armed = False
    states = [group_of(m).state for m in model.modules() if group_of(m) is not None] if world_size else []
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()},
            "idle": all(s is TrainingState.IDLE for s in states)}


@pytest.mark.parametrize("reset", [None, "reset", "reset_iter_state"],
                         ids=["next_forward_resets", "module_reset", "module_reset_iter_state"])
def test_an_exception_in_forward_or_backward_leaves_the_model_training_to_parity(reset):
    want = one_process(errors_in_flight, reset)
    assert len(want["losses"]) == 4
    for world in (1, 2):
        for got in run_distributed(errors_in_flight, world, reset):
            assert got["idle"]
            # the losses are per rank on its half: compare the parameters, which see the global batch
            for name, value in want["params"].items():
                torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=0, msg=name)
    dist.is_available()
