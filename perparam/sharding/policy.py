"""Policies: the call's mixed-precision defaults and per-parameter overrides.

``MixedPrecisionPolicy`` has FSDP2's fields and meaning, so an FSDP2 user can switch. ``ParamPolicy``
overrides them for single parameters; ``None`` in any field inherits the call's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.tensor import DeviceMesh, Placement, Shard  # (DeviceMesh: the type only)

from . import quant as registry
from .grad_quant import BF16, GradQuant
from .offload_policy import STATES, TIERS, OffloadPolicy, PolicyError, as_offload  # noqa: F401 (re-exported)
from .placement import normalize, placement_str, rule
from .quant import BlockQuantizer


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a ``fully_shard`` call.

    ``param_dtype``: dtype of the all-gathered parameters used in forward and backward (``None``: keep the
    stored dtype). ``reduce_dtype``: dtype in which gradients are reduce-scattered (``None``: the
    ``param_dtype``, else the stored dtype). ``output_dtype``: forward outputs are cast to it (``None``: no
    cast). ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    #: perparam's addition (FSDP2 has none): the dtype the sharded parameters are stored in, i.e. the
    #: optimizer's master weights (``None``: each parameter's own dtype). A model loaded in bf16 with
    #: ``master_dtype=torch.float32`` keeps fp32 shards, gradients and AdamW state while all-gather and
    #: compute stay in ``param_dtype`` (default: the loaded dtype), as in mixed-precision training
    #: (Micikevicius et al., 2018). The upcast happens once, at ``fully_shard``.
    master_dtype: torch.dtype | None = None


def as_mp_policy(value, what: str) -> MixedPrecisionPolicy:
    """``value`` as perparam's ``MixedPrecisionPolicy``: one itself, ``None`` (the default policy), or torch's
    FSDP2 ``torch.distributed.fsdp.MixedPrecisionPolicy`` (the same four fields and meaning; accelerate's
    FSDP2 plugin always passes one), recognised without importing FSDP. Raises ``PolicyError`` naming
    ``what`` otherwise."""
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return check_mp_policy(value)
    cls = type(value)
    if cls.__name__ == "MixedPrecisionPolicy" and cls.__module__.startswith("torch."):
        return check_mp_policy(MixedPrecisionPolicy(value.param_dtype, value.reduce_dtype, value.output_dtype,
                                                    value.cast_forward_inputs))
    raise PolicyError(f"{what} must be a perparam.MixedPrecisionPolicy or torch's "
                      f"torch.distributed.fsdp.MixedPrecisionPolicy, got {cls.__name__}")


@dataclass(frozen=True)
class QuantPolicy:
    """Block-wise quantization of a parameter's all-gather, and optionally of its stored shard.

    ``quantizer``: a name registered in ``perparam.quant`` (``"int8"``: absmax, 127 levels; ``"fp8"``:
    float8_e4m3fn; ``"nf4"``: 4-bit NormalFloat, two codes per byte), a quantizer object, or (as before)
    ``torch.int8`` / ``torch.float8_e4m3fn``; ``None``: ``"int8"``. ``block_size``: elements per scale
    (``None``: the quantizer's default, 256 for int8/fp8, 64 for nf4). ``store_quantized``: keep a frozen
    parameter's shard quantized (codes plus one fp32 scale per block of each row: about 1 byte per element
    for int8/fp8, 0.5625 for nf4) instead of communicating only. ``dtype``: the codes' dtype; given alone
    (``QuantPolicy(dtype=torch.int8)``, earlier versions' spelling) it names the quantizer. The policy
    ``resolve`` returns has all fields filled in.
    """

    quantizer: str | torch.dtype | BlockQuantizer | None = None
    block_size: int | None = None
    store_quantized: bool = False
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ParamPolicy:
    """Per-parameter overrides; ``None`` inherits from the call's ``MixedPrecisionPolicy`` and state.

    ``placement``: ``Shard(d)``, ``Replicate()``, or ``"auto"``
    (``perparam.sharding.placement.auto_placement``: the dim with the least padding for the shard axis's K,
    ``Replicate()`` for tiny parameters).

    ``zero_stage``: what a sharded parameter keeps whole on every rank (Rajbhandari et al., 2020; the
    per-rank bytes are the P, G and O rows of Table 7-2, ``perparam.memory.formulas``); ``None`` means 3:

    * ``3``: parameter, gradient and optimizer state sharded: all-gathered at each unshard, freed after.
    * ``2``: the unsharded parameter (``param_dtype``, padded) is kept on every rank across steps and never
      all-gathered in forward or backward; the gradient is reduce-scattered into the sharded ``.grad``
      and the optimizer updates the shard; the updated shards are all-gathered into the kept copy once
      per optimizer step, lazily, in the group's next all-gather (its next pre-forward or prefetch).
    * ``1``: as 2, and the gradient is all-reduced and kept whole on every rank (in the stored dtype); the
      sharded ``.grad`` is a view of this rank's rows of it.

    A parameter whose placement resolves to ``Replicate()`` is whole everywhere whatever its stage; an
    explicit ``Replicate()`` with stage 1 or 2 is refused, and so is stage 1 or 2 with
    ``QuantPolicy(store_quantized=True)`` (the kept copy would hold what the stored codes save).

    ``mesh``: the parameter's own data-parallel ``DeviceMesh`` (1D shard, or 2D (replicate, shard) HSDP),
    e.g. experts on an expert-data-parallel mesh while the rest of the call's module is on the call's mesh
    (FSDP2's per-parameter meshes); ``None``: the call's mesh. One ``fully_shard`` call then issues one
    all-gather per mesh per unshard and one reduce-scatter per (mesh, reduce dtype) per reduction. Its
    reduced gradient (summed over its own mesh's ranks) is divided by the call's divisor: by default the
    call's mesh size, the number of ranks whose losses are averaged, not its own mesh's size
    (``docs/mixture-of-experts.md``). ``fully_shard`` refuses (naming the parameter) a mesh of another
    device type than the call's, of more than 2 dims, without this rank, on a tensor-parallel parameter,
    or with ``reshard_after_forward=int`` (hpZ).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    requires_grad: bool | None = None
    quant: QuantPolicy | None = None
    placement: Placement | str | None = None
    master_dtype: torch.dtype | None = None
    zero_stage: int | None = None
    #: where its persistent state lives: an ``OffloadPolicy`` or a tier name (``None``: the call's, else
    #: ``"device"``)
    offload: OffloadPolicy | str | None = None
    mesh: DeviceMesh | None = None
    #: ZeRO++'s qgZ (DeepSpeed's ``zero_quantized_gradients``) for this parameter: its gradient's
    #: reduce-scatter pieces go on the wire as ``"int8"`` blocks (256 elements per fp32 scale; another
    #: registered quantizer name, or ``QuantPolicy(name, block_size=...)``) or as ``"bf16"``, and are summed
    #: in ``reduce_dtype`` on the receiving rank (``runtime/paths/reduce_qgz.py``; ``docs/grad-quant.md``).
    #: ``None``: the reduce dtype on the wire. Refused for frozen, replicated and stage-1 parameters.
    grad_quant: str | torch.dtype | QuantPolicy | BlockQuantizer | None = None
    #: who steps the parameter: ``"shard"`` (``None``, the default: every rank's optimizer steps its own
    #: shard, right for elementwise optimizers: SGD, Adam, AdamW, ...) or ``"owner"`` (one rank of its shard
    #: axis, planned by ``perparam.sharding.owners``, steps the whole tensor with the stock optimizer and
    #: sends the updated rows back: what whole-matrix optimizers need, ``torch.optim.Muon``,
    #: ``torch.optim.Adafactor``; ``docs/whole-matrix-optimizers.md``). ``"owner"`` is refused for a frozen,
    #: 0-dim, explicitly replicated or offloaded parameter.
    update: str | None = None


#: the values a ``ParamPolicy.update`` may name
UPDATES = ("shard", "owner")

#: the ZeRO stages a ``ParamPolicy.zero_stage`` may name
ZERO_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class ResolvedPolicy:
    """One parameter's effective policy after inheritance (what the runtime uses).

    ``param_dtype``: compute dtype of the unsharded parameter. ``reduce_dtype``: gradient reduction dtype.
    ``placement``: the dp placement, concrete (``Shard(d)`` with ``0 <= d < ndim``, or ``Replicate()``;
    ``perparam.sharding.placement.rule`` says what it means). ``stored_dtype``: the
    dtype of the sharded parameter (its ``master_dtype``, else the original dtype), before any stored
    quantization. ``zero_stage``: 1, 2 or 3 (``ParamPolicy.zero_stage``). ``mesh``: the parameter's own
    data-parallel mesh (``ParamPolicy.mesh``), ``None`` for the call's.
    """

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    requires_grad: bool
    quant: QuantPolicy | None
    placement: Placement
    stored_dtype: torch.dtype
    zero_stage: int = 3
    #: where its persistent state lives (``OffloadPolicy()``: on the device)
    offload: OffloadPolicy = OffloadPolicy()
    mesh: DeviceMesh | None = None
    #: its gradient's reduce-scatter wire format (``ParamPolicy.grad_quant``); ``None``: ``reduce_dtype``
    grad_quant: GradQuant | None = None
    #: ``"owner"``: one rank steps the whole parameter (``ParamPolicy.update``); ``"shard"`` otherwise,
    #: including a parameter ``placement="auto"`` replicated (whole on every rank: nothing to route)
    update: str = "shard"
    given: frozenset = frozenset()  #: the dtype fields the policy gave: ``module.to(dtype)`` keeps them

    @cached_property  # a pure function of the fields, read per parameter per reduction
    def keeps_unsharded(self) -> bool:
        """Stage 1 or 2 on a sharded placement: the unsharded parameter is kept across steps."""
        return self.zero_stage in (1, 2) and rule(self.placement).gathered

    @cached_property  # a pure function of the fields, read per parameter per reduction
    def whole_grad(self) -> bool:
        """Stage 1 on a sharded placement: the gradient is all-reduced and kept whole on every rank."""
        return self.zero_stage == 1 and rule(self.placement).gathered


def _float_dtype(dtype: torch.dtype | None, what: str) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise PolicyError(f"{what} must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise PolicyError(f"{what} must be a floating-point dtype, got {dtype}")
    if dtype is not None and dtype.itemsize == 1:  # checked here: compute would fail at the first forward
        raise PolicyError(f"{what} is {dtype}, which torch cannot compute, reduce or optimize in; use "
                          "QuantPolicy('fp8') for an fp8 all-gather, and a 2- or 4-byte dtype here")


def check_mp_policy(mp: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """``mp`` itself, checked (the one place a ``MixedPrecisionPolicy``'s fields are): raises ``PolicyError``
    for a dtype field that is not a 2- or 4-byte floating-point ``torch.dtype`` or a ``cast_forward_inputs``
    that is not a bool."""
    if not isinstance(mp.cast_forward_inputs, bool):
        raise PolicyError("MixedPrecisionPolicy.cast_forward_inputs must be True or False, got "
                          f"{mp.cast_forward_inputs!r}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype", "master_dtype"):
        _float_dtype(getattr(mp, field), f"MixedPrecisionPolicy.{field}")
    return mp


def _resolve_quant(name: str, quant: QuantPolicy) -> QuantPolicy:
    """``quant`` with the quantizer object, its block size and its codes dtype filled in."""
    key = quant.quantizer if quant.quantizer is not None else (quant.dtype or "int8")
    try:
        quantizer = registry.get(key)
    except KeyError:
        raise PolicyError(f"QuantPolicy for '{name}' names no registered quantizer: {key!r}; use one of "
                          f"{registry.names()} or register yours with perparam.quant.register(name, "
                          "quantizer)") from None
    if quant.dtype is not None and quant.dtype != quantizer.codes_dtype:
        raise PolicyError(f"QuantPolicy for '{name}' has dtype {quant.dtype} but quantizer "
                          f"{quantizer.name!r} writes {quantizer.codes_dtype} codes; drop dtype or the "
                          "quantizer")
    block_size = quantizer.default_block_size if quant.block_size is None else quant.block_size
    if not isinstance(block_size, int):
        raise PolicyError(f"QuantPolicy block_size for '{name}' must be an int, got {block_size!r}")
    if not isinstance(quant.store_quantized, bool):
        raise PolicyError(f"QuantPolicy store_quantized for '{name}' must be True or False, got "
                          f"{quant.store_quantized!r}")
    return QuantPolicy(quantizer, block_size, quant.store_quantized, quantizer.codes_dtype)


def resolve_grad_quant(name: str, value) -> GradQuant | None:
    """``ParamPolicy.grad_quant`` as a ``GradQuant``: ``"bf16"``/``torch.bfloat16``, a quantizer name, dtype
    or object, or a ``QuantPolicy`` (its quantizer and block size; ``store_quantized`` refused)."""
    if value is None:
        return None
    if value in ("bf16", torch.bfloat16):
        return BF16
    quant = value if isinstance(value, QuantPolicy) else QuantPolicy(value)
    if quant.store_quantized:
        raise PolicyError(f"grad_quant of '{name}' has store_quantized=True, which applies to stored "
                          "weights, not gradients; pass QuantPolicy(name, block_size=...) without it")
    try:
        quant = _resolve_quant(name, quant)
    except PolicyError as e:
        raise PolicyError(f"grad_quant: {e} (or 'bf16')") from None
    if quant.block_size < 1:
        raise PolicyError(f"grad_quant block_size for '{name}' must be >= 1, got {quant.block_size}")
    return GradQuant(quant.quantizer.name, quant.quantizer, quant.block_size)


def _check_grad_quant(name: str, gq: GradQuant | None, requires_grad: bool, gathered: bool, zero_stage: int,
                      reduce_dtype: torch.dtype) -> None:
    """Refuse a ``grad_quant`` that cannot apply to parameter ``name`` (``PolicyError``)."""
    if gq is None:
        return
    if not requires_grad:
        raise PolicyError(f"parameter '{name}' is frozen, so it has no gradient to reduce-scatter: drop "
                          "grad_quant for it (e.g. narrow the pattern to the trainable parameters)")
    if not gathered:
        raise PolicyError(f"parameter '{name}' is replicated: its gradient is all-reduced, not "
                          "reduce-scattered, and grad_quant quantizes reduce-scatters only; shard it "
                          "(Shard(d)) or drop grad_quant")
    if zero_stage == 1:
        raise PolicyError(f"parameter '{name}' has zero_stage=1, whose gradient is all-reduced whole; "
                          "grad_quant quantizes reduce-scatters only: use zero_stage=2 (same kept parameter, "
                          "sharded gradient) or drop grad_quant")
    if gq.quantizer is None and reduce_dtype.itemsize <= 2:
        raise PolicyError(f"parameter '{name}' already reduces in {reduce_dtype}: grad_quant='bf16' would "
                          "send the same bytes; drop it, or use grad_quant='int8'")


def _replicated(placement) -> bool:
    try:
        return not rule(placement).gathered
    except ValueError:  # Shard(-1) and the like: not replicated (``normalize`` reports the rest)
        return False


def check_zero_stage(name: str, pp: ParamPolicy) -> int:
    """``pp.zero_stage`` made concrete (``None``: 3). Raises ``PolicyError`` naming ``name`` for a stage
    other than 1, 2, 3, and for stage 1 or 2 with an explicit ``Replicate()`` placement (call it before
    ``placement="auto"`` is made concrete: auto's ``Replicate()`` of a tiny parameter is allowed)."""
    stage = 3 if pp.zero_stage is None else pp.zero_stage
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise PolicyError(f"parameter '{name}' has zero_stage={pp.zero_stage!r}; use 1 (optimizer state "
                          "sharded), 2 (gradient too) or 3 (parameter too, the default)")
    if stage != 3 and isinstance(pp.placement, Placement) and _replicated(pp.placement):
        raise PolicyError(f"parameter '{name}' has placement Replicate() and zero_stage={stage}: a "
                          "replicated parameter keeps everything whole (it has no shard to update); drop "
                          "zero_stage for it or shard it (Shard(d) or 'auto')")
    return stage


def resolve(name: str, param, mp: MixedPrecisionPolicy, pp: ParamPolicy | None, ndim: int,
            offload: OffloadPolicy | None = None) -> ResolvedPolicy:
    """Combine the call's ``MixedPrecisionPolicy`` (and ``offload``, the call's ``offload_policy``) with
    ``param``'s ``ParamPolicy`` override ``pp``, already picked from the call's ``param_policy``
    (``policy_pick.pick_policy``, by ``resolution.resolve_param``: the one place a policy is picked);
    ``None``: none.

    Raises ``PolicyError`` naming ``name`` for a policy that cannot apply.
    """
    pp = pp or ParamPolicy()
    if not isinstance(pp, ParamPolicy):
        raise PolicyError(f"param_policy gave {type(pp).__name__} for '{name}'; expected a ParamPolicy or "
                          "None")
    zero_stage = 3 if pp.zero_stage is None else pp.zero_stage  # checked by resolution.resolve_param
    _float_dtype(pp.param_dtype, f"param_dtype of '{name}'")
    _float_dtype(pp.reduce_dtype, f"reduce_dtype of '{name}'")
    _float_dtype(pp.master_dtype, f"master_dtype of '{name}'")
    is_float = param.dtype.is_floating_point
    if pp.master_dtype is not None and not is_float:
        raise PolicyError(f"parameter '{name}' has dtype {param.dtype}; master_dtype {pp.master_dtype} "
                          "applies to floating-point parameters only: drop it for this parameter")
    stored_dtype = pp.master_dtype or (mp.master_dtype if is_float else None) or param.dtype
    if pp.param_dtype is not None and not is_float:
        raise PolicyError(f"parameter '{name}' has dtype {param.dtype}; param_dtype {pp.param_dtype} applies "
                          "to floating-point parameters only: drop it for this parameter")
    param_dtype = pp.param_dtype or (mp.param_dtype if is_float else None) or param.dtype
    reduce_dtype = pp.reduce_dtype or (mp.reduce_dtype if is_float else None) or param_dtype
    if pp.requires_grad is not None and not isinstance(pp.requires_grad, bool):
        raise PolicyError(f"requires_grad of '{name}' must be True, False or None (the parameter's own), got "
                          f"{pp.requires_grad!r}")
    requires_grad = param.requires_grad if pp.requires_grad is None else pp.requires_grad
    if requires_grad and not is_float:
        raise PolicyError(f"parameter '{name}' has dtype {param.dtype} and cannot require grad; "
                          "set ParamPolicy(requires_grad=False)")
    try:
        placement = normalize(pp.placement, ndim)
    except ValueError as e:
        raise PolicyError(f"parameter '{name}' {e}") from None
    gathered = rule(placement).gathered
    quant = pp.quant
    if quant is not None and not isinstance(quant, QuantPolicy):
        raise PolicyError(f"quant of '{name}' must be a QuantPolicy, e.g. ParamPolicy(quant=QuantPolicy("
                          f"{quant!r})), got {type(quant).__name__} {quant!r}")
    if quant is not None:
        quant = _resolve_quant(name, quant)
        if quant.block_size < 1:
            raise PolicyError(f"QuantPolicy block_size for '{name}' must be >= 1, got {quant.block_size}")
        if not is_float:
            raise PolicyError(f"parameter '{name}' has dtype {param.dtype}; only floating-point parameters "
                              "can be quantized: drop quant for it")
        if not gathered:
            raise PolicyError(f"parameter '{name}' is replicated, so it is never all-gathered: quantization "
                              "has no effect; drop quant or shard it")
        if quant.store_quantized and requires_grad:
            raise PolicyError(f"parameter '{name}' is trainable but store_quantized=True keeps only its "
                              "quantized codes; freeze it (ParamPolicy(requires_grad=False)) or use "
                              "store_quantized=False (communication-only quantization)")
        if quant.store_quantized and (placement != Shard(0) or ndim < 2):
            raise PolicyError(f"store_quantized needs a parameter of 2+ dims sharded on dim 0 (scales are "
                              f"kept per row); '{name}' has {ndim} dims and {placement_str(placement)}")
        if quant.store_quantized and zero_stage != 3:
            raise PolicyError(f"parameter '{name}' has store_quantized=True and zero_stage={zero_stage}: "
                              f"stage {zero_stage} keeps the unsharded parameter in {param_dtype} on every "
                              "rank, which undoes what the stored codes save; use zero_stage=3 for it, or "
                              "store_quantized=False (a quantized all-gather refreshes the kept copy)")
    grad_quant = resolve_grad_quant(name, pp.grad_quant)
    _check_grad_quant(name, grad_quant, requires_grad, gathered, zero_stage, reduce_dtype)
    own = as_offload(pp.offload, f"offload of '{name}'")
    tier = own or as_offload(offload, "offload_policy") or OffloadPolicy()
    if tier.offloaded and tier.state == "optimizer" and not requires_grad:
        if own is None:  # the call's policy: a frozen parameter has nothing it applies to
            tier = OffloadPolicy()
    if tier.offloaded and tier.state == "optimizer" and not requires_grad:
        raise PolicyError(f"parameter '{name}' is frozen, so it has no optimizer state to offload to "
                          f"{tier.tier!r}; drop offload for it, or offload its stored shard with "
                          f"OffloadPolicy({tier.tier!r}, 'all', ...)")
    if pp.mesh is not None and not isinstance(pp.mesh, DeviceMesh):
        raise PolicyError(f"ParamPolicy.mesh of '{name}' must be a torch.distributed.device_mesh.DeviceMesh "
                          "(1D, or 2D (replicate, shard)) or None for the call's mesh, got "
                          f"{type(pp.mesh).__name__}")
    update = _check_update(name, pp, ndim, requires_grad, gathered, tier)
    given = frozenset(f for f in ("param_dtype", "reduce_dtype")
                      if getattr(pp, f) or is_float and getattr(mp, f))
    return ResolvedPolicy(param_dtype, reduce_dtype, requires_grad, quant, placement, stored_dtype,
                          zero_stage, tier, pp.mesh, grad_quant, update, given)


def _check_update(name: str, pp: ParamPolicy, ndim: int, requires_grad: bool, gathered: bool,
                  tier: OffloadPolicy) -> str:
    """``pp.update`` made concrete (``"shard"`` or ``"owner"``); ``PolicyError`` naming ``name`` for a
    value or a combination the owner path cannot run."""
    update = "shard" if pp.update is None else pp.update
    if update not in UPDATES:
        raise PolicyError(f"parameter '{name}' has update={pp.update!r}; use 'shard' (each rank steps its "
                          "shard, the default) or 'owner' (one rank steps the whole tensor: Muon, Adafactor)")
    if update == "shard":
        return update
    if ndim == 0:
        raise PolicyError(f"parameter '{name}' is 0-dim, so it is replicated and whole on every rank: drop "
                          "update='owner' for it")
    if not requires_grad:
        raise PolicyError(f"parameter '{name}' is frozen, so no optimizer steps it: drop update='owner' for "
                          "it (e.g. narrow the pattern to the trainable matrices)")
    if not gathered:
        if isinstance(pp.placement, Placement):
            raise PolicyError(f"parameter '{name}' has placement Replicate() and update='owner': a "
                              "replicated parameter is whole on every rank, so every rank steps it exactly; "
                              "drop update='owner' for it, or shard it (Shard(d) or 'auto')")
        return "shard"  # "auto" replicated a tiny parameter: whole everywhere, nothing to route
    if tier.offloaded:
        raise PolicyError(f"parameter '{name}' has update='owner' and offload tier {tier.tier!r}: the owner "
                          "keeps the whole parameter's optimizer state, which the offload tiers (per-shard "
                          "files and host copies) do not move; drop offload for it "
                          "(ParamPolicy(offload='device')) or drop update='owner'")
    return update
