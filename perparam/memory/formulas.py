"""Per-rank model-state memory and per-step communication of DDP and ZeRO-1/2/3, as exact pure functions.

Units: every ``*_bytes`` value and every dataclass field is in bytes, per rank; ``GB`` is 10**9 bytes (the
unit of the ZeRO paper and of the textbook tables). Byte counts are ``fractions.Fraction`` (or ``int``) so
that the textbook figures come out exactly: 1.5e9 parameters on K = 64 ranks give 24.000000, 6.281250,
3.328125 and 0.375000 GB per rank, 1.00x, 3.82x, 7.21x and 64.00x less than DDP.

Source of the formulas: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC20.

* Section 3.1: mixed-precision Adam keeps an fp16 parameter (2 bytes) and an fp16 gradient (2 bytes) per
  parameter, plus an optimizer state of 12 bytes (fp32 master copy, fp32 first and second moment).
* Section 5 and Figure 1: with N_d data-parallel ranks, ZeRO-1 (P_os) keeps ``P + G + O / N_d`` bytes per
  parameter on each rank, ZeRO-2 (P_os+g) ``P + (G + O) / N_d``, ZeRO-3 (P_os+g+p) ``(P + G + O) / N_d``.
* Section 7: DDP's all-reduce moves ``2 Psi`` (a reduce-scatter plus an all-gather), ZeRO-1/2 move the same
  ``2 Psi`` (reduce-scatter of gradients, all-gather of updated parameters), ZeRO-3 ``3 Psi`` (the
  parameters are all-gathered in forward and again in backward), i.e. 1.5x DDP. perparam's stage 1
  all-reduces the gradients instead (each rank keeps the whole gradient): ``3 Psi``; the communication
  table gives perparam's figure and the paper's as a row of its own (``PAPER_ZERO1``).

The paper writes Psi for the parameter count, K for the optimizer bytes per parameter and N_d for the
data-parallel degree; here they are ``num_params``, ``BytesPerParam.optimizer`` and ``world_size`` (which the
rest of perparam and the CLI call K).

Communication is counted as the bytes one rank sends per training step with ring collectives: a ring
reduce-scatter or all-gather over K ranks of a buffer of B bytes sends ``(K - 1) / K * B`` bytes per rank,
a ring all-reduce (reduce-scatter then all-gather) ``2 (K - 1) / K * B`` (Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009). Each rank receives as much as it
sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perparam.sharding.layout import ShardLayout

#: Bytes in one GB (decimal, as in the ZeRO paper and the textbook tables).
GB = 10**9

Number = int | Fraction

#: The data-parallel schemes in table order.
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")

# Which model-state components each stage shards over the K ranks: (params, grads, optimizer).
_SHARDED = {
    "DDP": (False, False, False),
    "ZeRO-1": (False, False, True),
    "ZeRO-2": (False, True, True),
    "ZeRO-3": (True, True, True),
}


def exact(x: Number | float | str) -> Fraction:
    """``x`` as an exact ``Fraction``; floats and strings are read as the decimal they print as.

    ``exact(1.5e9) == exact("1.5e9") == 1500000000``; ``exact(0.1) == Fraction(1, 10)`` (not the binary
    double closest to 0.1).
    """
    if isinstance(x, Fraction):
        return x
    if isinstance(x, bool):
        raise TypeError("a byte or parameter count cannot be a bool")
    if isinstance(x, int):
        return Fraction(x)
    if isinstance(x, float):
        return Fraction(repr(x))
    if isinstance(x, str):
        return Fraction(x.strip().replace(",", "_"))
    raise TypeError(f"cannot read {x!r} as an exact number")


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str | int | float) -> int:
    """A parameter count from ``"1.5e9"``, ``"1.5B"``, ``"124M"``, ``"1_557_611_200"`` or a number.

    Suffixes are decimal: K = 1e3, M = 1e6, B = G = 1e9, T = 1e12. Raises ``ValueError`` when the value is
    negative or not a whole number.
    """
    scale = 1
    if isinstance(text, str):
        text = text.strip()
        if text and text[-1].upper() in _SUFFIXES:
            scale, text = _SUFFIXES[text[-1].upper()], text[:-1]
    try:
        value = exact(text) * scale
    except (ValueError, ZeroDivisionError) as err:
        raise ValueError(f"not a parameter count: {text!r}") from err
    if value.denominator != 1 or value < 0:
        raise ValueError(f"a parameter count must be a whole number >= 0, got {value}")
    return int(value)


def format_fixed(x: Number, places: int = 6) -> str:
    """``x`` as a decimal with ``places`` digits after the point, rounded exactly (half to even)."""
    scaled = round(Fraction(x) * 10**places)
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**places)
    return f"{sign}{whole}.{frac:0{places}d}" if places else f"{sign}{whole}"


def format_gb(nbytes: Number, places: int = 6) -> str:
    """Bytes as GB (10**9 bytes) with ``places`` decimals, e.g. ``format_gb(6_281_250_000) == "6.281250"``."""
    return format_fixed(Fraction(nbytes) / GB, places)


def as_json_number(x: Number) -> int | float:
    """An ``int`` when ``x`` is whole, else the nearest float (for JSON output)."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes of model state kept per parameter, before sharding.

    Defaults are mixed-precision Adam (ZeRO paper, Section 3.1): ``params`` 2 (fp16 weights), ``grads``
    2 (fp16 gradients), ``optimizer`` 12 (fp32 master weights 4 + fp32 momentum 4 + fp32 variance 4).
    Fractional values are allowed (e.g. block-quantized states).
    """

    params: Number = 2
    grads: Number = 2
    optimizer: Number = 12

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optimizer"):
            value = exact(getattr(self, name))
            if value < 0:
                raise ValueError(f"bytes per parameter must be >= 0, got {name}={value}")
            object.__setattr__(self, name, value)

    @property
    def total(self) -> Fraction:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class ModelState:
    """Unsharded model state of ``num_params`` parameters, in bytes: what every DDP rank holds.

    ``trainable_params`` (default: all) is the number of parameters with a gradient and optimizer state.
    """

    num_params: int
    params: Fraction
    grads: Fraction
    optimizer: Fraction
    trainable_params: int

    @property
    def total(self) -> Fraction:
        return self.params + self.grads + self.optimizer


def model_state(
    num_params: int, bytes_per_param: BytesPerParam | None = None, trainable_params: int | None = None,
) -> ModelState:
    """Bytes of parameters, gradients and optimizer state of an unsharded model (Table 7-1 of the textbook).

    For 1.5e9 parameters and the default ``BytesPerParam``: 3 GB + 3 GB + 18 GB = 24 GB.
    """
    bpp = bytes_per_param or BytesPerParam()
    trainable = num_params if trainable_params is None else trainable_params
    if num_params < 0 or not 0 <= trainable <= num_params:
        raise ValueError(f"need 0 <= trainable_params <= num_params, got {trainable} and {num_params}")
    return ModelState(
        num_params=num_params,
        params=bpp.params * num_params,
        grads=bpp.grads * trainable,
        optimizer=bpp.optimizer * trainable,
        trainable_params=trainable,
    )


@dataclass(frozen=True)
class StageMemory:
    """Model-state bytes held by each rank under one scheme (ZeRO paper, Section 5 / Figure 1).

    ``params``, ``grads``, ``optimizer``: bytes per rank. ``ddp_total``: bytes per rank under DDP, the
    baseline. ``ratio_vs_ddp``: ``ddp_total / total``, how many times less memory than DDP (1 for DDP).
    Counts only persistent model state: no activations, temporary all-gather buffers or fragmentation.
    """

    stage: str
    world_size: int
    params: Fraction
    grads: Fraction
    optimizer: Fraction
    ddp_total: Fraction

    @property
    def total(self) -> Fraction:
        return self.params + self.grads + self.optimizer

    @property
    def ratio_vs_ddp(self) -> Fraction:
        return self.ddp_total / self.total if self.total else Fraction(1)

    def as_dict(self, places: int = 6) -> dict:
        """JSON-ready: bytes (int when whole), GB as a float and as an exact fixed-point string."""
        out: dict = {"stage": self.stage, "world_size": self.world_size}
        for name in ("params", "grads", "optimizer", "total"):
            value = getattr(self, name)
            out[f"{name}_bytes"] = as_json_number(value)
            out[f"{name}_gb"] = float(value / GB)
        out["total_gb_str"] = format_gb(self.total, places)
        out["ratio_vs_ddp"] = float(self.ratio_vs_ddp)
        return out


def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def stage_memory(
    stage: str, num_params: int, world_size: int, bytes_per_param: BytesPerParam | None = None,
    trainable_params: int | None = None,
) -> StageMemory:
    """Model-state bytes per rank of ``stage`` (one of ``STAGES``) for ``num_params`` over ``world_size``
    ranks.

    With P, G, O the unsharded bytes of parameters, gradients and optimizer state (``model_state``) and
    K = ``world_size`` (ZeRO paper, Section 5 / Figure 1):

    * DDP:    ``P + G + O``
    * ZeRO-1: ``P + G + O / K``
    * ZeRO-2: ``P + (G + O) / K``
    * ZeRO-3: ``(P + G + O) / K``

    The division is exact (the mean over ranks; a real chunked layout puts up to one row more on the first
    ranks, see ``perparam.memory.plan``).
    """
    if stage not in _SHARDED:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    _check_world(world_size)
    state = model_state(num_params, bytes_per_param, trainable_params)
    shard_p, shard_g, shard_o = _SHARDED[stage]
    k = Fraction(world_size)
    return StageMemory(
        stage=stage,
        world_size=world_size,
        params=state.params / k if shard_p else state.params,
        grads=state.grads / k if shard_g else state.grads,
        optimizer=state.optimizer / k if shard_o else state.optimizer,
        ddp_total=state.total,
    )


def memory_table(
    num_params: int, world_size: int, bytes_per_param: BytesPerParam | None = None,
    trainable_params: int | None = None,
) -> list[StageMemory]:
    """``stage_memory`` for every stage in ``STAGES`` (Table 7-2 of the textbook for 1.5e9 and K = 64)."""
    return [stage_memory(s, num_params, world_size, bytes_per_param, trainable_params) for s in STAGES]


@dataclass(frozen=True)
class StageCommunication:
    """Bytes one rank sends per training step under one scheme, split by collective (ring algorithms).

    ``all_reduce``: gradient all-reduce (DDP). ``reduce_scatter``: gradient reduce-scatter (ZeRO).
    ``all_gather``: parameter all-gathers (ZeRO-1/2: once after the optimizer step; ZeRO-3: before
    forward and again before backward). ``ddp_total``: DDP's bytes, the baseline.
    ``volume_vs_ddp``: ``total / ddp_total``, how many times DDP's volume (1.5 for ZeRO-3).
    """

    stage: str
    world_size: int
    all_reduce: Fraction
    reduce_scatter: Fraction
    all_gather: Fraction
    ddp_total: Fraction
    collectives: str

    @property
    def total(self) -> Fraction:
        return self.all_reduce + self.reduce_scatter + self.all_gather

    @property
    def volume_vs_ddp(self) -> Fraction:
        if self.ddp_total:
            return self.total / self.ddp_total
        return Fraction(1) if not self.total else Fraction(0)

    def as_dict(self, places: int = 6) -> dict:
        out: dict = {"stage": self.stage, "world_size": self.world_size, "collectives": self.collectives}
        for name in ("all_reduce", "reduce_scatter", "all_gather", "total"):
            out[f"{name}_bytes"] = as_json_number(getattr(self, name))
        out["total_gb"] = float(self.total / GB)
        out["total_gb_str"] = format_gb(self.total, places)
        out["volume_vs_ddp"] = float(self.volume_vs_ddp)
        return out


#: the communication table's extra row: ZeRO-1 as the ZeRO paper runs it (Section 7), not as perparam does
PAPER_ZERO1 = "ZeRO-1 (paper)"

_COLLECTIVES = {
    "DDP": "all-reduce(grads)",
    "ZeRO-1": "all-reduce(grads) + all-gather(params)",
    "ZeRO-2": "reduce-scatter(grads) + all-gather(params)",
    "ZeRO-3": "all-gather(params) x2 (fwd, bwd) + reduce-scatter(grads)",
    PAPER_ZERO1: "reduce-scatter(grads) + all-gather(params) (not run by perparam)",
}


def stage_communication(
    stage: str, num_params: int, world_size: int, bytes_per_param: BytesPerParam | None = None,
) -> StageCommunication:
    """Bytes sent per rank per step by ``stage`` as perparam runs it (``docs/zero-stages.md``), with ring
    collectives; ``PAPER_ZERO1``: ZeRO-1 as the ZeRO paper runs it (Section 7).

    With G the gradient bytes and P the parameter bytes of the whole model (``model_state``) and K ranks,
    a ring collective over a B-byte buffer sends ``(K - 1) / K * B`` per rank per pass:

    * DDP (``placement=Replicate()``): all-reduce of G = ``2 (K - 1) / K * G``.
    * ZeRO-1 (``zero_stage=1``): all-reduce of G (every rank keeps the whole gradient) plus the refresh
      all-gather of P = ``(K - 1) / K * (2 G + P)``: 1.5x DDP when P = G.
    * ZeRO-2: reduce-scatter of G plus the refresh all-gather of P = ``(K - 1) / K * (G + P)``.
    * ZeRO-3: reduce-scatter of G plus two all-gathers of P = ``(K - 1) / K * (G + 2 P)``.
    * The paper's ZeRO-1: reduce-scatter of G plus all-gather of P, ZeRO-2's bytes.

    With P = G (fp16 weights and gradients, the paper's setting): DDP, ZeRO-2 and the paper's ZeRO-1 send
    ``2 (K - 1) / K * G``, perparam's ZeRO-1 and ZeRO-3 ``3 (K - 1) / K * G`` (1.5x). All parameters are taken
    as trainable. Raises ``ValueError`` for an unknown stage or K < 1.
    """
    if stage not in _SHARDED and stage != PAPER_ZERO1:
        raise ValueError(f"unknown stage {stage!r}; expected one of {(*STAGES, PAPER_ZERO1)}")
    _check_world(world_size)
    state = model_state(num_params, bytes_per_param)
    ring = Fraction(world_size - 1, world_size)
    ddp = 2 * ring * state.grads
    zero = Fraction(0)
    if stage == "DDP":
        parts = (ddp, zero, zero)
    elif stage == "ZeRO-1":
        parts = (ddp, zero, ring * state.params)
    elif stage in ("ZeRO-2", PAPER_ZERO1):
        parts = (zero, ring * state.grads, ring * state.params)
    else:
        parts = (zero, ring * state.grads, 2 * ring * state.params)
    return StageCommunication(stage, world_size, *parts, ddp_total=ddp, collectives=_COLLECTIVES[stage])


def communication_table(
    num_params: int, world_size: int, bytes_per_param: BytesPerParam | None = None,
) -> list[StageCommunication]:
    """``stage_communication`` for every stage in ``STAGES`` (as perparam runs it), then ``PAPER_ZERO1``."""
    return [stage_communication(s, num_params, world_size, bytes_per_param) for s in (*STAGES, PAPER_ZERO1)]


def kept_bytes(layout: ShardLayout, policy) -> int:
    """Bytes of the unsharded copy a stage-1/2 parameter keeps on every rank (``ParamPolicy.zero_stage``):
    its padded buffer (``layout.buffer_shape``, K chunks) in ``param_dtype``; 0 for stage 3 and
    replicated parameters. Counted in the P row: with it, a stage-1/2 rank holds P (this copy, in the
    compute dtype), and its shard (the optimizer's copy, P/K in the stored dtype) either inside it
    (``perparam.sharding.resolution.shard_in_kept``: Table 7-2's P) or beside it (a ``param_dtype`` cast,
    quantization, an offload tier, tensor parallelism: P + P/K)."""
    if not policy.keeps_unsharded:
        return 0
    return math.prod(layout.buffer_shape) * policy.param_dtype.itemsize
