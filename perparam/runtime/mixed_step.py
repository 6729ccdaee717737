"""An optimizer from outside torch whose step fails on sharded parameters with DTensor's "got mixed
torch.Tensor and DTensor" (a whole-tensor statistic, state built from a plain tensor): the error named, with
the optimizer, the parameter and the owner policy (``owner_step.mixed_step_error``), instead of DTensor's
message from inside the optimizer's code. On one rank too: the parameters are DTensors there as well
(transformers' Adafactor fails on them at K = 1, where the whole-matrix check has nothing to refuse).

``watch(optimizer, held, binding)``, when the optimizer's parameters are checked (the ``Retarget`` stage of
its binding), for an optimizer whose class is not torch's and that steps a sharded parameter outside the
owner policy: a step pre-hook enters a ``TorchFunctionMode`` that lets every call through and turns that
one error into ``WholeMatrixShardError``; the post-hook leaves it. The mode entered is kept on the
optimizer's binding (``Binding.mixed_catch``). A step that raised leaves the mode entered: the next step's
pre-hook leaves it first (a spent mode lets everything through). Cost: one Python call per torch call
inside such a step.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from . import owner_step
from .untraced import untraced

__all__ = ["MIXED", "watch"]

#: DTensor's words for an operation given a plain tensor beside a DTensor
MIXED = "got mixed torch.Tensor and DTensor"

class _Catch(TorchFunctionMode):
    """Lets every torch call through; the first raising ``MIXED`` is raised as ``WholeMatrixShardError``."""

    def __init__(self, optimizer: torch.optim.Optimizer, held) -> None:
        super().__init__()
        self.optimizer = weakref.ref(optimizer)
        self.held = held  # the ShardedParams it holds (a set kept up to date by ``adopt``)
        self.spent = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.spent:
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except (RuntimeError, AssertionError) as error:
            optimizer = self.optimizer()
            if isinstance(error, owner_step.WholeMatrixShardError) or optimizer is None or not _mixed(error,
                                                                                                      args,
                                                                                                     kwargs):
                raise
            sp = self._param(optimizer, args, kwargs)
            if sp is None:
                raise
            self.spent = True
            raise owner_step.mixed_step_error(optimizer, sp, func, error) from error

    def _param(self, optimizer, args, kwargs):
        """The sharded parameter the failing call worked for: the one whose tensor, gradient or state is an
        argument; else the first this check covers, in the optimizer's order."""
        ids = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        candidates = _covered(optimizer, self.held)
        for sp in candidates:
            p = sp.sharded
            state = optimizer.state.get(p, {})
            if id(p) in ids or id(p.grad) in ids or any(id(v) in ids for v in state.values()):
                return sp
        return candidates[0] if candidates else None


def _mixed(error: BaseException, args, kwargs) -> bool:
    """Whether ``error`` is DTensor's refusal of a plain tensor beside a DTensor: its ``MIXED`` message, or
    the bare ``AssertionError`` of an in-place operation on a plain tensor given a DTensor."""
    if MIXED in str(error):
        return True
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return (isinstance(error, AssertionError) and bool(tensors) and not isinstance(tensors[0], DTensor)
            and any(isinstance(t, DTensor) for t in tensors))


def _covered(optimizer, held) -> list:
    """The parameters of ``held`` (``ShardedParam``s) in ``optimizer``'s order that it steps as DTensors (not
    under the owner policy; on one rank too): those a step may fail on."""
    by_id = {id(sp.sharded): sp for sp in held}
    out, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            sp = by_id.get(id(p))
            if sp is not None and id(p) not in seen and sp.policy.update != "owner":
                seen.add(id(p))
                out.append(sp)
    return out


def watch(optimizer: torch.optim.Optimizer, held, binding) -> None:
    """``held``: the ``ShardedParam``s ``optimizer`` holds now; ``binding``: its ``Binding`` (``binding.held``
    at each step; ``mixed_watched``, ``mixed_catch``: this check's state). Register the pre/post hooks of
    ``optimizer`` that name its step's mixed-tensor error (once per optimizer; nothing for torch's own
    optimizers, whole-matrix ones, or one holding no parameter a step may fail on)."""
    if binding.mixed_watched or type(optimizer).__module__.split(".")[0] == "torch":
        return
    if not _covered(optimizer, held):
        return
    binding.mixed_watched = True

    def pre_hook(opt, args, kwargs) -> None:
        _leave(binding)  # left entered by a step that raised
        catch = _Catch(opt, binding.held)
        catch.__enter__()
        binding.mixed_catch = catch

    def post_hook(opt, args, kwargs) -> None:
        _leave(binding)

    optimizer.register_step_pre_hook(untraced(pre_hook))
    optimizer.register_step_post_hook(untraced(post_hook))


def _leave(binding) -> None:
    catch = binding.mixed_catch
    if catch is None:
        return
    binding.mixed_catch = None
    stack = torch._C._len_torch_function_stack()
    if stack and torch._C._get_function_stack_at(stack - 1) is catch:
        catch.__exit__(None, None, None)
    else:
        catch.spent = True  # another mode entered above it: it lets everything through until it is left
