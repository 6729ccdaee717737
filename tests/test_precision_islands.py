"""Per-parameter compute dtypes on stock torch modules: precision islands (``perparam.runtime.islands``).

The property test builds random stacks of stock modules (Linear, LayerNorm, RMSNorm, Conv1d, Embedding)
with random per-layer compute dtypes (fp32/bf16), frozen parameters and int8/fp8/nf4 all-gathers (nf4 also
stored, for frozen parameters), shards them
in ONE ``fully_shard`` call on 1-3 ranks and compares with a single-process reference that applies the
same casts to the same all-gathered weights.

Bounds: the forward runs the same ops on the same dtypes as the reference, so outputs match to fp32
round-off (1e-5). Gradients are computed in each layer's compute dtype on every rank, cast to the fp32
``reduce_dtype`` and averaged: the reference averages the same per-rank values in another order, so
they differ by the fp32 summation of K <= 3 terms, at most a few ulps: ``rtol=1e-5, atol=1e-6``.
(bf16 enters only through values both sides compute identically.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import perparam
from perparam import CommCounter, MixedPrecisionPolicy, ParamPolicy, QuantPolicy
from tests.distributed import run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: all-gather quantizers; "nf4-stored" keeps a frozen parameter's shard in NF4 as well
QUANTS = {"int8": QuantPolicy(torch.int8), "fp8": QuantPolicy(torch.float8_e4m3fn), "nf4": QuantPolicy("nf4"),
          "nf4-stored": QuantPolicy("nf4", store_quantized=True)}


def build(spec: dict) -> nn.Sequential:
    """``[B, d]`` token ids (or ``[B, d, d]`` floats) -> ``[B, d, d]``; every layer keeps the shape."""
    d = spec["d"]
    make = {"linear": lambda: nn.Linear(d, d), "layernorm": lambda: nn.LayerNorm(d),
            "rmsnorm": lambda: nn.RMSNorm(d), "conv1d": lambda: nn.Conv1d(d, d, 1), "relu": nn.ReLU,
            "embedding": lambda: nn.Embedding(7, d)}
    torch.manual_seed(spec["seed"])
    return nn.Sequential(*(make[kind]() for kind, _ in spec["layers"]))


def policies(spec: dict) -> dict:
    out = {}
    for i, (kind, layer) in enumerate(spec["layers"]):
        if kind == "relu":
            continue
        for pname in ("weight", "bias"):
            if kind in ("embedding", "rmsnorm") and pname == "bias":
                continue
            quant = layer["quant"].get(pname)
            out[f"{i}.{pname}"] = ParamPolicy(
                param_dtype=DTYPES[layer["dtype"]], requires_grad=pname not in layer["frozen"],
                quant=QUANTS[quant] if quant else None)
    return out


def island_run(rank: int, world_size: int, spec: dict) -> dict:
    model = build(spec)
    reference = copy.deepcopy(model)
    call_dtype = DTYPES.get(spec["call_dtype"])
    perparam.fully_shard(model,
                         mp_policy=MixedPrecisionPolicy(param_dtype=call_dtype, reduce_dtype=torch.float32),
                         param_policy=policies(spec))
    # what the layers compute with: the all-gathered (cast, dequantized) weights
    model.unshard()
    gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.reshard()
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    batches = [torch.randint(0, 7, (2, spec["d"]), generator=g) if spec["layers"][0][0] == "embedding"
               else torch.randn(2, spec["d"], spec["d"], generator=g) for _ in range(world_size)]
    with CommCounter() as comm:
        out = model(batches[rank])
    all_gathers = comm.count("all_gather")
    if out.requires_grad:  # something trainable
        out.float().pow(2).mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}

    # the reference: same weights, the island rule applied by hand, gradients averaged over the batches
    for n, p in reference.named_parameters():
        p.data = gathered[n]
        p.requires_grad_(policies(spec)[n].requires_grad)
    ref_grads: dict[str, torch.Tensor] = {}
    ref_out = None
    for b, x in enumerate(batches):
        y = x.to(call_dtype) if call_dtype is not None and x.is_floating_point() else x
        for module, (kind, layer) in zip(reference, spec["layers"]):
            if kind == "relu":
                y = module(y)
                continue
            dtype = DTYPES[layer["dtype"]]
            arrived = call_dtype or (y.dtype if y.is_floating_point() else None)
            y = module(y.to(dtype) if y.is_floating_point() else y)
            y = y.to(arrived) if arrived is not None else y
        if b == rank:
            ref_out = y.detach()
        if y.requires_grad:
            y.float().pow(2).mean().backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                ref_grads[n] = ref_grads.get(n, 0) + p.grad.float() / world_size
                p.grad = None
    return {"out": out.detach(), "ref_out": ref_out, "grads": grads, "ref_grads": ref_grads,
            "all_gathers": all_gathers}


@st.composite
def specs(draw):
    d = draw(st.sampled_from([2, 3, 5]))
    kinds = ["linear", "layernorm", "rmsnorm", "conv1d", "relu"]
    n = draw(st.integers(1, 4))
    chosen = [draw(st.sampled_from(kinds)) for _ in range(n)]
    if draw(st.booleans()):
        chosen.insert(0, "embedding")
    layers = []
    for kind in chosen:
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        frozen = [p for p in ("weight", "bias") if draw(st.booleans()) and draw(st.booleans())]
        storable = {"weight"} & set(frozen) if kind in ("linear", "conv1d", "embedding") else set()  # 2+ dims
        quant = {p: draw(st.sampled_from([None, None, "int8", "fp8", "nf4",
                                          *(["nf4-stored"] if p in storable else [])]))
                 for p in ("weight", "bias")}
        layers.append((kind, {"dtype": dtype, "frozen": frozen, "quant": quant}))
    call = draw(st.sampled_from(["fp32", "bf16", "none"]))
    if call == "none" and len({layer["dtype"] for kind, layer in layers if kind != "relu"}) <= 1:
        call = "fp32"  # no call dtype and one compute dtype: no islands, the inputs are the user's business
    return {"d": d, "layers": layers, "call_dtype": call, "seed": draw(st.integers(0, 100)),
            "world": draw(st.integers(1, 3))}


#: stacks checked per launch: 4 hypothesis examples x 3 = the 12 stacks of 12 launches
SPECS_PER_LAUNCH = 3


@st.composite
def launches(draw) -> list[dict]:
    """``SPECS_PER_LAUNCH`` stacks on one number of ranks (1-3), run one after the other in one launch."""
    world = draw(st.integers(1, 3))
    return [{**draw(specs()), "world": world} for _ in range(SPECS_PER_LAUNCH)]


def island_runs(rank: int, world_size: int, batch: list[dict]) -> list[dict]:
    """``island_run`` of each spec in turn: each builds and shards its own model with its own seed."""
    return [island_run(rank, world_size, spec) for spec in batch]


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=launches())
def test_stock_module_stacks_with_per_parameter_dtypes_match_the_reference(batch):
    for per_spec in run_distributed(island_runs, batch[0]["world"], batch):
        for spec, out in zip(batch, per_spec, strict=True):
            sharded = any(k != "relu" for k, _ in spec["layers"])
            assert out["all_gathers"] == (1 if sharded else 0), out["all_gathers"]
            assert out["out"].dtype == out["ref_out"].dtype
            torch.testing.assert_close(out["out"].float(), out["ref_out"].float(), rtol=1e-5, atol=1e-5)
            assert out["grads"].keys() == out["ref_grads"].keys()
            for name, grad in out["grads"].items():
                torch.testing.assert_close(grad, out["ref_grads"][name], rtol=1e-5, atol=1e-6, msg=name)


def issue_example(rank: int, world_size: int, hsdp: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    mesh = init_device_mesh("cpu", (2, world_size // 2),
                            mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp else None
    perparam.fully_shard(model, mesh=mesh,
                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32),
                         param_policy={"1.*": ParamPolicy(param_dtype=torch.float32)})
    seen = {}
    model[1].register_forward_hook(lambda m, a, o: seen.update(inp=a[0].dtype, weight=m.weight.dtype,
                                                               out=o.dtype),
                                   prepend=True)  # before the island casts the output back
    model[3].register_forward_pre_hook(lambda m, a: seen.update(after=a[0].dtype))
    out = model(torch.randn(4, 16))
    out.float().sum().backward()
    return {**seen, "final": out.dtype,
            "islands": [(i.path, i.dtype, i.outer) for i in model._perparam_group.islands]}


@pytest.mark.parametrize("world,hsdp", [pytest.param(2, False, marks=pytest.mark.fast), (4, True)])
def test_a_linear_asked_to_compute_in_fp32_inside_a_bf16_call_is_an_island(world, hsdp):
    for got in run_distributed(issue_example, world, hsdp):
        assert got["islands"] == [("1", torch.float32, torch.bfloat16)]
        assert (got["inp"], got["weight"], got["out"]) == (torch.float32,) * 3
        assert got["after"] == torch.bfloat16 and got["final"] == torch.bfloat16


class TwoDtypes(nn.Module):
    """A user's module with mixed dtypes that casts in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(2, 2))
        self.b = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x @ self.a.float() + self.b.float()


def conflicting(rank: int, world_size: int) -> dict:
    stock = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    try:
        perparam.fully_shard(stock, param_policy={"1.bias": ParamPolicy(param_dtype=torch.bfloat16)})
        message = "no error"
    except perparam.ShardingError as e:
        assert not isinstance(stock[1].weight.data, torch.distributed.tensor.DTensor)  # nothing changed
        message = str(e)
    own = nn.Sequential(nn.Linear(2, 2), TwoDtypes())
    perparam.fully_shard(own, param_policy={"1.b": ParamPolicy(param_dtype=torch.bfloat16)})
    return {"message": message, "own": own(torch.ones(1, 2)).dtype, "islands": own._perparam_group.islands}


def test_a_stock_module_whose_own_parameters_ask_for_two_dtypes_is_refused_at_fully_shard():
    for got in run_distributed(conflicting, 1):
        for fragment in ("module '1'", "'1.weight' in torch.float32", "'1.bias' in torch.bfloat16",
                         "submodule"):
            assert fragment in got["message"], got["message"]
        # a module of the user's own class casts by itself: accepted as it is, not an island
        assert got["own"] == torch.float32 and got["islands"] == []


def mha_out_proj(rank: int, world_size: int) -> str:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 1, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0]

    model = Attn()
    try:
        perparam.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                             param_policy={"attn.out_proj.*": ParamPolicy(param_dtype=torch.float32)})
    except perparam.ShardingError as e:
        return str(e)
    return "no error"


def test_an_island_a_stock_parent_never_calls_is_refused():
    # MultiheadAttention reads out_proj.weight without calling out_proj: its hooks could never cast
    for message in run_distributed(mha_out_proj, 1):
        assert "'attn.out_proj'" in message and "MultiheadAttention" in message, message
