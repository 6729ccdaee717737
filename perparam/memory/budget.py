"""Offload under a byte budget: which parameters' state leaves device memory, with the least traffic.

Per parameter and rank r of a ``ModelPlan`` (``perparam.memory.plan``): S = its stored shard's bytes, G =
its gradient shard's, O = its optimizer state's (0 when frozen). Each parameter takes one of three
places (``OffloadPolicy.state``):

===============  ==============================  ==========================================================
place            bytes it keeps in device memory  bytes moved between tiers per step (read + written)
===============  ==============================  ==========================================================
``device``       S + G + O                        0
``optimizer``    S + G                            2 O (read before the step, written after it)
``all``          G                                2 O + 3 S trainable (read before the forward all-gather,
                                                  read before the backward one, written after the step);
                                                  2 S frozen (two reads, nothing written)
===============  ==============================  ==========================================================

The gradient shard stays in memory in every place (it lives from the reduce-scatter to the optimizer
step). The budget counts the bytes resident between optimizer steps, i.e. during forward and backward; a
stock optimizer's step needs its offloaded tensors resident while it runs (``docs/offload.md``).
Collective bytes per step do not depend on the place (the same all-gathers and reduce-scatters run).

``plan_budget`` picks the places: every byte moved off the device costs 2 bytes of traffic when it is
optimizer state or a frozen shard, 3 when it is a trainable shard, so it offloads in that order, within a
kind covering what does not fit with few large parameters and then the smallest one that covers the rest
(least overshoot). ``largest_first`` is the rule of PyTorch PR #188120 (``cpu_offload_by_budget``): whole
parameters (``all``), largest first, until it fits. Units: bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from perparam.memory.plan import ModelPlan
from perparam.sharding.policy import OffloadPolicy, ParamPolicy

PLACES = ("device", "optimizer", "all")
FORMAT = "perparam-offload-plan/1"


@dataclass(frozen=True)
class _Param:
    name: str
    trainable: bool
    s: tuple[int, ...]  # per rank
    g: tuple[int, ...]
    o: tuple[int, ...]

    def kept(self, place: str, r: int) -> int:
        if place == "device":
            return self.s[r] + self.g[r] + self.o[r]
        return self.s[r] + self.g[r] if place == "optimizer" else self.g[r]

    def moved(self, place: str, r: int) -> int:
        if place == "device":
            return 0
        if place == "optimizer":
            return 2 * self.o[r]
        return 2 * self.o[r] + (3 if self.trainable else 2) * self.s[r]


def _params(plan: ModelPlan) -> list[_Param]:
    k = plan.world_size
    out = []
    for pp in plan.params:
        numel = [pp.layout.local_numel(pp.shard_of(r)) for r in range(k)]
        g = plan.grad_bytes if plan.grad_bytes is not None else pp.layout.itemsize
        trainable = pp.requires_grad
        out.append(_Param(pp.name, trainable, tuple(pp.stored_bytes(r) for r in range(k)),
                          tuple(int(n * g) if trainable else 0 for n in numel),
                          tuple(int(n * plan.optim_bytes) if trainable else 0 for n in numel)))
    return out


@dataclass
class BudgetPlan:
    """Where each parameter's state lives, and what that costs (bytes; per rank of the shard axis).

    ``places``: name -> ``"device"``, ``"optimizer"`` or ``"all"``. ``kept[r]``: bytes rank r keeps in
    device memory; ``moved[r]``: bytes it moves between tiers per step; ``offloaded[r]``: bytes it keeps
    in the tier. ``fits``: every rank keeps at most ``budget``; ``message`` says why not.
    """

    rule: str
    budget: int
    world_size: int
    places: dict[str, str]
    kept: list[int]
    moved: list[int]
    offloaded: list[int]
    collective_bytes: int
    fits: bool
    message: str = ""
    by_place: dict[str, int] = field(default_factory=dict)

    @property
    def max_kept(self) -> int:
        return max(self.kept)

    @property
    def max_moved(self) -> int:
        return max(self.moved)

    def as_json(self, tier: str, offload_dir: str | None) -> dict:
        """The plan as ``perparam plan --write-policy`` writes it (``load_policy`` reads it back)."""
        return {"format": FORMAT, "rule": self.rule, "budget_bytes": self.budget, "world_size": self.world_size,
                "tier": tier, "offload_dir": offload_dir, "fits": self.fits,
                "kept_bytes_per_rank": self.kept, "moved_bytes_per_step_per_rank": self.moved,
                "places": {n: p for n, p in self.places.items() if p != "device"}}


def _finish(rule: str, plan: ModelPlan, params: list[_Param], places: dict[str, str], budget: int) -> BudgetPlan:
    k = plan.world_size
    kept = [sum(p.kept(places[p.name], r) for p in params) for r in range(k)]
    moved = [sum(p.moved(places[p.name], r) for p in params) for r in range(k)]
    total = [sum(p.kept("device", r) for p in params) for r in range(k)]
    fits = max(kept) <= budget
    floor = max(sum(p.kept("all", r) for p in params) for r in range(k))
    message = "" if fits else (
        f"nothing fits: with every parameter's shard and optimizer state offloaded a rank still keeps {floor} "
        f"bytes (its gradient shards, kept from the reduce-scatter to the step); raise the budget above that or "
        f"shard over more ranks")
    by_place = {place: sum(1 for v in places.values() if v == place) for place in PLACES}
    return BudgetPlan(rule, budget, k, places, kept, moved, [t - c for t, c in zip(total, kept)],
                      2 * plan.padded_param_bytes_per_rank, fits, message, by_place)


def _cover(items: list[tuple[str, tuple[int, ...], int]], need: list[int]) -> list[str]:
    """Names of ``items`` (name, bytes saved per rank, cost) covering ``need`` (bytes per rank) with little
    overshoot: the largest savings first while none covers the rest alone, then the cheapest one that does."""
    chosen, left = [], sorted(items, key=lambda it: -max(it[1]))
    need = list(need)
    def covers(it) -> bool:
        return all(s >= n for s, n in zip(it[1], need))

    while any(n > 0 for n in need) and left:
        # sorted by saving: when the largest left does not cover the rest alone, (nearly) none does
        pick = min((it for it in left if covers(it)), key=lambda it: it[2]) if covers(left[0]) else left[0]
        left.remove(pick)
        chosen.append(pick[0])
        need = [n - s for n, s in zip(need, pick[1])]
    return chosen


def plan_budget(plan: ModelPlan, budget: int) -> BudgetPlan:
    """The places that keep every rank's device bytes within ``budget`` with the least bytes moved per
    step (see the module docstring); ``fits`` is false, with a ``message``, when nothing does."""
    params = _params(plan)
    k = plan.world_size
    places = {p.name: "device" for p in params}
    need = [sum(p.kept("device", r) for p in params) - budget for r in range(k)]
    # kind 1 (2 bytes moved per byte freed): optimizer state, frozen shards; kind 2 (3 per byte): trainable shards
    kind1 = [(p.name, p.o, 2 * max(p.o)) for p in params if p.trainable and max(p.o) > 0]
    kind1 += [(p.name, p.s, 2 * max(p.s)) for p in params if not p.trainable and max(p.s) > 0]
    for name in _cover(kind1, need):
        places[name] = "optimizer" if next(p for p in params if p.name == name).trainable else "all"
    need = [sum(p.kept(places[p.name], r) for p in params) - budget for r in range(k)]
    if any(n > 0 for n in need):
        for p in params:  # every kind-1 byte is off the device before any kind-2 byte
            if p.trainable and max(p.o) > 0:
                places[p.name] = "optimizer"
            elif not p.trainable and max(p.s) > 0:
                places[p.name] = "all"
        need = [sum(p.kept(places[p.name], r) for p in params) - budget for r in range(k)]
        kind2 = [(p.name, p.s, 3 * max(p.s)) for p in params if p.trainable and max(p.s) > 0]
        for name in _cover(kind2, need):
            places[name] = "all"
    return _finish("least traffic", plan, params, places, budget)


def largest_first(plan: ModelPlan, budget: int) -> BudgetPlan:
    """PR #188120's rule: whole parameters (``all``), largest first, until every rank fits."""
    params = _params(plan)
    places = {p.name: "device" for p in params}
    kept = [sum(p.kept("device", r) for p in params) for r in range(plan.world_size)]
    for p in sorted(params, key=lambda p: -sum(p.s)):
        if max(kept) <= budget:
            break
        places[p.name] = "all"
        kept = [k - p.kept("device", r) + p.kept("all", r) for r, k in enumerate(kept)]
    return _finish("largest parameters first", plan, params, places, budget)


def parse_bytes(text: str) -> int:
    """``"20e9"``, ``"20GB"``, ``"1.5GiB"``, ``"512MiB"`` or a number, as bytes (GB = 10**9, GiB = 2**30).
    Raises ``ValueError``."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    t = str(text).strip().lower().replace("_", "")
    scale = next((v for u, v in units.items() if t.endswith(u)), 1)
    if scale != 1 or t.endswith("b"):
        t = t[: -len(next(u for u, v in units.items() if t.endswith(u)))]
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"not a byte count: {text!r} (e.g. 20e9, 20GB, 16GiB)") from None
    if value < 0:
        raise ValueError(f"a byte count must be >= 0, got {text!r}")
    return int(value)


def param_policy(model, places: dict[str, str], tier: str = "disk", offload_dir: str | None = None,
                 base=None):
    """``fully_shard``'s ``param_policy`` for ``places`` (names as ``model.named_parameters()`` gives them):
    a callable recognising each parameter by identity, so every ``fully_shard`` call on a submodule finds
    its own (a call's names are relative to its module). ``base``: a callable or ``ParamPolicy`` giving the
    rest of each parameter's policy. Raises ``ValueError`` for a name the model does not have or a disk
    tier without ``offload_dir``."""
    import dataclasses

    if tier == "disk" and not offload_dir:
        raise ValueError("the disk tier needs a folder: pass offload_dir (perparam plan --offload-dir)")
    by_name = dict(model.named_parameters())
    missing = sorted(set(places) - set(by_name))
    if missing:
        raise ValueError(f"the offload plan names parameters this model does not have: {missing[:3]}; plan it "
                         "for this model")
    by_id = {id(by_name[n]): OffloadPolicy(tier, place, path=offload_dir if tier == "disk" else None)
             for n, place in places.items() if place != "device"}

    def policy(name, param):
        own = base(name, param) if callable(base) else base
        offload = by_id.get(id(param))
        if offload is None:
            return own
        return dataclasses.replace(own or ParamPolicy(), offload=offload)

    return policy


def write_policy(path: str | Path, plan: BudgetPlan, tier: str, offload_dir: str | None) -> None:
    Path(path).write_text(json.dumps(plan.as_json(tier, offload_dir), indent=1) + "\n")


def load_policy(path: str | Path, model, offload_dir: str | None = None, base=None):
    """``param_policy`` (see there) from a file ``perparam plan --budget ... --write-policy FILE`` wrote.
    ``offload_dir`` overrides the file's. Raises ``ValueError`` for a file of another format."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an offload plan ({FORMAT}); write one with perparam plan --budget BYTES "
                         "--write-policy FILE")
    return param_policy(model, data["places"], data["tier"], offload_dir or data.get("offload_dir"), base)
