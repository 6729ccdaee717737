"""``perparam finetune --optimizer {adamw,muon}``: the job's optimizers, held as one object.

- ``adamw`` (default): ``torch.optim.AdamW`` on every trainable parameter (``betas=(0.9, 0.95)``, no weight
  decay).
- ``muon``: the Muon recipe. ``torch.optim.Muon`` on the decoder layers' seven 2-D projection matrices
  (``attn.{q,k,v,o}_proj.weight``, ``mlp.{gate,up,down}_proj.weight``: :data:`MUON_WEIGHTS`), which the job
  shards with ``ParamPolicy(update="owner")`` (``docs/whole-matrix-optimizers.md``: each matrix is stepped
  whole by one owner rank); ``torch.optim.AdamW`` as above on the rest (embedding and tied head, RMSNorm
  weights). Muon takes ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's scaling, ``0.2 * sqrt(max(m, n))``,
  which gives the orthogonalized update the RMS of an AdamW update), so the one ``--lr`` serves both
  optimizers (the AdamW learning rate carries over, as "Muon is Scalable for LLM Training" reports), with
  the job's AdamW weight decay (0) and Muon's defaults otherwise (momentum 0.95, Nesterov, 5
  Newton-Schulz steps).

:class:`JobOptimizers` steps, zeroes and reports them as one (``param_groups`` and ``state`` are the
union); :class:`JobSchedule` is the learning-rate schedule on each (``schedule.build_scheduler``), stepped
together. ``perparam.checkpoint`` takes ``JobOptimizers.saved`` (Muon's and AdamW's state as a list) and
restores each one.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

import torch

from perparam.finetune import schedule
from perparam.finetune.errors import FinetuneInputError

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig

OPTIMIZERS = ("adamw", "muon")
#: the parameters Muon steps, named relative to a decoder layer: its seven projection weights
MUON_WEIGHTS = "*_proj.weight"
ADAMW_BETAS = (0.9, 0.95)


def check_config(cfg: JobConfig) -> None:
    """The launcher's one-line refusals of ``--optimizer muon`` with flags it cannot compose with."""
    if cfg.optimizer != "muon":
        return
    if cfg.lora is not None:
        raise FinetuneInputError("--optimizer muon with --lora/--qlora: the adapters are low-rank factors (A "
                                 "is rank x in, B is out x rank, B starts at zero), which the Muon recipe "
                                 "does not orthogonalize; drop --optimizer muon (AdamW trains the adapters)")
    if cfg.offload or cfg.memory_budget is not None:
        flag = "--offload" if cfg.offload else "--memory-budget"
        raise FinetuneInputError(f"--optimizer muon with {flag}: Muon's momentum of a matrix is whole on its "
                                 "owner rank, and the offload tiers move per-shard state; drop one of them")
    if cfg.tp > 1:
        raise FinetuneInputError(f"--optimizer muon with --tp {cfg.tp}: a tensor-parallel matrix cannot have "
                                 "an owner rank that steps it whole; pass --tp 1 (or drop --optimizer muon)")


def muon_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The decoder layers' projection weights (:data:`MUON_WEIGHTS`), in the model's order."""
    return [p for layer in model.layers for n, p in layer.named_parameters()
            if fnmatch.fnmatchcase(n, MUON_WEIGHTS) and p.requires_grad]


class JobOptimizers:
    """The job's optimizers as one: ``step``/``zero_grad`` on each in turn; ``param_groups`` and ``state``
    are the union (for the learning rate shown and the bytes measured); ``optimizers`` the list."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @property
    def saved(self):
        """What ``perparam.checkpoint.save/load`` take: the one optimizer (AdamW: the checkpoints of runs
        before ``--optimizer``), or the list."""
        return self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers

    def describe(self) -> str:
        """One line: which optimizer steps how many tensors."""
        return ", ".join(f"{type(opt).__name__} on {sum(len(g['params']) for g in opt.param_groups)} tensors"
                         for opt in self.optimizers)


def build(kind: str, model: torch.nn.Module, params: list[torch.nn.Parameter], lr: float) -> JobOptimizers:
    """``--optimizer kind`` over ``params`` (the trainable parameters of the sharded ``model``)."""
    if kind == "adamw":
        return JobOptimizers([torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, weight_decay=0.0)])
    if kind != "muon":
        raise FinetuneInputError(f"--optimizer {kind}: expected one of {', '.join(OPTIMIZERS)}")
    hidden = muon_matrices(model)
    ids = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in ids]
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    return JobOptimizers([muon, torch.optim.AdamW(rest, lr=lr, betas=ADAMW_BETAS, weight_decay=0.0)])


class JobSchedule:
    """The learning-rate schedule (``schedule.build_scheduler``) on each of the job's optimizers, stepped
    together: their states are equal (the same factor over one group each), so ``state_dict`` is the first's
    and ``--resume`` restores each from it."""

    def __init__(self, optimizers: JobOptimizers, lr: float, steps: int, warmup_steps: int = 0,
                 min_lr: float | None = None) -> None:
        self.schedulers = [schedule.build_scheduler(opt, lr, steps, warmup_steps, min_lr)
                           for opt in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def restore(self, state: dict | None, step: int, lr: float) -> None:
        for s in self.schedulers:
            schedule.restore(s, state, step, lr)
