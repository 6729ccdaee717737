"""Importing perparam changes nothing in the process: optimizer hooks come with the first ``fully_shard`` and
count only optimizers holding perparam parameters; the runtime's switches are one ``perparam.configure``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import perparam
from perparam import CommCounter
from tests.distributed import run_distributed
from tests.models import local_slice, make_batches, sharded_tiny

_NO_HOOKS = """
import torch.optim.optimizer as o
import perparam, perparam.checkpoint, perparam.memory
assert not o._global_optimizer_pre_hooks and not o._global_optimizer_post_hooks, "hooks at import"
"""


def test_importing_perparam_registers_no_optimizer_hook():
    subprocess.run([sys.executable, "-c", _NO_HOOKS], check=True, timeout=120)


_NO_HF = """
import sys
import perparam, perparam.hf, perparam.hf.entry, perparam.hf.methods, perparam.hf_entry, perparam.hf_methods
print(sorted(m for m in ("transformers", "accelerate", "peft") if m in sys.modules))
"""


def test_importing_perparam_loads_neither_transformers_nor_accelerate():
    """The core never imports the Hugging Face libraries (``perparam.hf.trainer`` and ``.accelerator`` do,
    imported by path): ``import perparam``, and ``perparam.hf`` with its files that need neither, in a fresh
    interpreter leave transformers, accelerate and peft out of ``sys.modules``."""
    out = subprocess.run([sys.executable, "-c", _NO_HF], check=True, timeout=120, capture_output=True,
                         text=True)
    assert out.stdout.strip() == "[]", out.stdout


def steps_of_other_optimizers(rank: int, world_size: int) -> list[int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # 3 and 2 rows on 2-3 ranks: uneven, empty
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before sharding: retargeted at its first step
    perparam.fully_shard(model)
    model.set_reshard_after_backward(False)
    other = nn.Linear(2, 2)  # another model of the process, with its own optimizer
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    gathers = []
    for step_other in (True, False):
        model(x).sum().backward()
        if step_other:
            other(torch.ones(1, 2)).sum().backward()
            other_opt.step()  # holds no perparam parameter: the kept parameters stay valid
        else:
            opt.step()  # holds them: the kept parameters are stale, gathered again
        with CommCounter() as comm:
            model(x)
        gathers.append(comm.count("all_gather"))
    return gathers


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.fast)])
def test_only_steps_of_optimizers_holding_perparam_parameters_mark_kept_parameters_stale(world_size):
    for gathers in run_distributed(steps_of_other_optimizers, world_size):
        assert gathers == [0, 1]


def configured_steps(rank: int, world_size: int, settings: dict) -> dict:
    if settings:
        perparam.configure(**settings)
    model = sharded_tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in make_batches(3, 4):
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_configured_runtimes_train_bitwise_alike():
    default = run_distributed(configured_steps, 2, {})
    other = run_distributed(configured_steps, 2, {"prefetch": False, "gloo_all_gather": "native",
                                                  "gloo_reduce_scatter": "native"})
    for a, b in zip(default, other):
        for name, value in a.items():
            assert torch.equal(b[name], value), name


@pytest.mark.fast
def test_configure_returns_the_previous_config_and_refuses_bad_settings():
    previous = perparam.configure(prefetch=False)
    try:
        assert perparam.configure().prefetch is False and previous.prefetch is True
        with pytest.raises(ValueError, match="gloo_all_gather must be one of"):
            perparam.configure(gloo_all_gather="ring")
        with pytest.raises(TypeError, match="unknown setting.*'prefech'"):
            perparam.configure(prefech=True)
        assert perparam.configure() == perparam.RuntimeConfig(prefetch=False)  # nothing changed by the errors
    finally:
        perparam.configure(prefetch=previous.prefetch)
