"""``perparam plan``: the per-parameter sharding layout of a model for K ranks, computed without processes.

The model is built on the meta device (no storage is allocated), each parameter gets the layout
``fully_shard`` gives it on a 1D mesh of K ranks (``ShardLayout(shape, dtype, K, Shard(0))``, placement
``(Shard(0),)``), and the per-rank bytes of parameters, gradients and optimizer state are summed from
``perparam.sharding.layout``, the same code the runtime uses. Units: bytes, GB = 10**9 bytes.

Byte counts default to the ZeRO tables' mixed-precision Adam (ZeRO paper, Section 3.1): parameters stored
in fp16 (2 bytes per element, through the layout's dtype), gradients 2 bytes and optimizer state 12 bytes
(fp32 master copy and two moments) per trainable element. The result is compared with the ZeRO-3 formula
``(P + G + O) / K`` of ``perparam.memory.formulas``.

Local bytes hold no padding: summed over all ranks they equal the unsharded bytes exactly. Because
parameters are split like ``torch.chunk`` (the first ranks hold ``ceil(S / K)`` rows, the last ones fewer
or none), rank 0 holds the most; the per-rank totals are computed for every rank anyway and the maximum is
reported with the rank that holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn
from torch.distributed.tensor import Placement

from perparam.memory import formulas
from perparam.memory.formulas import GB, BytesPerParam, Number, StageMemory, as_json_number, exact
from perparam.memory.presets import PRESETS
from perparam.memory.tp_plan import tp_local_shape, tp_placements
from perparam.sharding import resolution
from perparam.sharding.grad_quant import wire_bytes
from perparam.sharding.layout import ShardLayout
from perparam.sharding.owners import NS_STEPS, OwnerPlan, plan_shapes
from perparam.sharding.placement import placement_str as one_placement_str
from perparam.sharding.resolution import ParamResolution, aliases_of, buffer_dtypes, resolve_params

from .factory import build_on_meta, call_factory, import_object, resolve_factory  # noqa: F401 (re-exported)
from .formulas import kept_bytes

#: Dtype names accepted by ``--dtype`` ("model" keeps each parameter's own dtype).
DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
}


def _whole(x: Number) -> Number:
    x = Fraction(x)
    return int(x) if x.denominator == 1 else x


@dataclass(frozen=True)
class ParamPlan:
    """One parameter: its name (as ``named_parameters`` gives it), layout and placements on the mesh."""

    name: str
    resolution: ParamResolution  # what fully_shard resolves for it (perparam.sharding.resolution)
    split_by_tp: bool = False  # a tensor-parallel parameter (sharded over dp as its tp-local tensor)

    @property
    def layout(self) -> ShardLayout:
        return self.resolution.layout

    @property
    def requires_grad(self) -> bool:
        return self.resolution.requires_grad

    @property
    def placements(self) -> tuple[Placement, ...]:
        return (self.layout.placement,)

    def shard_of(self, rank: int) -> int:
        """The shard rank ``rank`` holds of this parameter: ``rank`` itself, or on a parameter's own mesh
        (``ParamPolicy.mesh``) of K' shards ``rank % K'`` (its shard axis is the mesh's innermost, as
        ``init_device_mesh(..., (ep, edp))['edp']`` lays it out over consecutive ranks)."""
        return rank % self.layout.num_shards

    def stored_bytes(self, rank: int) -> int:
        """Bytes rank ``rank`` stores for this parameter (quantized codes and scales included)."""
        return self.resolution.stored_bytes(self.shard_of(rank))

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends for it in its group's all-gather (0 for a replicated parameter)."""
        return sum(piece.nbytes for piece in self.resolution.pieces)

    def grad_wire_bytes(self, world_size: int, quantized: bool = True) -> int:
        """Bytes one rank sends for its gradient in its group's reduce-scatter per step: ``world_size`` pieces
        of its padded local gradient plus its used flag, in ``reduce_dtype`` or, with ``quantized`` and a
        ``ParamPolicy.grad_quant``, as that wire format's codes, scales and flag
        (``perparam.sharding.grad_quant.wire_bytes``; per parameter, so a group's row can differ by the
        alignment of its sections, under 4 bytes). 0 for a frozen parameter and for gradients that are
        all-reduced instead (replicated and stage-1 parameters)."""
        policy = self.resolution.policy
        if not self.requires_grad or not self.layout.gathered or policy.whole_grad:
            return 0
        gq = policy.grad_quant if quantized and world_size > 1 else None
        return world_size * wire_bytes([self.layout.padded_local_numel], gq, policy.reduce_dtype)


@dataclass(frozen=True)
class RankBytes:
    """Model-state bytes held by one rank (``rank``; -1 for the unsharded model): params, grads, optimizer."""

    rank: int
    params: Number
    grads: Number
    optimizer: Number

    @property
    def total(self) -> Number:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        out: dict = {"rank": self.rank}
        for name in ("params", "grads", "optimizer", "total"):
            out[f"{name}_bytes"] = as_json_number(getattr(self, name))
            out[f"{name}_gb"] = float(Fraction(getattr(self, name)) / GB)
        return out


@dataclass(frozen=True)
class ModelPlan:
    """The sharding plan of a model over ``world_size`` ranks and the model-state bytes of every rank.

    ``grad_bytes``/``optim_bytes``: bytes per trainable element of gradient and optimizer state
    (``grad_bytes=None``: the parameter's own itemsize). ``per_rank[r]``: bytes held by rank ``r``.
    """

    model_name: str
    world_size: int
    params: tuple[ParamPlan, ...]
    grad_bytes: Number | None
    optim_bytes: Number
    per_rank: tuple[RankBytes, ...]
    unsharded: RankBytes
    nominal_params: int | None = None
    #: ranks of the tensor-parallel axis; ``per_rank[r]`` is what tp rank ``tp_rank`` of dp shard rank ``r``
    #: holds (a split dim that does not divide by T is split as ``torch.chunk`` does: tp rank 0 holds the
    #: most)
    tp: int = 1
    tp_rank: int = 0

    # -- owners ----------------------------------------------------------------------------------------
    @property
    def owner_params(self) -> tuple[ParamPlan, ...]:
        """The parameters under ``ParamPolicy(update="owner")`` (one rank steps each whole)."""
        return tuple(p for p in self.params if p.resolution.policy.update == "owner")

    def owners(self, ns_steps: int = NS_STEPS) -> OwnerPlan:
        """Their owner ranks and per-rank Newton-Schulz cost: ``perparam.sharding.owners.plan_shapes`` in
        ``named_parameters`` order, the plan the runtime computes for an optimizer holding them in that
        order on a 1D mesh of ``world_size`` ranks."""
        return plan_shapes([p.layout.global_shape for p in self.owner_params], self.world_size, ns_steps)

    # -- counts ----------------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(p.layout.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(p.layout.numel for p in self.params if p.requires_grad)

    @property
    def padded_param_bytes_per_rank(self) -> int:
        """Bytes each rank sends in the all-gathers of every parameter, padding included (equal on all ranks;
        the wire pieces of ``perparam.sharding.layout.wire_pieces``: ``param_dtype``, or quantized codes and
        scales; replicated parameters send nothing)."""
        return sum(p.wire_bytes for p in self.params)

    @property
    def reduce_scatter_bytes_per_rank(self) -> int:
        """Bytes each rank sends in the gradient reduce-scatters of one step (``ParamPlan.grad_wire_bytes``:
        the ``grad_quant`` wire formats where the policy sets one)."""
        return sum(p.grad_wire_bytes(self.world_size) for p in self.params)

    @property
    def reduce_scatter_bytes_unquantized(self) -> int:
        """``reduce_scatter_bytes_per_rank`` with every gradient sent in its ``reduce_dtype``."""
        return sum(p.grad_wire_bytes(self.world_size, quantized=False) for p in self.params)

    def rank(self, r: int) -> RankBytes:
        return self.per_rank[r]

    @property
    def max_rank(self) -> RankBytes:
        """The rank holding the most bytes (the lowest such rank; rank 0 for chunk layouts)."""
        return max(self.per_rank, key=lambda b: (b.total, -b.rank))

    @property
    def min_rank(self) -> RankBytes:
        return min(self.per_rank, key=lambda b: (b.total, b.rank))

    def sum_over_ranks(self) -> RankBytes:
        return RankBytes(
            -1, *(_whole(sum(getattr(b, f) for b in self.per_rank)) for f in ("params", "grads", "optimizer"))
        )

    # -- formulas --------------------------------------------------------------------------------------
    @property
    def bytes_per_param(self) -> BytesPerParam:
        """Mean bytes per parameter of this model (exact; the dtype's itemsize when all dtypes agree)."""
        n, t = self.num_params, self.trainable_params
        u = self.unsharded
        return BytesPerParam(
            params=Fraction(u.params, n) if n else 0,
            grads=Fraction(u.grads) / t if t else 0,
            optimizer=Fraction(u.optimizer) / t if t else 0,
        )

    def formula(self, stage: str = "ZeRO-3") -> StageMemory:
        """``formulas.stage_memory`` for this model's real parameter count and bytes per parameter."""
        return formulas.stage_memory(
            stage, self.num_params, self.world_size, self.bytes_per_param, self.trainable_params
        )

    def nominal_formula(self, stage: str = "ZeRO-3") -> StageMemory | None:
        """The formula for ``nominal_params`` (e.g. the tables' 1.5e9 for GPT-2 XL) at the same
        bytes/param."""
        if self.nominal_params is None:
            return None
        bpp = self.bytes_per_param
        return formulas.stage_memory(stage, self.nominal_params, self.world_size, bpp)


def plan_module(
    module: nn.Module, world_size: int, *, dtype: torch.dtype | None = torch.float16,
    grad_bytes: Number | None = None, optim_bytes: Number = 12, model_name: str = "model",
    nominal_params: int | None = None, param_policy=None, mp_policy=None, tp: int = 1,
    tp_plan: Mapping[str, object] | None = None, tp_rank: int = 0,
) -> ModelPlan:
    """The sharding plan of ``module`` (any device, meta included) over ``world_size`` ranks.

    ``dtype``: dtype the parameters are stored in (``None``: each parameter's own). ``grad_bytes``: bytes
    per gradient element (``None``: the stored itemsize). ``optim_bytes``: optimizer-state bytes per trainable
    element. Tied parameters are counted once (``named_parameters``); a ``param_policy`` pattern may name
    any of their names. ``param_policy``, ``mp_policy``: as ``fully_shard``'s. Every parameter goes
    through ``perparam.sharding.resolution.resolve_params``, the path ``fully_shard`` takes (placements,
    ``placement="auto"``, stored dtypes, quantization), so whatever ``fully_shard`` refuses raises the same
    ``ValueError`` here (e.g. a 0-dim parameter without ``ParamPolicy(placement=Replicate())``).
    ``tp``, ``tp_plan``: a tensor-parallel axis of ``tp`` ranks and ``parallelize_module``'s plan for it
    (``perparam.memory.tp_plan``); ``world_size`` stays the dp shard axis's K, and a parameter the plan
    splits is sharded over dp as its tp-local tensor, as ``fully_shard`` does. ``tp_rank``: the tp coordinate
    whose ranks are planned; a split dim that does not divide by ``tp`` leaves the tp ranks different shapes
    (``torch.chunk``'s: tp rank 0, the default, holds the most).

    Per-rank sums run over the distinct ``(shape, dtype, dim, trainable)`` groups, not over every parameter,
    so K = 1024 on GPT-2 XL takes milliseconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    optim_bytes = _whole(exact(optim_bytes))
    grad_bytes = None if grad_bytes is None else _whole(exact(grad_bytes))
    if optim_bytes < 0 or (grad_bytes is not None and grad_bytes < 0):
        raise ValueError("bytes per element must be >= 0")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if tp > 1 and tp_plan is None:
        raise ValueError("--tp needs a tensor-parallel plan: the presets carry one; for --model pass "
                         "--tp-plan PKG.MODULE:FACTORY (a factory returning parallelize_module's plan)")
    aliases = aliases_of(module)
    on_tp = tp_placements(module, tp_plan) if tp > 1 else {}
    on_tp = {n: on_tp[a] for n, names in aliases.items() for a in names if a in on_tp}  # by first name
    named = [(n, nn.Parameter(torch.empty(tp_local_shape(tuple(p.shape), on_tp[n], tp, tp_rank)
                                          if n in on_tp else p.shape, dtype=dtype or p.dtype, device="meta"),
                              requires_grad=p.requires_grad))
             for n, p in module.named_parameters()]
    # norms compute in their statistics' dtype
    compute_dtypes = buffer_dtypes([("", module)], lambda m: False)
    resolved = resolve_params(named, mp_policy, param_policy, world_size, model_name, aliases=aliases,
                              tensor_parallel=set(on_tp), compute_dtypes=compute_dtypes)
    plans = [ParamPlan(r.name, r, r.name in on_tp) for r in resolved]

    groups = Counter((pp.layout, pp.requires_grad, pp.resolution.policy, pp.split_by_tp) for pp in plans)
    sample = {(pp.layout, pp.requires_grad, pp.resolution.policy, pp.split_by_tp): pp for pp in plans}
    params = [0] * world_size
    states = [0] * world_size  # gradient bytes: elements with a gradient, weighted by grad bytes
    train_numel = [0] * world_size  # elements with optimizer state
    for key, count in groups.items():
        layout, trainable, policy, split_by_tp = key
        g = layout.itemsize if grad_bytes is None else grad_bytes
        kept = count * kept_bytes(layout, policy)  # stage 1/2: the unsharded copy every rank keeps
        in_kept = resolution.shard_in_kept(policy, split_by_tp)  # ... and the shard is a view of its own rows
        for r in range(world_size):
            numel = count * layout.local_numel(sample[key].shard_of(r))
            params[r] += (0 if in_kept else count * sample[key].stored_bytes(r)) + kept
            if trainable:
                states[r] += (count * layout.numel if policy.whole_grad else numel) * g  # stage 1: whole
                train_numel[r] += numel
    per_rank = tuple(
        RankBytes(r, params[r], _whole(states[r]), _whole(train_numel[r] * optim_bytes))
        for r in range(world_size)
    )
    unsharded_grads = sum(
        p.layout.numel * (p.layout.itemsize if grad_bytes is None else grad_bytes)
        for p in plans if p.requires_grad
    )
    trainable = sum(p.layout.numel for p in plans if p.requires_grad)
    unsharded = RankBytes(
        -1, sum(sum(p.stored_bytes(r) for r in range(p.layout.num_shards)) if p.layout.gathered
                else p.stored_bytes(0) for p in plans), _whole(unsharded_grads),
        _whole(trainable * optim_bytes),
    )
    return ModelPlan(model_name, world_size, tuple(plans), grad_bytes, optim_bytes, per_rank, unsharded,
                     nominal_params, tp, tp_rank)


def plan_model(
    spec: str, world_size: int, *, dtype: torch.dtype | None = torch.float16,
    grad_bytes: Number | None = None, optim_bytes: Number = 12, nominal_params: int | None = None,
    param_policy=None, tp: int = 1, tp_plan: Mapping[str, object] | str | None = None, tp_rank: int = 0,
) -> ModelPlan:
    """``plan_module`` of a preset (``"gpt2-xl"``) or ``package.module:factory`` built on the meta device.

    ``tp_plan``: ``parallelize_module``'s plan, or a ``package.module:factory`` returning it (``--tp-plan``);
    ``None``: the preset's (``perparam.memory.tp_plan.gpt2_tp_plan`` for the GPT-2 presets)."""
    factory, _, preset_nominal = resolve_factory(spec)
    module = build_on_meta(factory)
    if isinstance(tp_plan, str):
        tp_plan = call_factory(tp_plan, "--tp-plan", Mapping,
                               "a dict of module patterns to ColwiseParallel() "
                               "or RowwiseParallel()")
    if tp_plan is None and spec in PRESETS and PRESETS[spec].tp_plan is not None:
        tp_plan = PRESETS[spec].tp_plan()
    return plan_module(
        module, world_size, dtype=dtype, grad_bytes=grad_bytes, optim_bytes=optim_bytes, model_name=spec,
        nominal_params=preset_nominal if nominal_params is None else nominal_params,
        param_policy=param_policy, tp=tp, tp_plan=tp_plan, tp_rank=tp_rank,
    )


# -- CLI -------------------------------------------------------------------------------------------------

def placement_str(placements: tuple[Placement, ...]) -> str:
    """``"(Shard(0),)"``: a placements tuple as DTensor prints it."""
    return "(" + ", ".join(map(one_placement_str, placements)) + ("," if len(placements) == 1 else "") + ")"


def plan_to_json(plan: ModelPlan, rank: int = 0, params_table: bool = False) -> dict:
    """The plan as JSON-ready data (bytes as ints where whole, GB as floats)."""
    formula = plan.formula("ZeRO-3")
    nominal = plan.nominal_formula("ZeRO-3")
    max_rank = plan.max_rank
    out: dict = {
        "model": plan.model_name,
        "world_size": plan.world_size,
        "tp": plan.tp,
        "tp_rank": plan.tp_rank,
        "num_params": plan.num_params,
        "trainable_params": plan.trainable_params,
        "num_tensors": len(plan.params),
        "bytes_per_element": {
            "params": sorted({str(p.layout.dtype).removeprefix("torch.") for p in plan.params}),
            "grads": "param itemsize" if plan.grad_bytes is None else as_json_number(plan.grad_bytes),
            "optimizer": as_json_number(plan.optim_bytes),
        },
        "rank": plan.rank(rank).as_dict(),
        "max_over_ranks": max_rank.as_dict(),
        "min_over_ranks": plan.min_rank.as_dict(),
        "sum_over_ranks": plan.sum_over_ranks().as_dict(),
        "unsharded": plan.unsharded.as_dict(),
        "padded_param_bytes_per_rank": plan.padded_param_bytes_per_rank,
        "reduce_scatter_bytes_per_rank": plan.reduce_scatter_bytes_per_rank,
        "reduce_scatter_bytes_unquantized": plan.reduce_scatter_bytes_unquantized,
        "zero3_formula": formula.as_dict(),
        "max_rank_vs_formula": float(Fraction(max_rank.total) / formula.total - 1) if formula.total else 0.0,
    }
    stages = sorted({p.resolution.policy.zero_stage for p in plan.params if p.layout.gathered})
    out["zero_stages"] = stages  # of the sharded parameters (ParamPolicy.zero_stage)
    # Table 7-2's row of that stage; stages 1/2 also hold the shard the optimizer updates
    if len(stages) == 1:
        out["zero_stage_formula"] = plan.formula(f"ZeRO-{stages[0]}").as_dict()
    if nominal is not None:
        out["nominal_params"] = plan.nominal_params
        out["zero3_formula_nominal"] = nominal.as_dict()
        out["max_rank_vs_nominal"] = float(Fraction(max_rank.total) / nominal.total
                                           - 1) if nominal.total else 0.0
    mean = Fraction(plan.sum_over_ranks().total) / plan.world_size
    out["imbalance"] = {"max_rank": plan.max_rank.rank, "max_rank_bytes": as_json_number(plan.max_rank.total),
                        "mean_bytes": as_json_number(_whole(mean)),
                        "max_over_mean": float(plan.max_rank.total / mean - 1) if mean else 0.0}
    owned = plan.owner_params
    if owned:
        owners = plan.owners()
        out["owners"] = {"params": {p.name: r for p, r in zip(owned, owners.owners)},
                         "ns_cost_per_rank": list(owners.loads), "max_over_mean": owners.balance}
    if params_table:
        out["params"] = [
            {
                "name": p.name,
                "global_shape": list(p.layout.global_shape),
                "placements": placement_str(p.placements),
                "local_shape": list(p.layout.local_shape(rank)),
                "dtype": str(p.layout.dtype).removeprefix("torch."),
                "local_bytes": p.stored_bytes(rank),
                "requires_grad": p.requires_grad,
                "zero_stage": p.resolution.policy.zero_stage,
                "kept_bytes": kept_bytes(p.layout, p.resolution.policy),
                "shard_in_kept": resolution.shard_in_kept(p.resolution.policy, p.split_by_tp),
            }
            for p in plan.params
        ]
    return out
