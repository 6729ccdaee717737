"""``perparam finetune --offload PATTERN=TIER`` and ``--memory-budget BYTES``: where each parameter's state
lives (``perparam.OffloadPolicy``, ``docs/offload.md``), given per pattern or planned under a budget.

- ``--offload PATTERN=TIER`` (repeatable; first match wins; patterns are fnmatch globs on the model's
  parameter names, e.g. ``'layers.*.mlp.*'``): TIER is ``disk`` (optimizer state on disk), ``disk:all``
  (also the stored shard), ``cpu``, ``cpu:all`` (on a CPU run the same memory: accepted, no-op) or
  ``device``.
- ``--memory-budget BYTES`` (``20e9``, ``16GiB``): ``perparam.memory.budget.plan_budget`` of the model on the
  shard axis's K, fp32 AdamW state (8 bytes per trainable element), then applied: the least traffic that
  keeps each rank's model state (stored shards, gradients, AdamW state; not activations) within BYTES.
- ``--offload-dir DIR``: the disk tier's folder (default: the system's temporary folder); it must exist and
  be writable (refused in one line otherwise: never created).

The summary's ``offload`` entry gives, per tier, the bytes planned (by the plan, or by the layouts for
``--offload``) and measured (the files this rank's tier holds).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import tempfile
from typing import TYPE_CHECKING

from perparam.finetune.errors import FinetuneInputError

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig

TIERS = ("device", "cpu", "cpu:all", "cpu:optimizer", "disk", "disk:all", "disk:optimizer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offload", action="append", default=None, metavar="PATTERN=TIER",
                        help="keep matching parameters' optimizer state (TIER disk) or everything (disk:all) "
                             "in files under --offload-dir; repeatable, first match wins (docs/offload.md)")
    parser.add_argument("--memory-budget", default=None, metavar="BYTES",
                        help="plan which parameters' state goes to disk so each rank's model state fits "
                             "BYTES (e.g. 2e9, 1.5GiB) with the least traffic, then apply it")
    parser.add_argument("--offload-dir", default=None, metavar="DIR",
                        help="folder of the disk tier, an existing writable one (default: the system's "
                             "temporary folder)")


def parse(specs: list[str] | None) -> list[tuple[str, str, str]]:
    """``PATTERN=TIER`` flags as ``(pattern, tier, state)``. Raises ``FinetuneInputError``."""
    out = []
    for spec in specs or ():
        pattern, sep, tier = spec.partition("=")
        if not sep or not pattern or tier not in TIERS:
            raise FinetuneInputError(f"--offload {spec!r}: expected PATTERN=TIER with TIER one of "
                                     f"{', '.join(TIERS)}, e.g. --offload 'layers.*=disk'")
        name, _, state = tier.partition(":")
        out.append((pattern, name, state or "optimizer"))
    return out


def check(cfg: JobConfig) -> None:
    """The launcher's one-line checks of these flags (``--memory-budget`` is parsed to bytes by
    ``JobConfig`` itself)."""
    parse(cfg.offload)
    folder = cfg.offload_dir
    if folder is not None:  # a typo must not become a new folder on another disk: refused, never created
        if not os.path.isdir(folder):
            what = "is not a folder" if os.path.exists(folder) else "does not exist"
            raise FinetuneInputError(f"--offload-dir {folder!r} {what}; create it first (mkdir -p {folder}) "
                                     "or drop the flag for the system's temporary folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise FinetuneInputError(f"--offload-dir {folder!r} is not writable by this user; pass a folder "
                                     "you can write to")
    if (cfg.offload or cfg.memory_budget is not None) and cfg.tp > 1:
        raise FinetuneInputError("--offload and --memory-budget plan per data-parallel shard and do not "
                                 "support --tp above 1 yet; drop one of them")
    if cfg.memory_budget is not None and cfg.offload:
        raise FinetuneInputError("--memory-budget plans every parameter's tier itself: drop --offload, or "
                                 "drop --memory-budget and place them by pattern")


def worker_argv(cfg: JobConfig) -> list[str]:
    argv = [f"--offload={spec}" for spec in cfg.offload or ()]
    if cfg.memory_budget is not None:
        argv += ["--memory-budget", str(cfg.memory_budget)]
    if cfg.offload_dir:
        argv += ["--offload-dir", cfg.offload_dir]
    return argv


class OffloadChoice:
    """What one worker offloads: ``policy(model)`` gives the ``param_policy`` wrapper for ``fully_shard``
    (called on the unsharded model, before sharding), ``planned`` the bytes per tier the choice should move
    off this rank's device memory (filled by ``policy``)."""

    def __init__(self, specs: list[str] | None, budget: int | None, folder: str | None, shards: int,
                 shard_rank: int) -> None:
        self.rules = parse(specs)
        self.budget = None if budget is None else int(budget)
        self.folder = folder or tempfile.gettempdir()
        self.shards, self.shard_rank = shards, shard_rank
        self.planned: dict[str, int] = {}
        self.plan_line = ""

    @property
    def active(self) -> bool:
        return bool(self.rules) or self.budget is not None

    def _places(self, model) -> dict[str, tuple[str, str]]:
        """Parameter name -> (tier, state), for the offloaded ones."""
        from perparam.memory.budget import plan_budget
        from perparam.memory.plan import plan_module

        if self.budget is None:
            places = {}
            for name, _ in model.named_parameters():
                hit = next(((tier, state)
                            for pattern, tier, state in self.rules if fnmatch.fnmatchcase(name, pattern)),
                           None)
                if hit is not None and hit[0] != "device":
                    places[name] = hit
            plan = plan_module(model, self.shards, dtype=None, optim_bytes=8)
            for pp in plan.params:
                if pp.name in places:
                    tier, state = places[pp.name]
                    numel = pp.layout.local_numel(self.shard_rank) if pp.requires_grad else 0
                    shard = pp.stored_bytes(self.shard_rank) if state == "all" else 0
                    grad = (shard
                            if tier == "disk" and pp.requires_grad and not pp.resolution.policy.whole_grad
                            else 0)
                    nbytes = numel * 8 + shard + grad  # AdamW state; "all": the shard and its gradient too
                    self.planned[tier] = self.planned.get(tier, 0) + nbytes
            return places
        plan = plan_module(model, self.shards, dtype=None, optim_bytes=8)
        result = plan_budget(plan, self.budget, stage2=False)  # the run's --zero-stage decides stages
        if not result.fits:
            raise FinetuneInputError(f"--memory-budget {self.budget}: {result.message}")
        self.planned = {"disk": result.offloaded[self.shard_rank]}
        self.plan_line = (f"--memory-budget {self.budget / 1e9:.4f} GB: model state per rank "
                          f"{plan.max_rank.total / 1e9:.4f} GB -> {result.max_kept / 1e9:.4f} GB kept; "
                          f"{result.by_place['optimizer']} parameters' AdamW state and "
                          f"{result.by_place['all']} whole parameters (shard, gradient, AdamW state) on "
                          f"disk, {result.max_moved / 1e9:.4f} GB moved per step")
        return {n: ("disk", place) for n, place in result.places.items() if place != "device"}

    def policy(self, model, base):
        """``fully_shard``'s ``param_policy`` for ``model``'s calls: ``base`` (a mapping of patterns
        relative to the call, or ``None``) plus the offload by parameter identity."""
        import dataclasses

        from perparam import OffloadPolicy, ParamPolicy

        if not self.active:
            return base
        if getattr(self, "_model_id", None) != id(model):  # planned once per model, shared by its calls
            params = dict(model.named_parameters())
            self._model_id = id(model)
            self._by_id = {id(params[n]): OffloadPolicy(tier, state,
                                                        path=self.folder if tier == "disk" else None)
                           for n, (tier, state) in self._places(model).items()}
        by_id = self._by_id

        def policy(name, param):
            own = None
            for pattern, pp in (base or {}).items():
                if fnmatch.fnmatchcase(name, pattern):
                    own = pp
                    break
            offload = by_id.get(id(param))
            return own if offload is None else dataclasses.replace(own or ParamPolicy(), offload=offload)

        return policy

    def summary(self) -> dict:
        """Planned and measured bytes per tier on this rank (``perparam.offload.offloaded_bytes``)."""
        import perparam.offload

        return {"planned_bytes": self.planned, "measured_bytes": perparam.offload.offloaded_bytes(),
                "budget_bytes": self.budget, "folder": self.folder}
