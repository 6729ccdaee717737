"""Hugging Face model methods that cannot run on a sharded model, refused at the call with the recipe.

Duck-typed: nothing here imports ``transformers`` or ``peft``. ``fully_shard`` calls ``guard`` on every
module of the tree it takes; a module whose class has one of the methods below gets an instance attribute
of that name (this module only; the class and other instances are untouched) that raises before anything
is changed:

* ``save_pretrained(dir)`` without ``state_dict=`` (``transformers.PreTrainedModel``, ``peft.PeftModel``):
  it would write the local shards' storage (safetensors fails with "invalid python storage").
  ``CheckpointError``; the recipe: ``save_pretrained(dir, state_dict=perparam.full_state.full_state_dict(
  model))`` on rank 0 (every rank gathers). With ``state_dict=`` the class's own method runs.
* ``resize_token_embeddings``, ``resize_position_embeddings``, ``prune_heads``: they build modules or
  parameters from the sharded ones (DTensor fails with an opaque ``NotImplementedError``) and register
  them into the sharded tree. ``ShardedTreeChangeError`` (the kind ``perparam.runtime.registration``
  raises); the recipe: call it before ``fully_shard``.

docs/huggingface.md has the recipes.
"""

from __future__ import annotations

import functools

from torch import nn

from ..errors import CheckpointError
from ..runtime.registration import ShardedTreeChangeError, class_name

#: methods that change the module tree: name -> what they change
TREE_CHANGES = {
    "resize_token_embeddings": "replaces the input (and output) embedding modules",
    "resize_position_embeddings": "replaces the position embedding parameters",
    "prune_heads": "replaces the attention projections with smaller ones",
}


def guard(module: nn.Module) -> None:
    """Put the refusing methods on ``module`` (an instance attribute per method its class has)."""
    cls = type(module)
    if callable(getattr(cls, "save_pretrained", None)):
        module.__dict__["save_pretrained"] = functools.partial(_save_pretrained, module)
    # partials of module-level functions: a deep copy rebinds them, pickle takes them
    for name in TREE_CHANGES:
        if callable(getattr(cls, name, None)):
            module.__dict__[name] = functools.partial(_refuse_tree_change, module, name)


def _save_pretrained(self: nn.Module, *args, **kwargs):
    if kwargs.get("state_dict") is None:
        raise CheckpointError(
            f"{class_name(self)}.save_pretrained(...) on a model sharded by fully_shard would write each "
            "rank's shards of the parameters (safetensors cannot save a DTensor). Gather the full weights "
            "and pass them (every rank calls full_state_dict, rank 0 saves): state = "
            "perparam.full_state.full_state_dict(model); if rank == 0: model.save_pretrained(path, "
            "state_dict=state). For stored-quantized (NF4) weights use "
            "perparam.full_state.dequantized_full_state_dict(model) instead (docs/huggingface.md)")
    return type(self).save_pretrained(self, *args, **kwargs)


def _refuse_tree_change(self: nn.Module, name: str, *args, **kwargs):
    raise ShardedTreeChangeError(
        f"perparam: {class_name(self)}.{name}(...) {TREE_CHANGES[name]} of a model sharded by fully_shard; "
        "the new parameters would be built from sharded ones and be neither sharded nor reduced. Call "
        f"{name} before fully_shard (build the model again, {name}, then fully_shard), or change an "
        "unsharded copy loaded from perparam.full_state.full_state_dict(model)")
