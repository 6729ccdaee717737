"""Low-precision gradient reduce-scatter (``ParamPolicy(grad_quant=...)``, ZeRO++ qgZ): error bounds against
the fp32 reduce-scatter, exact zeros and flags, collectives and bytes, a short AdamW training, HSDP with
no-sync accumulation and stage 2, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

import perparam
from perparam import CommCounter, ParamPolicy, QuantPolicy
from perparam.comm.buffers import BufferPool
from perparam.memory.plan import plan_module
from perparam.memory.policy_args import parse_param_policy
from perparam.runtime.paths import reduce_qgz
from perparam.runtime.reduction import pack_reduce_scatter_input
from perparam.sharding.grad_quant import grad_wire, wire_bytes
from perparam.sharding.policy import resolve_grad_quant
from tests.distributed import c10d_calls, run_distributed
from tests.finetune_helpers import TINY, assert_one_line_error
from tests.models import TinyNet, local_slice, make_batches, sharded_tiny


class Net(nn.Module):
    """``a``: 30 x 40 (several 256-blocks per piece, uneven over 4 ranks), ``b``: ``Linear(4, 2)`` (empty
    shards on 3-4 ranks), ``z``: used with an all-zero gradient, ``u``: never used (its gradient stays
    ``None``), ``w``: ``Linear(32, 16)``, whose weight's pieces on 2 ranks are one whole block (quantized in
    place)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(40, 30)
        self.b = nn.Linear(4, 2)
        self.z = nn.Linear(5, 3)
        self.u = nn.Linear(3, 3)
        self.w = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, 40] -> [batch, 2]
        return self.b(torch.relu(self.a(x))[:, :4]) + self.w(x[:, :32])[:, :2] + 0.0 * self.z(x[:, :5]).sum()


def _local_grads(rank: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every rank's unreduced gradients (an unsharded copy on each rank's batch), gathered to every rank."""
    torch.manual_seed(0)
    plain = Net()
    plain(x).square().sum().backward()
    out = {}
    for name, p in plain.named_parameters():
        if p.grad is None:
            continue
        pieces = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, p.grad.contiguous())
        out[name] = torch.stack(pieces)  # [K, *shape]
    return out


def _int8_bound(grads: torch.Tensor, k: int, d: int, block: int = 256) -> torch.Tensor:
    """Per element of rank ``d``'s shard (flattened): the sum over ranks of half the scale of its block
    (amax / 254), the pieces blocked as they go on the wire (``[chunk rows * rest]``, padded)."""
    rows = grads.shape[1]
    flat = grads.reshape(grads.shape[0], rows, -1)
    chunk = math.ceil(rows / k)
    part = flat[:, d * chunk:(d + 1) * chunk].reshape(grads.shape[0], -1)  # [K ranks, local numel]
    n = chunk * flat.shape[2]
    padded = torch.zeros(grads.shape[0], math.ceil(n / block) * block)
    padded[:, :part.shape[1]] = part
    amax = padded.view(grads.shape[0], -1, block).abs().amax(dim=2)
    return (amax / 254).repeat_interleave(block, dim=1)[:, :part.shape[1]].sum(dim=0), part


def _sharded(rank: int, policy, x: torch.Tensor):
    torch.manual_seed(0)
    model = Net()
    perparam.fully_shard(model, param_policy=policy)
    with CommCounter() as comm, c10d_calls() as raw:
        model(x).square().sum().backward()
    return model, comm, dict(raw)


def bounds_on_ranks(rank: int, world_size: int) -> dict:
    torch.manual_seed(100 + rank)
    x = torch.randn(3, 40) * (rank + 1)
    grads = _local_grads(rank, x)
    fp32, fp32_comm, _ = _sharded(rank, None, x)
    int8, int8_comm, raw = _sharded(rank, ParamPolicy(grad_quant="int8"), x)
    bf16, _, _ = _sharded(rank, ParamPolicy(grad_quant="bf16"), x)
    mixed = {"a.*": ParamPolicy(grad_quant="int8"), "b.*": ParamPolicy(grad_quant="bf16")}
    _, mixed_comm, mixed_raw = _sharded(rank, mixed, x)  # z and u: fp32
    worst = {"int8": 0.0, "bf16": 0.0}
    assert int8.u.weight.grad is None and bf16.u.bias.grad is None  # the used flags travel exact
    for name, g in grads.items():
        ref = dict(fp32.named_parameters())[name].grad.to_local().reshape(-1)
        for kind, model in (("int8", int8), ("bf16", bf16)):
            got = dict(model.named_parameters())[name].grad.to_local().reshape(-1)
            bound, part = _int8_bound(g, world_size, rank)
            if kind == "bf16":
                bound = part.abs().sum(dim=0) * 2.0 ** -8
            slack = 1e-6 * part.abs().sum(dim=0) / world_size + 1e-7  # fp32 rounding of the reference sums
            err = (got - ref).abs()
            assert bool((err <= bound / world_size + slack).all()), (kind, name,
                                                                     (err - bound / world_size).max())
            worst[kind] = max(worst[kind],
                              float((err / (bound / world_size + slack)).max()) if err.numel() else 0.0)
        if name.startswith("z."):  # used, all-zero gradient: exact zeros (scale 0), not None
            assert torch.equal(dict(int8.named_parameters())[name].grad.to_local(),
                               torch.zeros_like(ref.view(-1))
                               .view(dict(int8.named_parameters())[name].grad.to_local().shape))
    return {"rs": int8_comm.count("reduce_scatter"), "rs_fp32": fp32_comm.count("reduce_scatter"),
            "bytes": int8_comm.bytes("reduce_scatter"), "bytes_fp32": fp32_comm.bytes("reduce_scatter"),
            "raw": raw, "worst": worst, "rs_mixed": mixed_comm.count("reduce_scatter"),
            "a2a_mixed": mixed_raw["all_to_all_single"]}


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3, 4])
def test_int8_and_bf16_reduce_scatter_errors_stay_within_their_block_bounds_one_collective_per_format(
        world_size):
    results = run_distributed(bounds_on_ranks, world_size)
    gather = 0 if perparam.configure().gloo_all_gather == "zero_copy" else 1  # the all-gather's all-to-all
    fp32 = 0 if perparam.configure().gloo_reduce_scatter == "zero_copy" else 1  # the fp32 reduce-scatter's
    for r in results:  # one reduce-scatter for the group as in fp32; all-to-alls: it (and the all-gather)
        assert r["rs"] == r["rs_fp32"] == 1
        assert r["raw"]["all_to_all_single"] == 1 + gather and r["raw"]["reduce_scatter_single"] == 0
        # one per wire format: int8, bf16, fp32
        assert r["rs_mixed"] == 3 and r["a2a_mixed"] == 2 + fp32 + gather
    assert len({r["bytes"] for r in results}) == 1  # every rank sends the same bytes
    layouts = [math.ceil(n_rows / world_size) * rest for n_rows, rest in ((30, 40), (30, 1), (2, 4), (2, 1),
                                                                             (3, 5), (3, 1), (3, 3), (3, 1),
                                                                             (16, 32), (16, 1))]
    assert results[0]["bytes"] == world_size * grad_wire(layouts, resolve_grad_quant("w",
        "int8")).row_bytes
    # the planner counts the bytes the runtime sent, and the fp32 reduce-scatter's
    plan = plan_module(Net(), world_size, dtype=None, param_policy=ParamPolicy(grad_quant="int8"))
    assert plan.reduce_scatter_bytes_per_rank == results[0]["bytes"]
    assert plan.reduce_scatter_bytes_unquantized == results[0]["bytes_fp32"]


def test_int8_wire_is_about_a_quarter_of_fp32_for_256_blocks():
    int8 = resolve_grad_quant("w", "int8")
    numels = [1 << 20, 4096, 576 * 288]
    ratio = wire_bytes(numels, int8, torch.float32) / wire_bytes(numels, None, torch.float32)
    assert 0.253 < ratio < 0.26
    assert wire_bytes(numels, resolve_grad_quant("w", "bf16"), torch.float32) / wire_bytes(
        numels, None, torch.float32) == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("k", [2, 3])
def test_int8_gradients_quantized_where_they_lie_encode_and_sum_bitwise_as_packed_then_encoded(k):
    # weights whose K pieces are whole blocks (quantized in place) beside uneven and padded ones
    torch.manual_seed(0)
    grads = tuple(torch.randn(shape) * scale for shape, scale in [((6 * k, 128), 1.0), ((7, 40), 1e-3),
                                                                    ((2, 3), 5.0), ((4 * k, 64), 0.5),
                                                                    ((k, 256), 0.0)])
    gq = resolve_grad_quant("w", "int8")
    numels = [math.ceil(g.shape[0] / k) * g[0].numel() for g in grads]
    wire = grad_wire(numels, gq)
    direct, packed = (torch.zeros(k, wire.row_bytes, dtype=torch.uint8) for _ in range(2))
    scratch = reduce_qgz.encode_grads(grads, wire, gq, direct, BufferPool())
    reduce_qgz.encode(pack_reduce_scatter_input(list(grads), k), wire, gq, packed)
    assert torch.equal(direct, packed)  # codes and scales (flags are written by issue())
    # the K rows as if received from K ranks: decoded and summed in rank order, products rounded once each
    out = torch.empty(sum(numels) + len(numels))
    reduce_qgz.decode_sum(direct, wire, gq, out, scratch)
    codes = direct[:, :wire.total].view(torch.int8).float()
    scales = direct[:, wire.scales_at:wire.flags_at].view(torch.float32)
    values = codes.view(k, -1, 256) * scales.unsqueeze(2)
    want = values[0].clone()
    for r in range(1, k):
        want += values[r]
    want = torch.cat([want.view(-1)[sum(wire.spans[:i]):][:n] for i, n in enumerate(numels)])
    assert torch.equal(out[:sum(numels)], want)


def train_both(rank: int, world_size: int, policy, steps: int, hsdp: bool, accumulate: int,
               optimizer: str = "adamw") -> dict:
    """fp32 and ``policy`` trained in one launch: ``{"fp32": ..., "quantized": ...}``."""
    return {"fp32": train_on_ranks(rank, world_size, None, steps, hsdp, accumulate, optimizer),
            "quantized": train_on_ranks(rank, world_size, policy, steps, hsdp, accumulate, optimizer)}


def train_on_ranks(rank: int, world_size: int, policy, steps: int, hsdp: bool, accumulate: int,
                   optimizer: str = "adamw") -> dict:
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            if hsdp else None)
    model = sharded_tiny(d=16, mesh=mesh, param_policy=policy)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for x, y in make_batches(steps, 8 * accumulate, seed=3):
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        for i, (xm, ym) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            # micro-batches: without sync, then (HSDP) reduce-scattered but held, then the full reduction
            model.set_requires_gradient_sync(i == accumulate - 1 or (hsdp and i == accumulate - 2))
            if hsdp:
                model.set_requires_all_reduce(i == accumulate - 1)
            loss = F.mse_loss(model(xm), ym)
            loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()}}


def _weights(name, param):
    return ParamPolicy(grad_quant="int8") if name.endswith("weight") and param.dim() == 2 else None


def _update_error(got: dict, ref: dict) -> float:
    """|got's update - ref's update| / |ref's update| over all parameters (updates from the shared init)."""
    torch.manual_seed(0)
    init = {n: p.detach() for n, p in TinyNet(d=16).named_parameters()}
    diff = sum(float((got[n] - p).square().sum()) for n, p in ref.items())
    size = sum(float((p - init[n]).square().sum()) for n, p in ref.items())
    return math.sqrt(diff / size)


def test_adamw_training_with_int8_gradients_keeps_the_losses_within_half_a_percent_of_fp32():
    both = run_distributed(train_both, 2, _weights, 5, False, 1)[0]
    fp32, int8 = both["fp32"], both["quantized"]
    # AdamW moves an element by about lr whatever its gradient's size, so a gradient below half a block's
    # scale (quantized to 0) can lose a whole step: the updates differ by up to a quarter (13% measured),
    # the losses by 0.2% (SGD's updates, which keep the gradients' scale, below)
    error = _update_error(int8["params"], fp32["params"])
    diffs = [abs(a - b) / b for a, b in zip(int8["losses"], fp32["losses"])]
    print(f"adamw int8 vs fp32: update error {error:.4f}, loss relative differences {diffs}")
    assert error < 0.25 and max(diffs) < 5e-3


def _hsdp_policy(name, param):
    if name.endswith("weight") and param.dim() == 2:
        return ParamPolicy(grad_quant="int8", zero_stage=2 if "fc1" in name else None)
    return None


def test_hsdp_no_sync_held_all_reduce_and_stage_2_with_int8_gradients_keep_sgd_updates_within_1_percent():
    both = run_distributed(train_both, 4, _hsdp_policy, 3, True, 3, "sgd")
    fp32, int8 = [r["fp32"] for r in both], [r["quantized"] for r in both]
    error = _update_error(int8[0]["params"], fp32[0]["params"])
    print(f"hsdp int8 vs fp32: update error {error:.4f}")
    assert error < 0.01
    for name, p in int8[0]["params"].items():  # every rank holds the same model
        assert all(torch.equal(r["params"][name], p) for r in int8[1:]), name


@pytest.mark.fast
@pytest.mark.parametrize(("policy", "message"), [
    (ParamPolicy(grad_quant="int8", requires_grad=False), "'weight' is frozen.*drop grad_quant"),
    (ParamPolicy(grad_quant="int8", placement=Replicate()), "'weight' is replicated.*grad_quant"),
    (ParamPolicy(grad_quant="int8", zero_stage=1), "'weight' has zero_stage=1.*zero_stage=2"),
    (ParamPolicy(grad_quant="int4"), "grad_quant: QuantPolicy for 'weight' names no registered quantizer"),
    (ParamPolicy(grad_quant=QuantPolicy("int8", store_quantized=True)), "'weight' has store_quantized"),
    (ParamPolicy(grad_quant="bf16", reduce_dtype=torch.bfloat16),
     "'weight' already reduces in torch.bfloat16"),
])
def test_grad_quant_that_cannot_apply_is_refused_at_fully_shard_naming_the_parameter(
        fake_mesh, policy, message):
    with pytest.raises(perparam.ShardingError, match=message):
        perparam.fully_shard(nn.Linear(4, 4), mesh=fake_mesh, param_policy={"weight": policy})


def test_a_custom_reduce_scatter_is_refused_for_a_group_with_grad_quant(fake_mesh):
    model = perparam.fully_shard(nn.Linear(4, 4), mesh=fake_mesh,
                                 param_policy={"weight": ParamPolicy(grad_quant="int8")})

    class Comm:
        def allocate(self, *a, **k):
            raise AssertionError

        def __call__(self, *a, **k):
            raise AssertionError

    with pytest.raises(perparam.ShardingError, match=r"\['weight'\] have grad_quant"):
        model.set_custom_reduce_scatter(Comm())


def test_plan_and_finetune_flags_name_the_wire_format():
    assert parse_param_policy("*.weight=grad=int8") == ("*.weight", ParamPolicy(grad_quant="int8"))
    assert parse_param_policy("mlp.*=bf16,grad=bf16")[1].grad_quant == "bf16"


def test_finetune_grad_quant_pattern_keeps_the_quant_policy_of_the_weights_it_also_names(fake_mesh):
    # --quant int8 --grad-quant 'mlp.*=int8': the pattern used to be put ahead of --quant's '*_proj.weight'
    # (first match wins), so the MLP weights silently lost their int8 all-gather
    from perparam.finetune.model import Llama, LlamaConfig
    from perparam.finetune.train import build_meshes, shard_model
    from perparam.runtime.group import group_of

    model = shard_model(Llama(LlamaConfig.tiny(), device="meta"), build_meshes(2, 1, 1, "cpu"), quant="int8",
                        grad_quant="mlp.*=int8")
    got = {p.fqn: (p.policy.quant is not None, p.policy.grad_quant is not None)
           for p in group_of(model.layers[0]).params}
    assert got["mlp.gate_proj.weight"] == got["mlp.down_proj.weight"] == (True, True), got
    assert got["attn.q_proj.weight"] == (True, False) and got["mlp_norm.weight"] == (False, False), got


@pytest.mark.parametrize(("flags", "message"), [
    (["--grad-quant", "int4"], "--grad-quant int4: expected one of none, int8, bf16"),
    (["--grad-quant", "int8", "--lora", "8"], "the base weights are frozen"),
    (["--grad-quant", "int8", "--zero-stage", "1"], "use --zero-stage 2 or 3"),
])
def test_finetune_grad_quant_flag_errors_are_one_line(capsys, flags, message):
    assert_one_line_error(capsys, [*TINY, "--nproc", "1", *flags], message)
