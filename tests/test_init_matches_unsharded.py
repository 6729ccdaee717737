"""Initialization of sharded parameters gives the unsharded model's values, bitwise, at any number of ranks.

The meta-device start of torchtitan and Megatron users: build on ``meta``, ``fully_shard``,
``to_empty(device="cpu")``, ``torch.manual_seed(0)``, then ``reset_parameters()`` on every module (or a
torchtitan-style ``trunc_normal_`` init). DTensor's random ops on a CPU mesh have no offset-based RNG
tracker: every rank drew the same block (0.604 off the unsharded initialization, FSDP2 the same).
perparam draws each parameter's full tensor on every rank, as one process does, and keeps its rows
(``perparam/runtime/writes.py``), so later parameters match too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed import one_process, run_distributed


class Block(nn.Module):
    """A LLaMA-like block: RMSNorm, q/k/v/o projections without bias, a SwiGLU MLP."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 7, d: int = 6, hidden: int = 10, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)


def _models() -> dict[str, nn.Module]:
    """Uneven and empty shards over 2-4 ranks: 7, 6, 10, 3, 5 and 2 rows."""
    return {"llama": TinyLlama(), "linear": nn.Linear(3, 5), "embedding": nn.Embedding(3, 4, padding_idx=1),
            "layernorm": nn.LayerNorm(2), "linear_2_rows": nn.Linear(4, 2)}


def _init(model: nn.Module, how: str) -> None:
    torch.manual_seed(0)
    if how == "reset_parameters":
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        return
    with torch.no_grad():  # torchtitan's init_weights: trunc_normal_ on matrices, ones on norms
        for name, p in model.named_parameters():
            if p.dim() > 1:
                nn.init.trunc_normal_(p, mean=0.0, std=0.02 if "embed" not in name else 1.0)
            else:
                nn.init.ones_(p)


def initialized(rank: int, world_size: int, how: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each model built on meta, sharded over ``world_size`` ranks (0: not sharded), materialised with
    ``to_empty(device="cpu")`` and initialized by ``how``; its parameters as full tensors."""
    import perparam
    from tests.models import full_params

    out = {}
    for name in _models():
        with torch.device("meta"):
            model = _models()[name]
        if world_size:
            for m in model.modules():
                if isinstance(m, Block):
                    perparam.fully_shard(m)
            perparam.fully_shard(model)
        model.to_empty(device="cpu")
        _init(model, how)
        out[name] = full_params(model)
    return out


def max_difference(world_size: int, how: str) -> dict[str, float]:
    ref = one_process(initialized, how)
    got = run_distributed(initialized, world_size, how)
    return {name: max((got[r][name][p] - ref[name][p]).abs().max().item() for r in range(world_size)
                      for p in ref[name]) for name in ref}


@pytest.mark.parametrize("how", ["reset_parameters", pytest.param("trunc_normal", marks=pytest.mark.fast)])
def test_initialization_after_to_empty_is_the_unsharded_models_at_any_world_size(how):
    for world_size in (1, 2, 3, 4):
        difference = max_difference(world_size, how)
        assert all(d == 0 for d in difference.values()), (world_size, difference)


INITIALIZERS = {
    "orthogonal_": nn.init.orthogonal_, "xavier_normal_": nn.init.xavier_normal_,
    "kaiming_normal_": nn.init.kaiming_normal_, "eye_": nn.init.eye_,
    "setitem": lambda w: w.__setitem__((3, 1), 7.0),
}


def other_initializers(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """``Linear(4, 5)``'s weight after each initializer in turn (one generator stream), as a full tensor."""
    import perparam

    model = nn.Linear(4, 5)
    if world_size:
        perparam.fully_shard(model)
    torch.manual_seed(1)
    out = {}
    with torch.no_grad():
        for name, init in INITIALIZERS.items():
            if init is not None:
                init(model.weight)
                w = model.weight
                out[name] = (w.full_tensor() if world_size else w).detach().clone()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_orthogonal_xavier_kaiming_normal_eye_and_item_assignment_match_the_unsharded_model(world_size):
    """Initializers drawing into new tensors (``orthogonal_``: ``new_empty(...).normal_``), factories into the
    parameter (``eye_``: ``torch.eye(..., out=p)``) and ``p[i, j] = x`` (a row on one rank): bitwise."""
    ref = one_process(other_initializers)
    for got in run_distributed(other_initializers, world_size):
        for name in ref:
            assert torch.equal(got[name], ref[name]), (name, (got[name] - ref[name]).abs().max().item())
