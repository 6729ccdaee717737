"""Optimizers from outside torch on sharded parameters: the whole-matrix ones users reach through transformers
(``transformers.optimization.Adafactor``, GaLore, APOLLO, StableAdamW: ``perparam.runtime.whole_matrix``) are
refused before their first step as torch's Muon and Adafactor are, and train on the owner path like one
process; any other optimizer whose step fails with DTensor's "got mixed torch.Tensor and DTensor" gets one
error naming the optimizer, the parameter and ``ParamPolicy(update='owner')`` on every rank
(``perparam.runtime.mixed_step``); ``ShardedTrainer`` with ``optim="adafactor"`` trains on owner parameters
and is refused at the start of ``train()`` without them; optimizers that step inside backward are refused at
its construction."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch
from torch import nn

import perparam
from perparam import ParamPolicy
from perparam.runtime import owner_step, whole_matrix
from tests.distributed import run_distributed
from tests.hf_helpers import Tokens, launched, make_llama

HF = all(importlib.util.find_spec(n) for n in ("transformers", "accelerate"))
needs_hf = pytest.mark.skipif(not HF, reason="transformers and accelerate are test dependencies")
OWNER = ParamPolicy(update="owner")


class RmsScaled(torch.optim.Optimizer):
    """A user's optimizer from outside torch: each step divided by a running sum of the gradient's RMS, kept
    in a plain 0-dim tensor (the kind of whole-tensor statistic DTensor refuses beside a shard)."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["scale"] = torch.zeros(())
                state["scale"].add_(p.grad.pow(2).mean().sqrt())
                p.add_(p.grad / state["scale"], alpha=-group["lr"])


class PlainSgd(torch.optim.Optimizer):
    """An elementwise optimizer from outside torch (the watch lets it through untouched)."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-2, relative_step=False, scale_parameter=True, warmup_init=False)


def _model(world_size: int, policy=None) -> nn.Module:
    """Linear(8, 6), Linear(6, 5) without bias; sharded per layer then at the root (4 ranks: 5 rows as
    2/2/1/0, an empty shard)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 5, bias=False))
    if world_size:
        for layer in model:
            perparam.fully_shard(layer, param_policy=policy)
        perparam.fully_shard(model, param_policy=policy)
    return model


def _train(rank: int, world_size: int, make: str, policy=None, steps: int = 3):
    """``steps`` steps of the optimizer ``make`` names; the full parameters after them, or the refusal's
    message (and its exception class name, and the torch function mode stack's depth after it)."""
    if make == "unrecognised_adafactor":  # transformers' Adafactor as if perparam did not know it
        whole_matrix.KNOWN.pop("transformers.optimization.Adafactor")
    model = _model(world_size, policy)
    opt = {"adafactor": _adafactor, "unrecognised_adafactor": _adafactor, "rms": RmsScaled,
           "plain_sgd": PlainSgd, "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1)}[make](model.parameters())
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps):
            x = torch.randn(12, 8, generator=g)  # the global batch; each rank its rows (gradients averaged)
            if world_size:
                x = x.chunk(world_size)[rank]
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return type(e).__name__, str(e), torch._C._len_torch_function_stack()
    full = [p.full_tensor() if world_size else p.detach() for p in model.parameters()]
    return [t.clone() for t in full], torch._C._len_torch_function_stack()


@needs_hf
def test_transformers_adafactor_on_shards_is_refused_before_its_first_step_naming_the_owner_policy():
    for world_size in (2, 4):
        for name, message, _ in run_distributed(_train, world_size, "adafactor"):
            assert name == "WholeMatrixShardError"
            assert message.startswith("Adafactor computes each parameter's update from the whole "
                                      "tensor"), message
            assert "parameter '0.weight' (Linear, shape (6, 8))" in message
            assert "ParamPolicy(update='owner')" in message
    # one rank: nothing is split, but the parameters are DTensors, which transformers' step mixes with its
    # plain state tensors: the step's error named the same way
    [(name, message, depth)] = run_distributed(_train, 1, "adafactor")
    assert name == "WholeMatrixShardError" and message.startswith(
        "Adafactor's step failed on parameter '0.weight' (Linear, shape (6, 8)), a DTensor over 1 rank(s): "
        "add_ got mixed torch.Tensor and DTensor"), message


@needs_hf
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_transformers_adafactor_on_the_owner_path_trains_like_one_process(world_size):
    """The owner steps each whole matrix with transformers' own step (parameter RMS scaling, factored second
    moment): the result matches one process to fp32 rounding of the reduced gradient."""
    want, _ = _train(0, 0, "adafactor")
    for got, depth in run_distributed(_train, world_size, "adafactor", OWNER):
        assert depth == 0
        assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-6


@needs_hf
def test_an_unrecognised_optimizer_failing_with_dtensors_mixed_tensor_error_gets_one_error_naming_the_fix():
    """DTensor's RuntimeError (transformers' Adafactor with perparam's table emptied of it: 1 rank, and 4
    with an empty shard) and its bare AssertionError (an in-place op on a plain 0-dim state tensor given a
    DTensor: 2 ranks) alike: the same error on every rank; elementwise optimizers from outside torch, and
    torch's, train untouched, leaving no mode entered."""
    for world_size, make in ((1, "unrecognised_adafactor"), (4, "unrecognised_adafactor"), (2, "rms")):
        for op in ("add_",):
            for name, message, _ in run_distributed(_train, world_size, make):
                cls = "Adafactor" if "adafactor" in make else "RmsScaled"
                assert name == "WholeMatrixShardError", message
                assert message.startswith(f"{cls}'s step failed on parameter '0.weight' (Linear, shape (6, "
                                          f"8)), a DTensor over {world_size} rank(s): {op} got mixed "
                                          "torch.Tensor and DTensor"), message
                assert "param_policy={'weight': ParamPolicy(update='owner')}" in message, message
    want, _ = _train(0, 0, "sgd")
    for make in ("plain_sgd", "sgd"):
        for got, depth in run_distributed(_train, 2, make):
            assert depth == 0
            assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-6
    # the same optimizer on the owner path: every rank stepped the whole matrix (nothing to catch)
    want, _ = _train(0, 0, "rms")
    for got, depth in run_distributed(_train, 2, "rms", OWNER):
        assert depth == 0 and max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-6


@pytest.mark.fast
def test_the_known_optimizers_are_recognised_by_name_and_galores_projected_groups_only():
    """Recognised along the class hierarchy without importing their packages; GaLore steps whole only the
    groups with a projection ``rank`` (transformers puts the other parameters in a group without it)."""
    galore = type("AdamW", (torch.optim.AdamW,), {"__module__": "galore_torch.adamw"})
    stable = type("StableAdamW", (torch.optim.AdamW,), {"__module__": "optimi.stableadamw"})
    mine = type("Mine", (stable,), {"__module__": "my.optim"})
    w = nn.Parameter(torch.ones(2, 2))
    for cls in (galore, stable, mine):
        assert owner_step.is_whole_matrix(cls) and owner_step.is_whole_matrix(cls([w]))
    opt = galore([{"params": [w]}, {"params": [nn.Parameter(torch.ones(2))], "rank": 1}])
    assert [whole_matrix.steps_whole(opt, g) for g in opt.param_groups] == [False, True]
    assert not owner_step.is_whole_matrix(torch.optim.AdamW) and not owner_step.is_whole_matrix(PlainSgd)
    assert not owner_step.is_whole_matrix(type("Off", (stable,), {"perparam_whole_matrix": False}))


def _trainer(rank: int, world: int, folder: str, optim: str, owner: bool, shard: bool = True):
    """``ShardedTrainer`` (``Trainer`` on the unsharded model when not ``shard``) on the tiny Llama with
    ``optim``, 3 steps: the full parameters, or the refusal's message and where it came (``init``,
    ``train``)."""
    world = world if shard else 0
    from transformers import Trainer, TrainingArguments

    from perparam import ShardingError, fully_shard
    from perparam.hf_trainer import ShardedTrainer

    launched(rank, world)
    model = make_llama()
    if world:
        policy = (lambda name, p: OWNER if p.requires_grad else None) if owner else None
        for layer in model.model.layers:
            fully_shard(layer, param_policy=policy)
        fully_shard(model, param_policy=policy)
    args = TrainingArguments(output_dir=os.path.join(folder, f"{optim}-{world}-{owner}"), optim=optim,
                             per_device_train_batch_size=4 // max(world, 1), learning_rate=1e-2, max_steps=3,
                             max_grad_norm=0.0, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="constant")
    where = "init"
    try:
        trainer = (ShardedTrainer if world else Trainer)(model=model, args=args, train_dataset=Tokens(12, 1))
        where = "train"
        trainer.train()
    except ShardingError as e:
        return where, str(e)
    from perparam.full_state import full_state_dict

    state = full_state_dict(model) if world else model.state_dict()
    return None if state is None else {k: v.clone() for k, v in state.items()}


@needs_hf
@pytest.mark.slow  # four launches, each rank importing transformers: 66 s on the loaded 2-core host
def test_sharded_trainer_with_optim_adafactor_trains_on_owner_parameters_and_is_refused_at_train_without():
    with tempfile.TemporaryDirectory() as folder:
        [want] = run_distributed(_trainer, 1, folder, "adafactor", False, False, timeout=240)
        got, none = run_distributed(_trainer, 2, folder, "adafactor", True, timeout=240)
        refused = run_distributed(_trainer, 2, folder, "adafactor", False, timeout=240)
        early = run_distributed(_trainer, 2, folder, "galore_adamw_layerwise", True, timeout=240)
    assert none is None and got.keys() == want.keys()
    assert max((got[k] - v).abs().max().item() for k, v in want.items()) < 1e-5
    for where, message in refused:
        assert where == "train", message
        assert message.startswith("ShardedTrainer: TrainingArguments(optim='adafactor') builds Adafactor, "
                                  "which computes each parameter's update from the whole tensor, and "
                                  "'model.embed_tokens.weight' (shape (33, 16)) is sharded over 2 "
                                  "ranks"), message
        assert "ParamPolicy(update='owner')" in message and "\n" not in message
    for where, message in early:
        assert where == "init" and "steps each parameter inside backward" in message, message
