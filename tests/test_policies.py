"""Per-parameter policies: mixed precision, freezing, quantization and placement, one collective per group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.utils import parametrize

import perparam
from perparam import CommCounter, MixedPrecisionPolicy, ParamPolicy, QuantPolicy
from perparam.memory.measure import model_state_bytes
from tests.distributed import one_process, run_distributed
from tests.models import mean_over_ranks

BF16, FP32 = torch.bfloat16, torch.float32


class Mixed(nn.Module):
    """A bf16-computed Linear, an fp32 norm, a frozen Linear, a uint8 frozen table, a head: one group.
    The forward casts activations to each weight's dtype, as code mixing compute dtypes must."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 13)
        self.norm = nn.LayerNorm(13)
        self.frozen = nn.Linear(13, 7)
        self.head = nn.Linear(7, 3)
        self.codes = nn.Parameter(torch.randint(0, 255, (5, 3), dtype=torch.uint8), requires_grad=False)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, 8] -> [batch, 3]
        h = self.proj(x.to(self.proj.weight.dtype)).float()
        h = F.layer_norm(h, (13,), self.norm.weight, self.norm.bias)
        h = torch.tanh(self.frozen(h.to(self.frozen.weight.dtype)).float())
        return self.head(h) + self.codes.float().mean(0) * 0.01


class Cast(nn.Module):
    """The reference's cast: the fp32 master is cast to the compute dtype at each use (autograd casts
    the gradient back), exactly what the sharded run's all-gather does."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(self.dtype)


MIXED_POLICY = {
    "proj.*": ParamPolicy(param_dtype=BF16, reduce_dtype=FP32),
    "norm.weight": ParamPolicy(placement=Replicate()),
    "head.weight": ParamPolicy(placement=Shard(1)),
}
FP32_POLICY = {
    "norm.weight": ParamPolicy(placement=Replicate()),
    "head.weight": ParamPolicy(placement=Shard(1)),
    "proj.bias": ParamPolicy(reduce_dtype=FP32),
}


def _batches(steps: int = 6, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(steps)]


def train_mixed(rank: int, world_size: int, bf16: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = Mixed()
    if world_size:
        perparam.fully_shard(model, param_policy=MIXED_POLICY if bf16 else FP32_POLICY)
    elif bf16:
        for name in ("weight", "bias"):
            parametrize.register_parametrization(model.proj, name, Cast(BF16), unsafe=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for x, y in _batches():
        if world_size:
            n = x.shape[0] // world_size
            x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    named = dict(model.named_parameters())
    if not world_size and bf16:
        named["proj.weight"] = model.proj.parametrizations.weight.original
        named["proj.bias"] = model.proj.parametrizations.bias.original
    params = {n.replace("parametrizations.", "").replace(".original", ""): (
        p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named.items()}
    return losses, params


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.fast)], ids=["fp32", "bf16"])
def test_mixed_policy_group_trains_like_a_reference_with_the_same_casts(bf16):
    tol = 2e-2 if bf16 else 1e-5
    want_losses, want_params = one_process(train_mixed, bf16)
    for losses, params in run_distributed(train_mixed, 2, bf16):
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= tol, (losses, want_losses)
        for name, value in want_params.items():
            if name.startswith("parametrizations"):
                continue
            torch.testing.assert_close(params[name], value, atol=tol, rtol=0, msg=name)


def five_policies(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = Mixed()
    policy = {
        "proj.*": ParamPolicy(param_dtype=BF16, reduce_dtype=FP32),  # bf16 compute
        "norm.weight": ParamPolicy(placement=Replicate()),  # replicated
        "frozen.weight": ParamPolicy(quant=QuantPolicy(torch.int8, 16, store_quantized=True)),  # int8 stored
        "head.weight": ParamPolicy(placement=Shard(1), quant=QuantPolicy(torch.float8_e4m3fn, 8)),  # fp8 wire
        "codes": ParamPolicy(),  # uint8, frozen
    }
    perparam.fully_shard(model, param_policy=policy)
    x = torch.randn(4, 8)
    with CommCounter() as fwd:
        loss = model(x).square().mean()
    with CommCounter() as bwd:
        loss.backward()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    placements = {n: p.placements for n, p in model.named_parameters()}
    grads = {n: p.grad is not None for n, p in model.named_parameters()}
    return {"fwd": fwd.by_kind(), "bwd": bwd.by_kind(), "dtypes": dtypes, "placements": placements,
            "grads": grads, "buffers": sorted(n for n, _ in model.named_buffers())}


def test_one_all_gather_per_group_with_five_policies():
    for out in run_distributed(five_policies, 2):
        assert out["fwd"] == {"all_gather": 1}
        # one reduce-scatter (one reduce dtype: fp32) + one all-reduce for the replicated norm weight
        assert out["bwd"] == {"reduce_scatter": 1, "all_reduce": 1}
        assert out["dtypes"]["frozen.weight"] == torch.int8 and out["dtypes"]["codes"] == torch.uint8
        assert out["dtypes"]["proj.weight"] == FP32  # the sharded master stays fp32
        assert out["placements"]["norm.weight"] == (Replicate(),)
        assert out["placements"]["head.weight"] == (Shard(1),)
        assert out["buffers"] == ["frozen.weight_qscale"]
        assert out["grads"] == {"proj.weight": True, "proj.bias": True, "norm.weight": True,
                                "norm.bias": True, "frozen.weight": False, "frozen.bias": False,
                                "head.weight": True, "head.bias": True, "codes": False}


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 256, bias=False)
        self.fc2 = nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def wire_bytes(rank: int, world_size: int, kind: str) -> int:
    torch.manual_seed(0)
    model = Wide()
    kwargs = {}
    if kind == "int8":
        kwargs["param_policy"] = ParamPolicy(quant=QuantPolicy(torch.int8, block_size=256))
    elif kind == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    perparam.fully_shard(model, **kwargs)
    with CommCounter() as comm, torch.no_grad():
        model(torch.randn(2, 256))
    return comm.bytes("all_gather")


def test_quantized_and_bf16_all_gathers_move_fewer_bytes():
    fp32 = run_distributed(wire_bytes, 2, "fp32")[0]
    int8 = run_distributed(wire_bytes, 2, "int8")[0]
    bf16 = run_distributed(wire_bytes, 2, "bf16")[0]
    assert fp32 == 2 * 256 * 256 * 4
    assert int8 <= 0.27 * fp32, int8 / fp32
    assert bf16 == 0.5 * fp32


class LoRALinear(nn.Module):
    def __init__(self, d: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d, d, bias=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(d, rank))

    def forward(self, x):  # x: [batch, d]
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class QLoRANet(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.l1 = LoRALinear(d)
        self.norm = nn.LayerNorm(d)
        self.l2 = LoRALinear(d)

    def forward(self, x):
        return self.l2(self.norm(torch.relu(self.l1(x))))


def qlora(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = QLoRANet()
    base_fp32 = {n: p.numel() * 4 for n, p in model.named_parameters() if n.endswith("base.weight")}
    perparam.fully_shard(model, param_policy={
        "*.base.weight": ParamPolicy(requires_grad=False,
                                     quant=QuantPolicy(torch.int8, 256, store_quantized=True))})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(3)
    target = torch.randn(64, 64, generator=g) * 0.2
    losses = []
    for _ in range(30):
        x = torch.randn(16, 64, generator=g)
        loss = F.mse_loss(model(x), x @ target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    with_state = sorted(n for n, p in model.named_parameters() if p in opt.state)
    base_local = {n: p.to_local().numel() * p.to_local().element_size() for n, p in model.named_parameters()
                  if n.endswith("base.weight")}
    scales_local = {n[:-len("_qscale")]: b.to_local().numel() * 4 for n, b in model.named_buffers()
                    if n.endswith("_qscale")}
    return {"losses": losses, "with_grad": with_grad, "with_state": with_state, "base_fp32": base_fp32,
            "base_local": base_local, "scales_local": scales_local,
            "state": model_state_bytes(model, opt).as_dict()}


def test_qlora_int8_base_weights_with_trainable_adapters():
    world_size = 2
    for out in run_distributed(qlora, world_size):
        first, last = sum(out["losses"][:5]) / 5, sum(out["losses"][-5:]) / 5
        assert last < 0.85 * first, out["losses"]  # rank-4 adapters over frozen random bases: falls ~20%
        trainable = ["l1.lora_a", "l1.lora_b", "l2.lora_a", "l2.lora_b", "norm.bias", "norm.weight"]
        assert out["with_grad"] == trainable and out["with_state"] == trainable
        for name, fp32_bytes in out["base_fp32"].items():
            stored = out["base_local"][name] + out["scales_local"][name]
            assert stored <= 0.27 * fp32_bytes / world_size, (name, stored, fp32_bytes)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_no_sync_accumulates_in_the_reduce_dtype(micro_batches):
    want = run_distributed(accumulate_bf16, 1, micro_batches, True)[0]
    for got in run_distributed(accumulate_bf16, 2, micro_batches, False):
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=2e-3, rtol=2e-2, msg=name)


class LateUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.late = nn.Linear(4, 4)

    def forward(self, x, use_late: bool):
        y = self.fc(x.to(self.fc.weight.dtype))
        return self.late(y) if use_late else y


def accumulate_bf16(rank: int, world_size: int, micro_batches: int, reference: bool) -> dict:
    """bf16 compute with fp32 reduce; ``late`` gets its first gradient in the last micro-batch only."""
    torch.manual_seed(0)
    model = LateUse()
    perparam.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32))
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, 4, generator=g) for _ in range(micro_batches)]
    for i, x in enumerate(xs):
        model.set_requires_gradient_sync(i == micro_batches - 1)
        x = x if reference else x.chunk(world_size)[rank]
        model(x, use_late=i == micro_batches - 1).float().sum().backward()
    return {n: p.grad.full_tensor() * (1 if reference else world_size) for n, p in model.named_parameters()}


class Record(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.seen: list = []

    def forward(self, batch):
        self.seen.append(batch)
        return self.fc(batch["x"])


def casts_inputs(rank: int, world_size: int) -> dict:
    import dataclasses
    from collections import namedtuple

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        a: torch.Tensor
        ids: torch.Tensor

    Pair = namedtuple("Pair", "left right")
    model = Record()
    perparam.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, output_dtype=FP32))
    batch = {"x": torch.randn(3, 2), "nested": [Pair(torch.randn(1), torch.ones(1, dtype=torch.int64)),
                                              (Frozen(torch.randn(2), torch.arange(2)),)]}
    out = model(batch)
    seen = model.seen[0]
    pair, (frozen,) = seen["nested"]
    return {"x": seen["x"].dtype, "left": pair.left.dtype, "right": pair.right.dtype,
            "pair": type(pair).__name__, "a": frozen.a.dtype, "ids": frozen.ids.dtype,
            "frozen": type(frozen).__name__, "out": out.dtype}


def test_forward_inputs_cast_through_nested_containers_and_outputs_to_output_dtype():
    out = run_distributed(casts_inputs, 1)[0]
    assert out == {"x": BF16, "left": BF16, "right": torch.int64, "pair": "Pair", "a": BF16,
                   "ids": torch.int64, "frozen": "Frozen", "out": FP32}


def policy_error(rank: int, world_size: int, case: str) -> str:
    model = Mixed()
    policies = {
        "store_trainable": {"proj.weight": ParamPolicy(quant=QuantPolicy(store_quantized=True))},
        "quant_int": {"codes": ParamPolicy(quant=QuantPolicy())},
        "int_param_dtype": {"proj.weight": ParamPolicy(param_dtype=torch.int8)},
        "int_reduce_dtype": {"proj.weight": ParamPolicy(reduce_dtype=torch.int32)},
        "shard_dim": {"proj.weight": ParamPolicy(placement=Shard(2))},
        "typo": {"porj.*": ParamPolicy(param_dtype=BF16)},
        "mp_int": None,
    }
    try:
        if case == "mp_int":
            perparam.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
        else:
            perparam.fully_shard(model, param_policy=policies[case])
    except perparam.ShardingError as e:
        unchanged = not any(isinstance(p, DTensor) for p in model.parameters()) and not isinstance(
            model, perparam.ShardedModule)
        return str(e) + ("" if unchanged else " [MODULE WAS CHANGED]")
    return "no error"


POLICY_ERRORS = {
    "store_trainable": ["'proj.weight'", "trainable", "requires_grad=False"],
    "quant_int": ["'codes'", "torch.uint8", "quantized"],
    "int_param_dtype": ["'proj.weight'", "floating-point", "torch.int8"],
    "int_reduce_dtype": ["'proj.weight'", "floating-point", "torch.int32"],
    "shard_dim": ["Shard(2)", "'proj.weight'", "2 dims"],
    "typo": ["'porj.*'", "matches no parameter"],
    "mp_int": ["param_dtype", "floating-point"],
}


@pytest.mark.parametrize("case", sorted(POLICY_ERRORS))
def test_bad_policies_fail_at_fully_shard_time(case):
    message = run_distributed(policy_error, 1, case)[0]
    assert "[MODULE WAS CHANGED]" not in message  # a failed call leaves the module as it was
    for fragment in POLICY_ERRORS[case]:
        assert fragment in message, (fragment, message)
