"""``ShardedAccelerator``: accelerate's ``Accelerator`` for a training loop over a perparam-sharded model.

On CPU (and on any backend without accelerate's FSDP2 plugin), ``Accelerator.prepare(model)`` wraps a
multi-process model in DDP, which refuses DTensor parameters; ``save_state`` writes rank 0's optimizer
state only and ``get_state_dict`` returns the local shards. This subclass (same arguments) overrides
public, documented methods only:

* ``prepare``: a model sharded by ``fully_shard`` is prepared for autocast only (no DDP, no device move,
  no second sharding); optimizers, dataloaders and schedulers as accelerate prepares them.
* ``no_sync`` (used by ``accumulate``): no gradient reduction on the micro-batches of an accumulation
  window, one reduction at its last backward (``set_requires_gradient_sync``).
* ``get_state_dict``: the full state dict (``perparam.full_state.full_state_dict``; every rank calls it,
  rank 0 gets the tensors, the others ``None``).
* ``save_state`` / ``load_state``: accelerate's own files (optimizers, schedulers, dataloaders, RNG,
  registered objects, models not sharded) plus a perparam checkpoint (``perparam.checkpoint``) of each
  sharded model with its optimizer in ``<dir>/perparam_state_<i>``, which restores every rank's model and
  optimizer shards; accelerate's model files leave the sharded models out (through its documented
  ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``).

Imports ``accelerate``: import it as ``perparam.hf_accelerate``, never from ``perparam`` itself.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from torch import nn

from .. import checkpoint
from ..full_state import full_state_dict
from ..module import ShardedModule
from ..sharding.errors import ShardingError
from .entry import check_sharded, deferred_reduction, sharded_roots

STATE_DIR = "perparam_state_{}"

_FSDP_CLASSES: dict[type, type] = {}


def as_fsdp2_module(model: nn.Module) -> nn.Module:
    """Opt-in, for accelerate's FSDP2 plugin (``fsdp_version: 2``, active on GPU backends only): make every
    sharded module of ``model`` also an instance of torch's ``FSDPModule``, so accelerate's
    ``fsdp2_prepare_model`` takes the model as already sharded (it returns it unchanged instead of sharding
    again, which torch's ``fully_shard`` refuses for a module perparam sharded). perparam's methods of
    FSDP2's names come first (``reshard``, ``unshard``, ``set_requires_gradient_sync``, ...); FSDP2's others
    (``set_post_optim_event``, ``set_unshard_in_backward``, ``register_fsdp_forward_method``'s wrapper) read
    FSDP2's private state, which a perparam module does not have, and fail. torch's code paths that find an
    ``FSDPModule`` and read that state (torch's pipelining stage: use ``perparam.pipelining.PipelineStage``)
    fail likewise, which is why ``fully_shard`` does not do this by itself. Returns ``model`` (changed in
    place: each module's class is swapped for a subclass of its sharded class and ``FSDPModule``, with the
    same name). Raises ``ShardingError`` when ``model`` is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    from ..runtime.registration import BASE_ATTR

    check_sharded(model, "as_fsdp2_module")
    for m in model.modules():
        cls = type(m)
        if not isinstance(m, ShardedModule) or isinstance(m, FSDPModule):
            continue
        fsdp_cls = _FSDP_CLASSES.get(cls)
        if fsdp_cls is None:
            base = cls.__dict__.get(BASE_ATTR, cls)
            fsdp_cls = type(cls.__name__, (cls, FSDPModule), {"__module__": cls.__module__, BASE_ATTR: base})
            fsdp_cls._orig_cls_mro_index = fsdp_cls.__mro__.index(base)  # what FSDPModule.__new__ builds
            fsdp_cls = _FSDP_CLASSES.setdefault(cls, fsdp_cls)
        m.__class__ = fsdp_cls
    return model


def _inner(obj):
    """The object accelerate wrapped (``AcceleratedOptimizer.optimizer``), or ``obj``."""
    return getattr(obj, "optimizer", obj)


def _one_or_all(opts: list):
    """What ``checkpoint.save``/``load`` take: ``None``, the one optimizer (the layout of earlier saves), or
    all."""
    return None if not opts else opts[0] if len(opts) == 1 else opts


class ShardedAccelerator(Accelerator):
    """``accelerate.Accelerator`` (same arguments) that trains, accumulates, clips, saves and resumes a model
    sharded by ``perparam.fully_shard``. Raises ``ShardingError`` at construction for a process group
    accelerate does not see (launched without torchrun's variables). ``prepare`` raises ``ShardingError``
    for a sharded model with a trainable parameter no ``fully_shard`` call manages."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if self.num_processes != ranks:
            raise ShardingError(
                f"ShardedAccelerator: accelerate sees {self.num_processes} process(es) but the process group "
                f"has {ranks} ranks, so every rank would read the same batches (prepared data loaders not "
                "split) and save as the main process; launch with torchrun or accelerate launch (or set "
                "RANK, LOCAL_RANK and WORLD_SIZE before the first Accelerator)")
        self.sharded_models: list[nn.Module] = []  # in prepare's order
        self.prepared_optimizers: list = []  # every optimizer prepared (matched to a model by its parameters)
        # accelerate's documented hooks: its own model files skip the sharded models (their safetensors save
        # and load cannot take DTensors); the perparam checkpoints below hold them
        self.register_save_state_pre_hook(self._drop_sharded)
        self.register_load_state_pre_hook(lambda models, input_dir: self._drop_sharded(models))

    def _drop_sharded(self, models: list, weights: list | None = None, output_dir: str | None = None) -> None:
        for i in reversed(range(len(models))):
            if any(models[i] is m for m in self.sharded_models):
                del models[i]
                if weights is not None:
                    del weights[i]

    def prepare(self, *args, device_placement=None):
        """``Accelerator.prepare``; a sharded model comes back as itself (autocast applied when mixed
        precision is on), never wrapped in DDP."""
        sharded = [i for i, a in enumerate(args) if isinstance(a, nn.Module) and sharded_roots(a)]
        for i in sharded:
            check_sharded(args[i], "ShardedAccelerator.prepare")
        rest = [a for i, a in enumerate(args) if i not in sharded]
        placement = None if device_placement is None else [d for i, d in enumerate(device_placement)
                                                           if i not in sharded]
        prepared = super().prepare(*rest, device_placement=placement) if rest else ()
        prepared = list(prepared) if isinstance(prepared, tuple) else [prepared]
        out = []
        for i, a in enumerate(args):
            if i in sharded:
                out.append(self.prepare_model(a, device_placement=False, evaluation_mode=True))
                if not any(a is m for m in self.sharded_models):  # prepared again: saved once
                    self.sharded_models.append(a)
            else:
                out.append(prepared.pop(0))
                if hasattr(out[-1], "param_groups"):
                    self.prepared_optimizers.append(out[-1])
        return out[0] if len(out) == 1 else tuple(out)

    def no_sync(self, model):
        """Accelerate's ``no_sync``; for a sharded model: gradients accumulate unsharded, without reduction,
        until a backward outside this context reduces them once."""
        roots = sharded_roots(self.unwrap_model(model))
        return deferred_reduction(roots) if roots else super().no_sync(model)

    def get_state_dict(self, model, unwrap: bool = True):
        """The full (unsharded) state dict of a sharded model on rank 0 (``None`` on the others; every rank
        must call it); accelerate's for any other model."""
        inner = self.unwrap_model(model) if unwrap else model
        if sharded_roots(inner):
            return full_state_dict(inner)
        return super().get_state_dict(model, unwrap=unwrap)

    def _pairs(self) -> list[tuple[nn.Module, list]]:
        """Each sharded model with every prepared optimizer over its parameters (e.g. Muon and AdamW on
        disjoint parts). Raises ``CheckpointError`` for an optimizer over several sharded models (its shards
        are saved with one model's checkpoint)."""
        owned = [{id(p) for p in model.parameters()} for model in self.sharded_models]
        pairs = [(model, []) for model in self.sharded_models]
        for o in self.prepared_optimizers:
            held = {id(p) for g in _inner(o).param_groups for p in g["params"]}
            models = [i for i, own in enumerate(owned) if held & own]
            if len(models) > 1:
                raise checkpoint.CheckpointError(
                    f"ShardedAccelerator: one optimizer holds parameters of sharded models {models} (in "
                    "prepare's order); each sharded model is checkpointed with its optimizers' shards, so "
                    "give each sharded model its own optimizer (one over its parameters)")
            if models:
                pairs[models[0]][1].append(_inner(o))
        return pairs

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs):
        """``Accelerator.save_state``, then each sharded model and its optimizer (every rank's shards) as a
        perparam checkpoint in ``<output_dir>/perparam_state_<i>``. Every rank must call it. Returns the
        folder written."""
        pairs = self._pairs()  # its refusals before accelerate writes anything
        location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        for i, (model, opts) in enumerate(pairs):
            checkpoint.save(os.path.join(location, STATE_DIR.format(i)), model, _one_or_all(opts), keep=None)
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs):
        """``Accelerator.load_state``, then every rank's model and optimizer shards from the perparam
        checkpoints ``save_state`` wrote (they replace what accelerate loaded into the sharded models and
        their optimizers: rank 0's optimizer file holds rank 0's shards only). ``input_dir`` is required
        when a sharded model was prepared. Raises ``CheckpointError`` when a checkpoint is missing."""
        if input_dir is None and self.sharded_models:
            raise checkpoint.CheckpointError("ShardedAccelerator.load_state needs input_dir (the folder "
                                             "save_state returned) for a sharded model")
        super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        for i, (model, opts) in enumerate(self._pairs()):
            path = os.path.join(input_dir, STATE_DIR.format(i))
            if not os.path.isdir(path):
                raise checkpoint.CheckpointError(f"ShardedAccelerator.load_state({input_dir!r}): no "
                                                 f"{STATE_DIR.format(i)}/ folder (the sharded model and "
                                                 "every rank's optimizer shards); load a folder "
                                                 "ShardedAccelerator.save_state wrote")
            checkpoint.load(path, model, _one_or_all(opts))
