"""A rank whose shards are empty (dim 0 smaller than the world) takes every path its peers take.

One process plays each rank of a K-rank world in turn through torch's fake process group (collectives
are no-ops, so values are not checked here; the parity tests check them on real ranks): ``fully_shard``
with mixed per-parameter policies, forward, backward, gradient clipping (norm types 2, 1, 3 and inf: an
empty shard's inf norm has no identity), an AdamW step and the model's ``state_dict``, over random shapes
where dim 0 is often smaller than K. Local shapes must equal the pure layout's, so the runtime and
``perparam plan`` agree on every rank, and every rank must record the same collectives (kind, bytes,
group size) in the same order, whatever its shards hold.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import perparam
from perparam import ParamPolicy, QuantPolicy
from perparam.sharding.layout import ShardLayout

pytestmark = pytest.mark.fast

POLICIES = ["plain", "bf16", "int8", "fp8", "nf4", "stored_int8", "stored_nf4", "frozen", "replicate",
            "shard1"]


def _policy(kind: str) -> ParamPolicy | None:
    return {
        "plain": None,
        "bf16": ParamPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "int8": ParamPolicy(quant=QuantPolicy(torch.int8, block_size=4)),
        "fp8": ParamPolicy(quant=QuantPolicy(torch.float8_e4m3fn, block_size=4)),
        "stored_int8": ParamPolicy(requires_grad=False, quant=QuantPolicy(torch.int8, block_size=4,
                                                                          store_quantized=True)),
        "nf4": ParamPolicy(quant=QuantPolicy("nf4", block_size=4)),
        "stored_nf4": ParamPolicy(requires_grad=False, quant=QuantPolicy("nf4", store_quantized=True)),
        "frozen": ParamPolicy(requires_grad=False),
        "replicate": ParamPolicy(placement=Replicate()),
        "shard1": ParamPolicy(placement=Shard(1)),
    }[kind]


class Stack(nn.Module):
    """Linears of the given widths, each computing in fp32 from a cast of its (possibly bf16) weight."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.linear(x, layer.weight.float(), layer.bias.float())
        return x


def _one_rank(rank: int, k: int, widths: list[int], kinds: list[str], norm_type: float) -> list | None:
    """Rank ``rank``'s step; the collectives it recorded (kind, bytes, group size), or None when skipped."""
    torch.manual_seed(0)
    model = Stack(widths)
    n_layers = len(widths) - 1
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    policy = {f"layers.{i}.weight": _policy(kinds[i % 3]) for i in range(n_layers)}
    # a compute dtype is a property of the module (perparam.runtime.islands): the bias follows its weight
    policy.update({f"layers.{i}.bias": _policy("bf16") for i in range(n_layers) if kinds[i % 3] == "bf16"})
    policy = {n: p for n, p in policy.items() if p is not None}
    if any(len(shapes[n]) > 1 and shapes[n][1] < 1 for n in policy):
        return None
    mesh = init_device_mesh("cpu", (k,))
    with perparam.CommCounter() as comm:
        perparam.fully_shard(model, mesh=mesh, param_policy=policy)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            pol = policy.get(name)
            placement = pol.placement if pol is not None and pol.placement is not None else Shard(0)
            shape = shapes[name]
            if pol is not None and pol.quant is not None and pol.quant.store_quantized:
                shape = perparam.quant.get(pol.quant.quantizer).stored_shape(shape)  # nf4: packed codes
            want = ShardLayout(shape, p.dtype, k, placement).local_shape(rank)
            assert tuple(p.to_local().shape) == want, (name, rank)
        trainable = [p for p in model.parameters() if p.requires_grad]
        out = model(torch.ones(2, widths[0]))
        if out.requires_grad:
            out.sum().backward()
        for p in trainable:
            assert p.grad is None or tuple(p.grad.to_local().shape) == tuple(p.to_local().shape)
        perparam.clip_grad_norm_(model.parameters(), 1.0, norm_type)
        if trainable:
            torch.optim.AdamW(trainable, lr=1e-3).step()
        state = model.state_dict()
        assert set(shapes) <= set(state)
    return [(r.kind, r.nbytes, r.group_size) for r in comm.records]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 4).flatmap(lambda k: st.tuples(
    st.just(k),
    st.lists(st.integers(1, k + 2), min_size=2, max_size=4),  # widths: dim 0 often < K
    st.lists(st.sampled_from(POLICIES), min_size=3, max_size=3),
    st.sampled_from([2.0, 1.0, 3.0, float("inf")]))))
def test_every_rank_takes_every_path_with_empty_shards(case):
    k, widths, kinds, norm_type = case
    issued = []
    for rank in range(k):
        dist.init_process_group("fake", rank=rank, world_size=k, store=FakeStore())
        try:
            issued.append(_one_rank(rank, k, widths, kinds, norm_type))
        finally:
            dist.destroy_process_group()
    assert all(records == issued[0] for records in issued), issued
