"""``ShardedTrainer``: Hugging Face ``transformers.Trainer`` for a model perparam has sharded.

A user's ``Trainer`` script runs unchanged with ``Trainer`` replaced by ``ShardedTrainer`` and the model
sharded by ``fully_shard`` first (each decoder layer, then the root, with any per-parameter policies):
``gradient_accumulation_steps``, ``max_grad_norm``, evaluation, ``save_strategy``, ``save_model`` and
``resume_from_checkpoint`` (model, every rank's optimizer shards, scheduler, RNG, data position) work as
they do on one process. Imports ``transformers``: import it as ``perparam.hf_trainer``, never from
``perparam`` itself.

Why a ``Trainer`` subclass and not a callback: a ``TrainerCallback`` sees events, but the three things a
sharded model needs are decided by the trainer's own methods: how accelerate prepares the model (the stock
path wraps it in DDP, which refuses DTensor parameters), how gradient accumulation defers the reduction,
and how the optimizer is checkpointed (the stock path saves rank 0's ``optimizer.state_dict()``, i.e. one
rank's shards). transformers has a mode for a model that owns its placement and gradient reduction (a
model sharded at load time by its ``DistributedConfig``): the trainer attribute
``is_distributed_loading_by_transformers`` selects it, and this subclass sets it. What is private in
transformers 5.24.0, used here only, and pinned by ``tests/test_hf_trainer.py``
(``test_the_private_trainer_methods_the_piece_overrides_are_unchanged``):

* the attribute ``is_distributed_loading_by_transformers`` (read by ``_prepare_for_training``, the
  accumulation loop and ``_save``);
* ``_defer_fsdp_gradient_reduction`` (overridden: ``set_requires_gradient_sync`` on the sharded roots);
* ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` (overridden: a perparam checkpoint,
  ``perparam.checkpoint.save``/``load``, of the model and every rank's optimizer shards in
  ``<checkpoint>/perparam_state``; the scheduler as the stock trainer saves it);
* ``_save`` (called by ``save_model`` on the writing rank with the gathered full state dict).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import Trainer

from .. import checkpoint
from ..full_state import full_state_dict
from ..runtime import owner_step
from ..runtime.group import group_of
from ..sharding.errors import ShardingError
from .entry import check_sharded, deferred_reduction, sharded_roots

#: the folder, inside each ``checkpoint-N``, of the perparam checkpoint (model and optimizer shards)
STATE_DIR = "perparam_state"
#: the stock trainer's scheduler file name (``transformers.trainer.SCHEDULER_NAME``)
SCHEDULER_NAME = "scheduler.pt"


#: ``TrainingArguments.optim`` values whose optimizer steps parameters inside backward (a per-parameter hook:
#: LOMO's fused backward, the layerwise GaLore/APOLLO), before perparam has reduced the gradients across ranks
IN_BACKWARD = ("lomo", "adalomo", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
               "galore_adafactor_layerwise", "apollo_adamw_layerwise")


def _optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))


def _optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


class ShardedTrainer(Trainer):
    """``transformers.Trainer`` (same arguments) for a model sharded by ``perparam.fully_shard``.

    Raises ``ShardingError`` at construction for a model that is not sharded, has a trainable parameter
    no ``fully_shard`` call manages, or a process group that ``TrainingArguments`` does not see (launched
    without torchrun's variables: every rank would read the same batches and write as rank 0). On every rank
    it gathers ``save_model``'s full state dict (rank 0 writes it: ``from_pretrained`` loads it) and writes
    each checkpoint's optimizer shards with ``perparam.checkpoint.save``, so ``resume_from_checkpoint``
    restores every rank's optimizer state.
    """

    def __init__(self, model: nn.Module | None = None, *args, **kwargs):
        check_sharded(model, "ShardedTrainer")
        super().__init__(model, *args, **kwargs)
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if self.args.world_size != ranks:
            raise ShardingError(
                f"ShardedTrainer: TrainingArguments sees {self.args.world_size} process(es) but the process "
                f"group has {ranks} ranks, so every rank would read the same batches (no distributed "
                "sampler) and save as rank 0; launch with torchrun (or set RANK, LOCAL_RANK and WORLD_SIZE "
                "before building TrainingArguments)")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
        if self.args.save_on_each_node and ranks > local:
            raise ShardingError(
                f"ShardedTrainer: save_on_each_node=True on {ranks // max(local, 1)} nodes: save_model "
                "gathers the full state dict on rank 0 only, so the other nodes' writing ranks would have "
                "nothing to write; set save_on_each_node=False (rank 0 writes; a shared output_dir reaches "
                "every node)")
        optim = _optim_name(self.args)
        if optim in IN_BACKWARD:
            raise ShardingError(
                f"ShardedTrainer: TrainingArguments(optim={optim!r}) steps each parameter inside backward "
                "from a per-parameter hook, before perparam has reduced its gradient across ranks (the "
                "update would use one rank's gradient); choose an optimizer stepped after backward: "
                f"optim='adamw_torch', 'adafactor', or {optim.replace('_layerwise', '')!r} for GaLore/APOLLO")
        # transformers' own switch for a model that owns its placement and gradient reduction: accelerate
        # prepares autocast only (no DDP wrap, no second sharding), every rank joins save_model's gathers
        self.is_distributed_loading_by_transformers = True

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The stock optimizer, refused before training starts (one line) when it steps whole tensors
        (``perparam.runtime.owner_step.is_whole_matrix``: Adafactor, GaLore's projected groups, ...) and holds
        a parameter sharded without ``ParamPolicy(update="owner")``: its first step would fail or be wrong."""
        optimizer = super().create_optimizer(model)
        held = [sp for m in self.model.modules() if (g := group_of(m)) is not None for sp in g.params]
        sp = owner_step.unrouted(_optimizer(optimizer), held)
        if sp is not None:
            name = next((n for n, p in self.model.named_parameters() if p is sp.sharded), sp.fqn)
            raise ShardingError(
                f"ShardedTrainer: TrainingArguments(optim={_optim_name(self.args)!r}) builds "
                f"{type(_optimizer(optimizer)).__name__}, which computes each parameter's update from the "
                f"whole tensor, and '{name}' (shape {tuple(sp.global_shape)}) is sharded over "
                f"{sp.layout.num_shards} ranks without an owner; shard the model with fully_shard(..., "
                "param_policy=lambda name, p: ParamPolicy(update='owner') if p.requires_grad else None) on "
                "each module (one rank steps each whole parameter, docs/whole-matrix-optimizers.md), or "
                "choose optim='adamw_torch'")
        return optimizer

    def _defer_fsdp_gradient_reduction(self):
        """The micro-batches before the last of an accumulation window: no reduction (gradients accumulate
        unsharded); the window's last backward reduces them once."""
        return deferred_reduction(sharded_roots(self.model))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Gather the full state dict on every rank and write it from the writing rank, so
        ``from_pretrained(output_dir)`` loads the trained model (every rank must call this)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = full_state_dict(self.model)  # a collective: rank 0 gets the tensors, the others None
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save(os.path.join(output_dir, STATE_DIR), self.model, _optimizer(self.optimizer))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        state = os.path.join(checkpoint_dir, STATE_DIR)
        if not os.path.isdir(state):
            raise checkpoint.CheckpointError(
                f"resume_from_checkpoint={checkpoint_dir!r} has no {STATE_DIR}/ folder (the model and every "
                "rank's optimizer shards ShardedTrainer writes); it was saved with save_only_model=True or "
                "by another trainer. Resume from a checkpoint ShardedTrainer saved, or start training "
                "without resuming")
        checkpoint.load(state, self.model, _optimizer(self.optimizer))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint_dir, SCHEDULER_NAME),
                                                     weights_only=True))
