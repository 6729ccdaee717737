"""``perparam.InvariantUnits`` refuses gradients it would not count, at once and on every rank.

Before the fix (issue 44, measured on this file's model: weight ``[1]`` with ``x = [1, 2, 3, 4]``, loss
``w * x`` per unit, U = 4): (a) a ``backward()`` after leaving ``with iu.unit(...)`` lost the rank's earlier
unit; (b) an extra loss's backward between the units and ``reduce()`` was dropped; (c) the same after
``reduce()`` was divided by U, not K; (d) an optimizer step without ``reduce()`` stepped on nothing and was
reported one unit later. Each now raises ``InvariantError`` naming the module and the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import perparam
from tests.distributed import run_distributed


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(1, 1, bias=False)
        nn.init.ones_(self.inner.weight)

    def forward(self, x):
        return self.inner(x)


def _model(world_size):
    model = Scale()
    mesh = init_device_mesh("cpu", (world_size,))
    perparam.fully_shard(model.inner, mesh=mesh)
    perparam.fully_shard(model, mesh=mesh)
    return model


X = torch.tensor([[1.0], [2.0], [3.0], [4.0]])


def _misuse(rank, world_size, case):
    model = _model(world_size)
    iu = perparam.InvariantUnits(model, units=4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    errors = []

    def misuse_here():
        return True

    try:
        for u, xu in iu.split(X):
            with iu.unit(u, 0):
                loss = model(xu).sum()
                if case != "a":
                    loss.backward()
            if case == "a" and misuse_here():
                loss.backward()  # the ported plain-accumulation loop: backward after the unit
        if case == "b" and misuse_here():
            model(X[:1]).sum().backward()  # an extra loss between the units and reduce()
        if case != "d":
            iu.reduce()
        if case == "c" and misuse_here():
            model(X[:1]).sum().backward()  # the same after reduce()
        opt.step()
    except perparam.InvariantError as e:
        errors.append(str(e))
    return errors


CASES = {"a": "after leaving", "b": "before iu.reduce()",
         "c": "after iu.reduce()", "d": "step with"}


@pytest.mark.fast
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gradient_outside_a_unit_or_a_step_without_reduce_is_refused_on_every_rank(case):
    for errors in run_distributed(_misuse, 2, case):
        assert len(errors) == 1 and CASES[case] in errors[0], errors
        if case != "d":
            assert "'inner'" in errors[0] or "'Scale'" in errors[0], errors[0]


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_uncounted_gradients_refused_at_every_rank_count(world_size, case):
    for errors in run_distributed(_misuse, world_size, case):
        assert len(errors) == 1 and CASES[case] in errors[0], errors


def _one_rank_backward(rank, world_size):
    model = _model(world_size)
    iu = perparam.InvariantUnits(model, units=4)
    errors = []
    for u, xu in iu.split(X):
        with iu.unit(u, 0):
            model(xu).sum().backward()
    extra = model(X[:1]).sum()  # every rank runs the forward (its all-gathers) ...
    if rank == 0:
        try:
            extra.backward()  # ... rank 0 alone its backward, refused at once; it goes on to reduce()
        except perparam.InvariantError as e:
            errors.append(str(e))
    try:
        iu.reduce()
    except perparam.InvariantError as e:
        errors.append(str(e))
    return errors


def test_a_gradient_outside_a_unit_on_one_rank_is_refused_on_every_rank_at_reduce():
    """Rank 0 alone runs the extra backward (and catches the refusal); every rank all-reduces its refusal
    flag at ``reduce()``: both raise there, neither hangs."""
    r0, r1 = run_distributed(_one_rank_backward, 2)
    assert len(r0) == 2 and CASES["b"] in r0[0] and r0[1] == r0[0], r0
    assert len(r1) == 1 and "another rank refused" in r1[0], r1


def _clean_steps(rank, world_size):
    """The documented loop: units, reduce, clip, step, several steps; then close and a plain backward."""
    model = _model(world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with perparam.InvariantUnits(model, units=4) as iu:
        for step in range(2):
            for u, xu in iu.split(X):
                with iu.unit(u, step):
                    model(xu).sum().backward()
            iu.reduce()
            iu.clip_grad_norm_(10.0)
            opt.step()
            opt.zero_grad()
    model(X[rank:rank + 1]).sum().backward()  # the mode is off: a plain backward is accepted
    opt.step()
    return model.inner.weight.full_tensor().item()


def test_the_documented_loop_and_a_plain_backward_after_close_are_accepted():
    got = run_distributed(_clean_steps, 2)
    # w = 1, each step's gradient mean(x) = 2.5 (clipped below 10): 1 - 0.25 - 0.25, then the plain step's
    # gradient mean over ranks of x_rank = 1.5: 0.5 - 0.15
    assert got == [pytest.approx(0.35)] * 2, got
