"""What a root's forward checks before anything is issued (``perparam.runtime.hooks`` calls them): not inside
a ``torch.func`` transform (``TransformError``), no shard of the tree left on the meta device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..sharding.errors import MetaParameterError
from .registration import class_name

if TYPE_CHECKING:
    from .context import IterationContext
    from .group import ParamGroup


class TransformError(RuntimeError):
    """A sharded module was called inside a ``torch.func`` transform."""


def check_transforms(group: ParamGroup) -> None:
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is not None:
        raise TransformError(
            f"perparam: sharded module [{group.name}] was called inside a torch.func transform "
            f"({interpreter.key()}); its parameters are all-gathered by hooks that torch.func cannot "
            "transform. Run the transform on an unsharded copy of the model, or use torch.autograd "
            "(torch.autograd.grad(..., create_graph=True) and double backward are supported)")


def check_materialized(ctx: IterationContext) -> None:
    """Raise ``MetaParameterError`` naming the parameter when a shard of the tree is still on the meta device
    (a model built under ``torch.device("meta")`` and never given storage), before any collective: every
    rank built the same model, so every rank raises here."""
    for g in ctx.groups:
        for p in g.params:
            if p.sharded.device.type == "meta":
                owner = ", ".join(class_name(m) for m in g.modules)
                paths = {id(q): n for m in ctx.groups[0].modules for n, q in m.named_parameters()}
                on_meta = [paths.get(id(q.sharded), q.fqn)
                           for q in g.params if q.sharded.device.type == "meta"]
                raise MetaParameterError(
                    "FSDP parameters should be materialized from meta device before training, but the "
                    f"following were still on meta device: {on_meta}. "
                    f"Parameter '{p.path}' of {owner} is on the meta device: a model built under "
                    "torch.device('meta') has no values yet; before the first forward call "
                    "model.to_empty(device=...) and initialise it (e.g. reset_parameters() on each module), "
                    "or load weights with perparam.checkpoint.load_full_state_dict(model, state_dict)")
