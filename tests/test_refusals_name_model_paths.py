"""Refusals name a parameter by its path in the model (``layers.1.mlp.up.weight``) once perparam knows the
root (the outermost module ``fully_shard`` was given, applied bottom-up), not by its name inside its own
``fully_shard`` call (``'mlp.up.weight' of Linear``, issue 44); and ``clip_grad_norm_`` refuses a
``max_norm`` that would flip (negative) or NaN every gradient. One launch of two ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import perparam
from tests.distributed import run_distributed


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(7, 5), nn.Linear(5, 7)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x):
        return self.mlp(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _build(root: bool = True, meta: bool = False) -> Model:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = Model()
    for layer in model.layers:
        perparam.fully_shard(layer)
    if root:
        perparam.fully_shard(model)
    return model


def _message(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the refusal's type is checked by the caller through the text)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _refusals(rank, world_size):
    out = {}

    def muon(root=True):
        model = _build(root)
        model(torch.randn(2, 7)).sum().backward()
        torch.optim.Muon([model.layers[1].mlp.up.weight], lr=0.1).step()
    out["muon"] = _message(muon)
    out["muon_no_root"] = _message(lambda: muon(root=False))

    def replaced():
        model = _build()
        model.layers[1].mlp.up.weight = nn.Parameter(torch.zeros(5, 7))
    out["replaced"] = _message(replaced)

    def data():
        model = _build()
        model.layers[1].mlp.down.weight.data = torch.zeros(3, 3)
    out["data"] = _message(data)
    out["meta"] = _message(lambda: _build(meta=True)(torch.randn(2, 7)))

    model = _build()
    model(torch.randn(2, 7)).sum().backward()
    before = [p.grad.to_local().clone() for p in model.parameters()]
    for value in (-1.0, float("nan"), float("-inf"), torch.tensor(-2.0)):
        out[f"clip {float(value)}"] = _message(
            lambda v=value: perparam.clip_grad_norm_(model.parameters(), v))
    out["unchanged"] = all(torch.equal(b, p.grad.to_local()) for b, p in zip(before, model.parameters()))
    out["inf"] = perparam.clip_grad_norm_(model.parameters(), float("inf")).item()
    out["inf_unchanged"] = all(torch.equal(b, p.grad.to_local()) for b, p in zip(before, model.parameters()))
    out["zero"] = _message(lambda: perparam.clip_grad_norm_(model.parameters(), 0.0))

    inv_model = Model()
    perparam.fully_shard(inv_model, mesh=init_device_mesh("cpu", (world_size,)))
    iu = perparam.InvariantUnits(inv_model, units=2)
    out["invariant clip"] = _message(lambda: iu.clip_grad_norm_(-0.5))
    iu.close()
    return out


@pytest.fixture(scope="module")
def refusals():
    got = run_distributed(_refusals, 2)
    same = [k for k in got[0] if k != "data"]  # (data names this rank's shard shape)
    assert [got[0][k] for k in same] == [got[1][k] for k in same]  # every rank refuses alike
    return got[0]


@pytest.mark.fast
def test_refusals_after_fully_shard_of_the_root_name_the_parameter_by_its_model_path(refusals):
    muon = refusals["muon"]
    assert muon.startswith("WholeMatrixShardError: Muon computes"), muon
    assert "parameter 'layers.1.mlp.up.weight' (Linear, shape (5, 7))" in muon, muon
    # the fix keeps the name the fully_shard call that shards it understands
    assert "fully_shard(..., param_policy={'mlp.up.weight': ParamPolicy(update='owner')})" in muon, muon
    assert "parameter 'layers.1.mlp.up.weight' (Linear.weight) was replaced" in refusals["replaced"]
    assert "sharded parameter 'layers.1.mlp.down.weight' (global shape [7, 5]" in refusals["data"]
    assert "Parameter 'layers.0.mlp.up.weight' of Layer is on the meta device" in refusals["meta"]


def test_before_the_root_is_sharded_a_parameter_is_named_inside_its_call(refusals):
    message = refusals["muon_no_root"]
    assert "parameter 'mlp.up.weight' (Linear, shape (5, 7))" in message, message


def test_a_negative_or_nan_max_norm_is_refused_before_any_gradient_changes(refusals):
    for value, harm in (("-1.0", "flip the sign"), ("nan", "make every gradient NaN"),
                        ("-inf", "flip the sign"), ("-2.0", "flip the sign")):
        message = refusals[f"clip {value}"]
        assert message.startswith(f"ValueError: clip_grad_norm_: max_norm={value} would {harm}"), message
    assert refusals["unchanged"]
    assert refusals["invariant clip"].startswith("ValueError: clip_grad_norm_: max_norm=-0.5"), refusals
    # documented use: inf measures the norm and leaves the gradients; 0 zeroes them, as torch's does
    assert refusals["inf"] > 0 and refusals["inf_unchanged"] and refusals["zero"] == "no error"
