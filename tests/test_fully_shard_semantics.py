"""What fully_shard does to a module: placements, storage release, buffers, meta init, tied weights,
explicit unshard/reshard, gradient clipping."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import perparam
from perparam.runtime.group import group_of
from tests.distributed import one_process, run_distributed
from tests.models import TinyNet, local_slice, make_batches


def placements_and_values(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyNet()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(m) for n, m in model.named_modules()}
    for block in model.blocks:
        assert perparam.fully_shard(block) is block
    assert perparam.fully_shard(model) is model
    out = {"same_modules": ids == {n: id(m) for n, m in model.named_modules()},
           "is_sharded_module": all(isinstance(m, perparam.ShardedModule) for m in [model, *model.blocks]),
           "still_a_tinynet": isinstance(model, TinyNet), "groups": 0, "local_shapes": {}, "exact": True}
    groups = {id(group_of(m)) for m in model.modules() if group_of(m) is not None}
    out["groups"] = len(groups)
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
        assert p.placements == (Shard(0),), name
        out["local_shapes"][name] = tuple(p.to_local().shape)
        out["exact"] &= torch.equal(p.full_tensor(), original[name])
    return out


def test_parameters_become_shard0_dtensors_chunked_like_torch_chunk():
    world_size = 3
    torch.manual_seed(0)
    shapes = {n: p.shape for n, p in TinyNet().named_parameters()}
    for rank, out in enumerate(run_distributed(placements_and_values, world_size)):
        assert out["same_modules"] and out["is_sharded_module"] and out["still_a_tinynet"] and out["exact"]
        assert out["groups"] == 3  # two blocks + the root's embed/head
        for name, shape in shapes.items():
            chunks = torch.empty(shape).chunk(world_size)
            want = tuple(chunks[rank].shape) if rank < len(chunks) else (0, *shape[1:])
            assert out["local_shapes"][name] == want, name


def storage_is_released(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyNet()
    model.register_buffer("counts", torch.arange(3.0))
    for block in model.blocks:
        perparam.fully_shard(block)
    perparam.fully_shard(model)
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 4)[0])
    loss = F.mse_loss(model(x), y)
    freed_after_forward = [p.storage_alive for b in model.blocks for p in group_of(b).params]
    root_kept = [p.storage_alive for p in group_of(model).params]
    loss.backward()
    freed_after_backward = [p.storage_alive for m in model.modules() if group_of(m)
                            for p in group_of(m).params]
    return {"after_forward": freed_after_forward, "root_kept": root_kept,
            "after_backward": freed_after_backward, "buffer": model.counts.clone(),
            "buffer_is_dtensor": isinstance(model.counts, DTensor)}


def test_unsharded_storage_is_really_released():
    for out in run_distributed(storage_is_released, 2):
        assert not any(out["after_forward"]), "blocks must free their unsharded storage after forward"
        assert all(out["root_kept"]), "the root keeps its storage for the backward that follows"
        assert not any(out["after_backward"])
        assert torch.equal(out["buffer"], torch.arange(3.0)) and not out["buffer_is_dtensor"]


def meta_init(rank: int, world_size: int) -> dict:
    with torch.device("meta"):
        model = TinyNet()
    for block in model.blocks:
        perparam.fully_shard(block)
    perparam.fully_shard(model)
    on_meta = all(p.to_local().is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():  # initialise shard by shard, from the global index
        local = p.to_local()
        start = rank * -(-p.shape[0] // world_size)
        with torch.no_grad():
            rows = torch.arange(start, start + local.shape[0], dtype=torch.float32)
            local.copy_(rows.view(-1, *[1] * (local.dim() - 1)).expand_as(local) + 0.5 * len(name))
    x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 4)[0])
    F.mse_loss(model(x), y).backward()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    grads_ok = all(isinstance(p.grad, DTensor) for p in model.parameters())
    return {"on_meta": on_meta, "full": full, "grads_ok": grads_ok}


def test_meta_device_model_is_sharded_then_materialised_shard_by_shard():
    for out in run_distributed(meta_init, 3):
        assert out["on_meta"] and out["grads_ok"]
        for name, value in out["full"].items():
            rows = torch.arange(value.shape[0], dtype=torch.float32).view(-1, *[1] * (value.dim() - 1))
            torch.testing.assert_close(value, (rows + 0.5 * len(name)).expand_as(value), msg=name)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.embed(idx))))


def tied_weights(rank: int, world_size: int, as_list: bool) -> tuple[torch.Tensor, float]:
    torch.manual_seed(0)
    model = TiedLM()
    if world_size:
        perparam.fully_shard(model.mid)
        if as_list:
            perparam.fully_shard([model.embed, model.head])
        perparam.fully_shard(model)
    idx = torch.arange(6).view(2, 3) % 7
    loss = model(idx).square().mean()
    loss.backward()
    grad = model.embed.weight.grad
    return (grad.full_tensor() if isinstance(grad, DTensor)
            else grad), float(model.head.weight is model.embed.weight)


def test_tied_weights_in_one_group_share_one_sharded_parameter():
    want, _ = one_process(tied_weights, False)
    for as_list in (False, True):
        for grad, still_tied in run_distributed(tied_weights, 2, as_list):
            assert still_tied == 1.0
            torch.testing.assert_close(grad, want, atol=1e-6, rtol=0)


def explicit_unshard(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    want = [p.detach().clone() for p in model.parameters()]
    perparam.fully_shard(model)
    model.unshard()
    plain = [type(p) is nn.Parameter and not isinstance(p, DTensor) for p in model.parameters()]
    equal = [torch.equal(p.detach(), w) for p, w in zip(model.parameters(), want)]
    with torch.no_grad():
        model(torch.ones(1, 3))  # the forward reshards at its end, as FSDP2's does
    after_forward = all(isinstance(p, DTensor) for p in model.parameters())
    model.unshard()
    model.reshard()
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"plain": all(plain), "equal": all(equal), "sharded": sharded, "after_forward": after_forward}


def test_explicit_unshard_and_reshard():
    for out in run_distributed(explicit_unshard, 2):
        assert out == {"plain": True, "equal": True, "sharded": True, "after_forward": True}


def clip_norm(rank: int, world_size: int) -> tuple[float, dict]:
    torch.manual_seed(0)
    model = TinyNet()
    x, y = make_batches(1, 12)[0]
    if world_size:
        for block in model.blocks:
            perparam.fully_shard(block)
        perparam.fully_shard(model)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in
             model.named_parameters()}
    if world_size:
        dist.barrier()
    return norm.item(), grads


def test_clip_grad_norm_returns_the_global_norm():
    want_norm, want_grads = one_process(clip_norm)
    for norm, grads in run_distributed(clip_norm, 3):
        assert abs(norm - want_norm) <= 1e-6 * max(1.0, want_norm)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=0, msg=name)


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.fail = True

    def forward(self, x):
        y = self.fc(x)
        if self.fail:
            raise RuntimeError("boom")
        return y


def forward_that_raises(rank: int, world_size: int) -> dict:
    model = nn.Sequential(Fails(), nn.Linear(2, 2))
    perparam.fully_shard(model[0])
    perparam.fully_shard(model)
    try:
        model(torch.ones(1, 2))
    except RuntimeError:
        pass
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    model[0].fail = False
    model(torch.ones(1, 2)).sum().backward()  # the next step works normally
    return {"sharded": sharded, "grads": all(isinstance(p.grad, DTensor) for p in model.parameters())}


def test_a_forward_that_raises_leaves_the_model_sharded_and_usable():
    for out in run_distributed(forward_that_raises, 2):
        assert out == {"sharded": True, "grads": True}


def activation_checkpointing(rank: int, world_size: int) -> dict:
    from torch.utils.checkpoint import checkpoint

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    torch.manual_seed(0)
    model = TinyNet()
    x, y = make_batches(1, 4)[0]
    if world_size > 1:
        for i, block in enumerate(model.blocks):
            perparam.fully_shard(block)
            model.blocks[i] = Wrapped(block)
        perparam.fully_shard(model)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    F.mse_loss(model(x), y).backward()
    return {n.replace("inner.", ""): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_with_gathered_parameters():
    want = activation_checkpointing(0, 1)
    for got in run_distributed(activation_checkpointing, 2):
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)


class FrozenMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.last = nn.Linear(4, 2)
        self.frozen_alive_when_first_reduces: list[bool] = []

    def forward(self, x):
        return self.last(self.frozen(self.frozen(self.first(x))))  # the frozen layer is called twice


def frozen_group_is_freed_after_its_backward(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = FrozenMiddle()
    x = torch.randn(4, 4)
    if world_size > 1:
        for sub in (model.first, model.frozen, model.last):
            perparam.fully_shard(sub)
        perparam.fully_shard(model)
        frozen = group_of(model.frozen)
        # when `first` reduces (its backward comes after the frozen layer's), the frozen layer is freed
        seen = model.frozen_alive_when_first_reduces
        original = group_of(model.first).reduce_grads

        def spy(*args, **kwargs):
            seen.append(frozen.storage_alive)
            return original(*args, **kwargs)

        group_of(model.first).reduce_grads = spy
        x = x.chunk(world_size)[rank]
    model(x).square().mean().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in
             model.named_parameters() if p.grad is not None}
    return {"alive": model.frozen_alive_when_first_reduces, "grads": grads}


def test_a_frozen_group_frees_its_parameters_after_its_backward():
    want = frozen_group_is_freed_after_its_backward(0, 1)["grads"]
    for out in run_distributed(frozen_group_is_freed_after_its_backward, 2):
        assert out["alive"] == [False]
        assert out["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(out["grads"][name], grad * 1.0, atol=1e-6, rtol=0, msg=name)
