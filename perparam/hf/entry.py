"""What the Hugging Face pieces (``perparam.hf_trainer``, ``perparam.hf_accelerate``) check at their entry:
which modules of a model are sharded roots, and that no trainable parameter escapes sharding. Imports
neither ``transformers`` nor ``accelerate``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..errors import ShardingError
from ..module import ShardedModule
from ..runtime.group import group_of


def sharded_roots(model: nn.Module) -> list[ShardedModule]:
    """The sharded modules of ``model``'s tree that no other sharded module contains (``model`` itself when
    it is the root ``fully_shard`` was called on last), in ``modules()`` order."""
    roots: list[ShardedModule] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, ShardedModule):
            continue
        roots.append(m)
        inside.update(id(sub) for sub in m.modules())
    return roots


def check_sharded(model: nn.Module | None, where: str) -> None:
    """Raise ``ShardingError`` unless every trainable parameter of ``model`` is managed by a ``fully_shard``
    call (the piece would otherwise train some of it unsharded and unreduced), naming the first that is
    not."""
    if not isinstance(model, nn.Module):
        raise ShardingError(f"{where} takes a model sharded by perparam.fully_shard (model_init is not "
                            "supported: build and shard the model, then pass it), got "
                            f"{type(model).__name__}")
    if not sharded_roots(model):
        raise ShardingError(f"{where}: {type(model).__name__} is not sharded by perparam; call fully_shard "
                            "on each decoder layer, then on the model (docs/huggingface.md), or use "
                            "transformers' Trainer for an unsharded model")
    managed = {id(sp.sharded) for m in model.modules() if (g := group_of(m)) is not None for sp in g.params}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in managed:
            raise ShardingError(f"{where}: trainable parameter '{name}' is not managed by any fully_shard "
                                "call, so it would train without being sharded or reduced across ranks; call "
                                "fully_shard on the model after adding it (adapters: before sharding), or "
                                "freeze it")


@contextlib.contextmanager
def deferred_reduction(roots: list[ShardedModule]) -> Iterator[None]:
    """The micro-batches before the last of an accumulation window: backwards inside accumulate unsharded
    gradients without reducing them; the next backward outside reduces them once
    (``set_requires_gradient_sync`` on each of ``roots``, put back on the way out)."""
    for root in roots:
        root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)
