"""FSDP2's own unit tests (pytorch's ``test/distributed/_composable/fsdp/``), kept in perparam's terms on
gloo ranks with FSDP2's expected values:

* ``test_fully_shard_mixed_precision.py::test_compute_dtype``: bf16/fp16 compute over fp32 shards, reduced
  in the compute dtype, against the reference FSDP2's test builds (fp16: divided by FSDP2's pre-factor before
  the sum and by the rest after it; the pieces summed as perparam's gloo reduce-scatter sums them, which
  at 2 ranks is FSDP2's sum): loss and parameters bit for bit;
* ``::test_clamp_reduce_dtype``: a bf16 model with ``param_dtype = reduce_dtype = bf16`` cast to fp32 after
  ``fully_shard`` computes and reduces in bf16 (the dtypes the policy gave stay);
* ``test_fully_shard_comm.py::test_singleton_copy_division``: at world size 1 the gradient is divided by the
  divide factor once, and not at all for a factor of 1 (None: the mesh size, 1);
* ``test_fully_shard_init.py::test_reset_sharded_param_in_lazy_init``: a parameter of the root replaced,
  before the first forward, by a DTensor computed from sharded parameters is taken, and trains.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import perparam
from perparam import CommCounter, MixedPrecisionPolicy
from tests.distributed import run_distributed


class Mlp(nn.Module):
    """FSDP2's test ``MLP(dim)``: in_proj (dim -> 4 dim), relu, out_proj, relu."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return torch.relu(self.out_proj(torch.relu(self.in_proj(x))))


def fsdp2_divide_factors(world: int, dtype: torch.dtype) -> tuple[int, float]:
    """FSDP2's ``_get_gradient_divide_factors`` for ``world`` ranks, SUM reduction: ``(pre, post)``."""
    if dtype in (torch.float32, torch.bfloat16):
        return 1, float(world)
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return pre, world / pre


def _summed(grad: torch.Tensor) -> torch.Tensor:
    """Every rank's ``grad`` summed as perparam's gloo reduce-scatter sums the pieces it receives: one
    ``torch.sum`` (on CPU a 16-bit sum accumulates in fp32 and rounds once). FSDP2's reference sums on
    NCCL (``reduce_scatter`` + ``all_gather``), whose order and accumulation are NCCL's: the same at 2 ranks
    (one addition, one rounding), not at 4 (docs/fsdp2-differences.md)."""
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grad)
    return torch.stack(parts).sum(0)


def compute_dtype(rank: int, world: int) -> dict:
    """FSDP2's ``_test_compute_dtype`` for each (param dtype, reshard_after_forward): the largest loss and
    parameter differences over 10 iterations."""
    out = {}
    for param_dtype in (torch.bfloat16, torch.float16):
        for reshard in (False, True, 2):
            if reshard == 2 and world % 2:
                continue
            torch.manual_seed(42)
            model = nn.Sequential(*[Mlp(16) for _ in range(3)])
            ref = copy.deepcopy(model)
            ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
            mp = MixedPrecisionPolicy(param_dtype=param_dtype)
            for mlp in model:
                perparam.fully_shard(mlp, reshard_after_forward=reshard, mp_policy=mp)
            perparam.fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
            ref_low = copy.deepcopy(ref).to(param_dtype)
            pre, post = fsdp2_divide_factors(world, param_dtype)
            torch.manual_seed(42 + rank + 1)
            inp = torch.randn((4, 16), dtype=param_dtype)
            loss_diff = param_diff = 0.0
            for it in range(10):
                optim.zero_grad(set_to_none=(it % 2 == 0))
                loss = model(inp).sum()
                loss.backward()
                optim.step()
                ref_optim.zero_grad(set_to_none=(it % 2 == 0))
                ref_loss = ref_low(inp).sum()
                ref_loss.backward()
                for p in ref_low.parameters():
                    if pre > 1:
                        p.grad.div_(pre)
                    p.grad = _summed(p.grad)
                    if post > 1:
                        p.grad.div_(post)
                for p32, p16 in zip(ref.parameters(), ref_low.parameters()):
                    p32.grad, p16.grad = p16.grad.to(p32.dtype), None
                ref_optim.step()
                for p32, p16 in zip(ref.parameters(), ref_low.parameters()):
                    p16.detach().copy_(p32)
                loss_diff = max(loss_diff, (loss - ref_loss).abs().item())
                param_diff = max(param_diff, max((p.full_tensor() - r).abs().max().item()
                                                 for p, r in zip(model.parameters(), ref.parameters())))
            out[str(param_dtype), reshard] = (loss_diff, param_diff)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_compute_dtype_matches_fsdp2s_reference_bit_for_bit_in_bf16_and_fp16(world):
    """fp16 before: 2.2e-5 (2 ranks) and 1.3e-5 (4 ranks) off after 10 steps: the sum was divided after
    the reduction only (FSDP2 divides fp16 gradients by about sqrt(K) before it, against overflow)."""
    for got in run_distributed(compute_dtype, world, timeout=240):
        assert got and all(v == (0.0, 0.0) for v in got.values()), got


def clamp_reduce_dtype(rank: int, world: int) -> dict:
    """FSDP2's ``test_clamp_reduce_dtype`` and variants: the dtypes a policy gave stay through ``model.to``,
    the ones it did not give follow it."""
    out = {}
    cases = {
        "bf16_bf16_to_fp32": (torch.bfloat16, dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                              torch.float32),
        "bf16_param_only_to_fp32": (torch.bfloat16, dict(param_dtype=torch.bfloat16), torch.float32),
        "fp32_reduce_bf16_to_fp64": (torch.float32, dict(reduce_dtype=torch.bfloat16), torch.float64),
        "no_policy_to_bf16": (torch.float32, {}, torch.bfloat16),
    }
    for name, (init, mp, cast) in cases.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32, dtype=init), nn.Linear(32, 32, dtype=init))
        for m in model:
            perparam.fully_shard(m, mp_policy=MixedPrecisionPolicy(**mp))
        perparam.fully_shard(model, mp_policy=MixedPrecisionPolicy(**mp))
        model.to(cast)
        with CommCounter() as comm:
            y = model(torch.randn(4, 32, dtype=cast))
            y.float().sum().backward()
        reduced = {str(r.dtype) for r in comm.records if r.kind == "reduce_scatter"}
        out[name] = (str(y.dtype), sorted(reduced), sorted({str(p.grad.dtype) for p in model.parameters()}))
    return out


def test_clamp_reduce_dtype_a_cast_after_fully_shard_keeps_the_dtypes_the_policy_gave():
    """Before: "mat1 and mat2 must have the same dtype, but got BFloat16 and Float" (a param_dtype equal to
    the stored dtype followed the cast to fp32 while the inputs were still cast to bf16)."""
    for world in (1, 2):
        for got in run_distributed(clamp_reduce_dtype, world):
            wire = ["torch.bfloat16"]  # what every reduce-scatter record carried (one rank: the copy)
            assert got["bf16_bf16_to_fp32"] == ("torch.bfloat16", wire, ["torch.float32"])
            assert got["bf16_param_only_to_fp32"] == ("torch.bfloat16", wire, ["torch.float32"])
            assert got["fp32_reduce_bf16_to_fp64"] == ("torch.float64", wire, ["torch.float64"])
            assert got["no_policy_to_bf16"] == ("torch.bfloat16", wire, ["torch.bfloat16"])


class _Divisions(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "div" in func.__name__:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def singleton_division(rank: int, world: int) -> dict:
    """FSDP2's ``test_singleton_copy_division`` (and a factor of 1 at 2 ranks): the division ops run in
    backward and the gradient's first element."""
    out = {}
    for factor in (None, 1.0, 2.0):
        model = nn.Linear(8, 4, bias=False)
        perparam.fully_shard(model)
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        loss = model(torch.ones(3, 8)).sum()
        with _Divisions() as divisions:
            loss.backward()
        grad = model.weight.grad.full_tensor()
        out[factor] = (len(divisions.ops), grad.min().item(), grad.max().item())
    return out


def test_singleton_copy_division_divides_once_by_the_factor_and_never_by_one():
    """Before: a ``_foreach_div_`` by 1 ran at world size 1 (factor None or 1.0) and at any world size with
    a factor of 1 (a pass over every gradient that changes nothing)."""
    [got] = run_distributed(singleton_division, 1)
    assert got == {None: (0, 3.0, 3.0), 1.0: (0, 3.0, 3.0), 2.0: (1, 1.5, 1.5)}  # 3 / (factor or 1)
    for got in run_distributed(singleton_division, 2):
        assert got[1.0] == (0, 6.0, 6.0) and got[2.0] == (1, 3.0, 3.0) and got[None][1:] == (3.0, 3.0)


class _NormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)

    def forward(self, inp):
        return self.layer2(self.layer1(inp)).sum() + self.weight_norm.sum()


def reset_in_lazy_init(rank: int, world: int) -> dict:
    """FSDP2's ``test_reset_sharded_param_in_lazy_init`` (the layers initialised by ``reset_parameters``,
    bitwise the unsharded model's), against the unsharded model; then a plain tensor assigned there, which
    is not a shard of the parameter: refused as before."""
    torch.manual_seed(0)
    ref = _NormModel()
    with torch.device("meta"):
        model = _NormModel()
    perparam.fully_shard(model.layer1)
    perparam.fully_shard(model.layer2)
    perparam.fully_shard(model)
    registered = model.weight_norm
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    torch.manual_seed(0)
    model.layer1.reset_parameters()
    model.layer2.reset_parameters()
    model.init_weight_norm()
    ref.init_weight_norm()
    inp = torch.randn(3, 3, generator=torch.Generator().manual_seed(1))
    model(inp).sum().backward()
    ref(inp).sum().backward()
    out = {"same_object": model.weight_norm is registered,
           "value": (model.weight_norm.full_tensor() - ref.weight_norm).abs().max().item(),
           "grads": max((p.grad.full_tensor() - r.grad).abs().max().item()
                        for p, r in zip(model.parameters(), ref.parameters()))}
    try:
        model.weight_norm = nn.Parameter(torch.ones(3))
    except perparam.ShardingError as e:
        out["plain"] = str(e)
    return out


def test_reset_sharded_param_in_lazy_init_takes_a_dtensor_of_the_parameters_spec():
    """Before: refused as a tree change ("parameter 'weight_norm' (_NormModel.weight_norm) of a sharded model
    still on the meta device was replaced"). 2 ranks: rows 2/1; 4 ranks: 1/1/1/0, an empty shard."""
    for world in (1, 2, 4):
        for got in run_distributed(reset_in_lazy_init, world):
            assert got["same_object"] and got["value"] == 0.0 and got["grads"] < 1e-6, got
            assert "was replaced after fully_shard" in got["plain"], got


#: the regexes FSDP2's own tests (and FSDP2 code) match its refusals with, for what perparam refuses too
FSDP2_WORDS = {
    "applied_twice": "Each distinct composable distributed API can only be applied to a module once",
    "deepcopy": "FSDP does not support deepcopy. Please use state dict for serialization",
    "container": "fully_shard does not support containers that do not implement forward",
    "mesh_3d": "fully_shard expects a 1D or 2D DeviceMesh but got",
    "scalar": "fully_shard doesn't support scalar parameters",
    "meta": (r"FSDP parameters should be materialized from meta device before training, but the following "
             r"were "
             r"still on meta device: \['0.in_proj.weight', '0.in_proj.bias', '0.out_proj.weight', "
             r"'0.out_proj.bias'\]"),
}


def shared_refusals(rank: int, world: int, which: str) -> dict:
    """Each refusal FSDP2 and perparam share, raised by ``which`` (``"perparam"`` or ``"fsdp2"``): its
    message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    shard = perparam.fully_shard if which == "perparam" else fsdp2_shard

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

    def twice():
        m = nn.Linear(4, 2)
        shard(m)
        shard(m)

    def deepcopy():
        m = nn.Linear(4, 2)
        shard(m)
        copy.deepcopy(m)

    def meta():
        with torch.device("meta"):
            model = nn.Sequential(Mlp(8), Mlp(8))
        shard(model[0])
        shard(model[1])
        shard(model)
        model(torch.randn(4, 8))

    calls = {"applied_twice": twice, "deepcopy": deepcopy,
             "container": lambda: shard(nn.ModuleList([nn.Linear(2, 2)])),
             "mesh_3d": lambda: shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1, world))),
             "scalar": lambda: shard(Scalar()), "meta": meta}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except Exception as e:  # every kind is reported; the test matches the words
            out[name] = str(e)
    return out


def test_refusals_fsdp2_shares_carry_fsdp2s_words_so_its_regexes_match():
    """Before: none of the six matched FSDP2's regex (perparam's own wording only)."""
    import re

    fsdp2 = run_distributed(shared_refusals, 2, "fsdp2")[0]
    for got in run_distributed(shared_refusals, 2, "perparam"):
        for name, words in FSDP2_WORDS.items():
            assert re.search(words, fsdp2[name]), (name, fsdp2[name])  # FSDP2's own message
            assert re.search(words, got[name]), (name, got[name])
