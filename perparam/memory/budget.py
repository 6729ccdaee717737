"""Offload and ZeRO stage under a byte budget: where each parameter's state lives, with the least traffic.

Per parameter and rank r of a ``ModelPlan`` (``perparam.memory.plan``): S = its stored shard's bytes, G =
its gradient shard's, O = its optimizer state's (0 when frozen), U = the unsharded copy stage 2 keeps
(``plan.kept_bytes``: padded, ``param_dtype``), W = the bytes it sends in one all-gather (its padded wire
piece). Each parameter takes one of three places (``OffloadPolicy.state``) at ZeRO stage 3 or 2:

===============  ==============================  ==========================================================
place            bytes it keeps in device memory  bytes moved between tiers per step (read + written)
===============  ==============================  ==========================================================
``device``       S + G + O                        0
``optimizer``    S + G                            2 O (read before the step, written after it)
``all``          0                                2 O + 3 S + 2 G trainable (the shard read before the
                                                  forward all-gather and before the backward one, written
                                                  after the step; the gradient written after the
                                                  reduction, read before the step); 2 S frozen
===============  ==============================  ==========================================================

Stage 2 (``ParamPolicy(zero_stage=2)``) adds U to what a parameter keeps (U - S in place ``device`` where
the shard is a view of the copy, ``sharding.resolution.shard_in_kept``) and saves one all-gather per step
(stage 3 sends r(G + 2P), stage 2 r(G + P), ``perparam.memory.stage_budget``): W bytes fewer per rank. The
planner gives it only to trainable stage-3 parameters in place ``device`` or ``optimizer``. With several
backwards per step (gradient accumulation), ``all`` moves 2 G more per extra backward (the gradient is
read back before each reduction adds to it); the table counts one. The budget counts the bytes resident
between optimizer steps, i.e. during forward and backward; a stock optimizer's step needs its offloaded
tensors resident while it runs (``docs/offload.md``). Offload changes no collective.

``plan_budget`` minimises, in this order, (1) the bytes moved between tiers per step and (2) the collective
bytes sent per step. (1): every byte moved off the device costs 2 bytes of traffic when it is optimizer
state or a frozen shard, 2.5 (3 S + 2 G per S + G) when it is a trainable shard with its gradient, so it
offloads in that order, within a kind covering what does not fit with few large parameters and then the
smallest one that covers the rest (least overshoot). (2): with those places fixed, the headroom left under
the budget goes to stage 2, parameters saving the most all-gather bytes per kept byte first, then the
largest. ``largest_first`` is the rule of PyTorch PR #188120 (``cpu_offload_by_budget``): whole
parameters (``all``), largest first, until it fits, at stage 3. Units: bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
    u: int = 0  # the unsharded copy stage 2 would keep (0: stage 2 not offered to it)
    w: int = 0  # bytes one all-gather sends for it
    base: int = 0  # bytes of a copy its own policy keeps already (stage 1/2 given by the user)
    #: on the device at stage 1/2 its shard is a view of that copy (``sharding.resolution.shard_in_kept``)
    in_kept: bool = False

    def kept(self, place: str, r: int, stage: int = 3) -> int:
        extra = self.base + (self.u if stage == 2 else 0)
        if place == "device":
            inside = self.s[r] if self.in_kept and (self.base or stage == 2) else 0
            return self.s[r] + self.g[r] + self.o[r] + extra - inside
        return (self.s[r] + self.g[r] + extra if place == "optimizer"
                else (0 if self.trainable else self.g[r]) + extra)

    def moved(self, place: str, r: int) -> int:
        if place == "device":
            return 0
        if place == "optimizer":
            return 2 * self.o[r]
        return 2 * self.o[r] + (3 * self.s[r] + 2 * self.g[r] if self.trainable else 2 * self.s[r])


def _params(plan: ModelPlan) -> list[_Param]:
    from perparam.memory.plan import kept_bytes
    from perparam.sharding.resolution import shard_in_kept

    k = plan.world_size
    out = []
    for pp in plan.params:
        numel = [pp.layout.local_numel(pp.shard_of(r)) for r in range(k)]
        g = plan.grad_bytes if plan.grad_bytes is not None else pp.layout.itemsize
        trainable = pp.requires_grad
        policy = pp.resolution.policy
        stage2 = trainable and pp.layout.gathered and policy.zero_stage == 3 and pp.wire_bytes > 0
        u = math.prod(pp.layout.buffer_shape) * policy.param_dtype.itemsize if stage2 else 0
        staged = dataclasses.replace(policy, zero_stage=2) if stage2 else policy  # (its own stage 1/2 else)
        out.append(_Param(pp.name, trainable, tuple(pp.stored_bytes(r) for r in range(k)),
                          tuple(int(n * g) if trainable else 0 for n in numel),
                          tuple(int(n * plan.optim_bytes) if trainable else 0 for n in numel),
                          u, pp.wire_bytes, kept_bytes(pp.layout, policy),
                          shard_in_kept(staged, pp.split_by_tp)))
    return out


@dataclass
class BudgetPlan:
    """Where each parameter's state lives, and what that costs (bytes; per rank of the shard axis).

    ``places``: name -> ``"device"``, ``"optimizer"`` or ``"all"``; ``stages``: name -> ZeRO stage
    (3, or 2 where the plan keeps the unsharded copy). ``kept[r]``: bytes rank r keeps in device memory;
    ``moved[r]``: bytes it moves between tiers per step; ``offloaded[r]``: bytes it keeps in the tier;
    ``collective_bytes``: bytes each rank sends in all-gathers per step. ``fits``: every rank keeps at most
    ``budget``; ``message`` says why not.
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
    stages: dict[str, int] = field(default_factory=dict)

    @property
    def stage2(self) -> int:
        """How many parameters the plan runs at stage 2."""
        return sum(1 for v in self.stages.values() if v == 2)

    @property
    def max_kept(self) -> int:
        return max(self.kept)

    @property
    def max_moved(self) -> int:
        return max(self.moved)

    def as_json(self, tier: str, offload_dir: str | None) -> dict:
        """The plan as ``perparam plan --write-policy`` writes it (``load_policy`` reads it back)."""
        return {"format": FORMAT, "rule": self.rule, "budget_bytes": self.budget,
                "world_size": self.world_size, "tier": tier, "offload_dir": offload_dir, "fits": self.fits,
                "kept_bytes_per_rank": self.kept, "moved_bytes_per_step_per_rank": self.moved,
                "collective_bytes_per_step_per_rank": self.collective_bytes,
                "places": {n: p for n, p in self.places.items() if p != "device"},
                "zero_stages": {n: v for n, v in self.stages.items() if v != 3}}


def _finish(rule: str, plan: ModelPlan, params: list[_Param], places: dict[str, str], budget: int,
            stages: dict[str, int] | None = None) -> BudgetPlan:
    k = plan.world_size
    stages = stages or {p.name: 3 for p in params}
    kept = [sum(p.kept(places[p.name], r, stages[p.name]) for p in params) for r in range(k)]
    moved = [sum(p.moved(places[p.name], r) for p in params) for r in range(k)]
    total = [sum(p.kept("device", r, stages[p.name]) for p in params) for r in range(k)]
    fits = max(kept) <= budget
    floor = max(sum(p.kept("all", r) for p in params) for r in range(k))
    message = "" if fits else (
        "nothing fits: with every parameter's shard, gradient and optimizer state offloaded a rank still "
        f"keeps {floor} bytes (frozen parameters' gradients and the unsharded copies of stage-1/2 policies); "
        f"raise the budget above that or shard over more ranks")
    by_place = {place: sum(1 for v in places.values() if v == place) for place in PLACES}
    collective = 2 * plan.padded_param_bytes_per_rank - sum(p.w for p in params if stages[p.name] == 2)
    return BudgetPlan(rule, budget, k, places, kept, moved, [t - c for t, c in zip(total, kept)],
                      collective, fits, message, by_place, dict(stages))


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


def plan_budget(plan: ModelPlan, budget: int, stage2: bool = True) -> BudgetPlan:
    """The places and stages that keep every rank's device bytes within ``budget`` with the least bytes
    moved between tiers per step, then the fewest collective bytes (see the module docstring; ``stage2``:
    offer stage 2, else every parameter stays at its policy's stage); ``fits`` is false, with a
    ``message``, when nothing does."""
    params = _params(plan)
    k = plan.world_size
    places = {p.name: "device" for p in params}
    need = [sum(p.kept("device", r) for p in params) - budget for r in range(k)]
    # kind 1 (2 bytes moved per byte freed): optimizer state, frozen shards; kind 2 (3 per byte): trainable
    # shards
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
        kind2 = [(p.name, tuple(s + g for s, g in zip(p.s, p.g)), 3 * max(p.s) + 2 * max(p.g))
                 for p in params if p.trainable and max(p.s) > 0]
        for name in _cover(kind2, need):
            places[name] = "all"
    stages = {p.name: 3 for p in params}
    if stage2:
        room = [budget - sum(p.kept(places[p.name], r) for p in params) for r in range(k)]
        offered = [p for p in params if p.u > 0 and places[p.name] != "all"]
        for p in sorted(offered, key=lambda p: (-p.w / p.u, -p.u, p.name)):
            if all(p.u <= left for left in room):
                stages[p.name] = 2
                room = [left - p.u for left in room]
    return _finish("least traffic", plan, params, places, budget, stages)


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
                 base=None, stages: dict[str, int] | None = None):
    """``fully_shard``'s ``param_policy`` for ``places`` (names as ``model.named_parameters()`` gives them)
    and ``stages`` (name -> ZeRO stage, e.g. ``BudgetPlan.stages``; ``None``: the policies' own): a
    callable recognising each parameter by identity, so every ``fully_shard`` call on a submodule finds
    its own (a call's names are relative to its module). ``base``: a callable or ``ParamPolicy`` giving the
    rest of each parameter's policy. Raises ``ValueError`` for a name the model does not have or a disk
    tier without ``offload_dir``."""
    import dataclasses

    if tier == "disk" and not offload_dir:
        raise ValueError("the disk tier needs a folder: pass offload_dir (perparam plan --offload-dir)")
    by_name = dict(model.named_parameters())
    stages = {n: v for n, v in (stages or {}).items() if v != 3}
    missing = sorted((set(places) | set(stages)) - set(by_name))
    if missing:
        raise ValueError(f"the offload plan names parameters this model does not have: {missing[:3]}; plan "
                         "it for this model")
    by_id = {id(by_name[n]): {"offload": OffloadPolicy(tier, place,
                                                       path=offload_dir if tier == "disk" else None)}
             for n, place in places.items() if place != "device"}
    for n, stage in stages.items():
        by_id.setdefault(id(by_name[n]), {})["zero_stage"] = stage

    def policy(name, param):
        own = base(name, param) if callable(base) else base
        fields = by_id.get(id(param))
        if fields is None:
            return own
        return dataclasses.replace(own or ParamPolicy(), **fields)

    return policy


def write_policy(path: str | Path, plan: BudgetPlan, tier: str, offload_dir: str | None) -> None:
    Path(path).write_text(json.dumps(plan.as_json(tier, offload_dir), indent=1) + "\n")


def load_policy(path: str | Path, model, offload_dir: str | None = None, base=None):
    """``param_policy`` (see there) from a file ``perparam plan --budget ... --write-policy FILE`` wrote.
    ``offload_dir`` overrides the file's. Raises ``ValueError`` for a file of another format."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an offload plan ({FORMAT}); write one with perparam plan --budget "
                         "BYTES --write-policy FILE")
    return param_policy(model, data["places"], data["tier"], offload_dir or data.get("offload_dir"), base,
                        data.get("zero_stages"))
