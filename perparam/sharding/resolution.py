"""One parameter's sharding, resolved without processes: what ``fully_shard`` does and ``perparam plan``
reports.

``resolve_params`` takes names and tensors (real, meta or tensor-parallel DTensors), the call's
``MixedPrecisionPolicy`` and ``param_policy``, and K (the size of the mesh's shard axis; the replicate axis
of an HSDP mesh does not change what a rank holds). Per parameter it checks what ``fully_shard`` refuses
(integer parameters that require grad, complex; a 0-dim one needs ``Replicate()``), resolves the policy
(``policy.resolve``; a ``placement="auto"`` becomes a concrete ``Shard(d)`` or ``Replicate()`` through
``placement.auto_placement``), and derives the layout and the all-gather pieces (``shard_layout``). The
runtime (``api.fully_shard``, ``param.ShardedParam``) and ``perparam.memory.plan`` call these functions, so
their figures cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Shard  # (DeviceMesh: the type only)
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from .layout import ShardLayout, WirePiece, ceil_div, wire_pieces
from .placement import AUTO_REPLICATE_BYTES, auto_placement, rule
from .policy import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    ParamPolicy,
    PolicyError,
    ResolvedPolicy,
    check_zero_stage,
    resolve,
)
from .policy_pick import check_patterns, pick_policy

#: The ``ParamPolicy.placement`` value that asks for ``auto_placement``.
AUTO = "auto"


class ParamError(ValueError):
    """A parameter ``fully_shard`` cannot shard whatever the policy; the message names it and the fix."""


def check_param(fqn: str, p: torch.Tensor, owner: str) -> None:
    """Raise ``ParamError`` for a non-floating-point parameter that requires grad, or a complex one. (A 0-dim
    parameter is refused by ``policy.resolve`` unless its placement is ``Replicate()`` or ``"auto"``.)"""
    if isinstance(p, torch.nn.parameter.UninitializedParameter):
        raise ParamError(f"parameter '{fqn}' of {owner} is not initialised yet (a Lazy module); run one "
                         "forward with a sample batch before fully_shard, which gives it its shape")
    if p.requires_grad and not (p.is_floating_point() or p.is_complex()):
        raise ParamError(f"parameter '{fqn}' of {owner} has dtype {p.dtype} and requires grad; only "
                         "floating-point parameters can be trained: set requires_grad=False")
    if p.is_complex():
        raise ParamError(f"parameter '{fqn}' of {owner} is complex ({p.dtype}); store it as a real view "
                         "(torch.view_as_real) instead")


def dp_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape the data-parallel shard axis splits: the tensor's, or a tensor-parallel DTensor's local
    one."""
    return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)


def _auto(name: str, pp: ParamPolicy, p: torch.Tensor, num_shards: int, replicate_below: int,
          tensor_parallel: bool = False) -> ParamPolicy:
    """``pp`` with ``placement="auto"`` replaced by ``auto_placement``'s choice for ``p``."""
    q = pp.quant
    if (isinstance(p, DTensor) or tensor_parallel) and p.dim():  # tp: keep the dp split on dim 0, the default
        return dataclasses.replace(pp, placement=Shard(0))
    store_quantized = q is not None and q.store_quantized
    placement = auto_placement(
        dp_shape(p), p.dtype.itemsize, num_shards, replicate_below=replicate_below,
        dims=[0] if store_quantized else None, allow_replicate=q is None and pp.grad_quant is None,
    )
    # a tiny parameter "auto" replicates is whole on every rank: nothing for an owner to do
    update = pp.update if rule(placement).gathered else None
    return dataclasses.replace(pp, placement=placement, update=update)


def resolve_param(name: str, p: torch.Tensor, mp: MixedPrecisionPolicy, param_policy, num_shards: int, *,
                  replicate_below: int = AUTO_REPLICATE_BYTES, names: Sequence[str] = (),
                  tensor_parallel: bool = False, compute_dtype: torch.dtype | None = None,
                  offload: OffloadPolicy | None = None) -> ResolvedPolicy:
    """``policy.resolve`` for one parameter, with ``placement="auto"`` made concrete for K = ``num_shards``.

    ``names``: all of the parameter's names (tied aliases; default ``(name,)``), any of which a pattern may
    match. ``tensor_parallel``: ``p`` stands for a tensor-parallel parameter (its tp-local shape), which
    ``"auto"`` keeps on ``Shard(0)`` (a real tp DTensor is recognised by its type). ``compute_dtype``: the
    dtype the parameter must compute in whatever the call's ``param_dtype`` (``buffer_dtypes``: a
    norm's running statistics); a different ``param_dtype`` given for it raises ``PolicyError``. Raises
    ``PolicyError`` (naming ``name``) for a policy that cannot apply, including a string placement other
    than ``"auto"``. ``offload``: the call's ``offload_policy`` (a ``ParamPolicy.offload`` overrides it).
    """
    pp = pick_policy(name, p, param_policy, names)
    if pp is not None and not isinstance(pp, ParamPolicy):
        raise PolicyError(f"param_policy gave {type(pp).__name__} for '{name}'; expected a ParamPolicy or "
                          "None")
    if pp is not None and isinstance(pp.mesh, DeviceMesh):  # "auto" picks for its own shard axis (another
        # type is refused by ``policy.resolve``)
        num_shards = shard_count(pp.mesh, num_shards)
    if compute_dtype is not None and p.is_floating_point():
        pp = pp or ParamPolicy()
        if pp.param_dtype is not None and pp.param_dtype != compute_dtype:
            raise PolicyError(f"parameter '{name}' computes with its module's running statistics, which are "
                              f"{compute_dtype} buffers, so it cannot compute in param_dtype "
                              f"{pp.param_dtype}: drop its param_dtype (perparam computes the module in "
                              f"{compute_dtype}) or convert the module, buffers included, with "
                              f".to({pp.param_dtype}) before fully_shard")
        pp = dataclasses.replace(pp, param_dtype=compute_dtype)
    if pp is None:
        return resolve(name, p, mp, None, p.dim(), offload)
    check_zero_stage(name, pp)  # before "auto" is made concrete
    if isinstance(pp.placement, str):
        if pp.placement != AUTO:
            raise PolicyError(f"placement {pp.placement!r} for '{name}' is not supported; use Shard(d), "
                              "Replicate() or 'auto'")
        pp = _auto(name, pp, p, num_shards, replicate_below, tensor_parallel)
    return resolve(name, p, mp, pp, p.dim(), offload)


def shard_count(mesh, default: int) -> int:
    """K of a parameter: the size of ``mesh``'s shard axis (its last), or ``default`` (the call's K) when
    ``mesh`` is ``None``. Reads the mesh's shape only (no process group)."""
    return default if mesh is None else mesh.size(mesh.ndim - 1)


def shard_layout(shape: Sequence[int], policy: ResolvedPolicy,
                 num_shards: int) -> tuple[ShardLayout, tuple[WirePiece, ...]]:
    """The layout of a parameter of ``shape`` (what the dp axis splits) stored as ``policy.stored_dtype``, and
    the pieces one rank sends for it in its group's all-gather (``layout.wire_pieces``).

    A stored-quantized parameter is stored in its quantization dtype (1 byte per element), its scales
    apart (``ParamResolution.scale_bytes``); the plain wire dtype is the ``param_dtype``.
    """
    q = policy.quant
    stored_quantized = q is not None and q.store_quantized
    stored = q.dtype if stored_quantized else policy.stored_dtype  # master_dtype, else the original dtype
    layout = ShardLayout(tuple(shape), stored, num_shards, policy.placement)
    pieces = wire_pieces(layout, policy.param_dtype, q.quantizer if q else None, q.block_size if q else None,
                         row_blocks=stored_quantized)
    return layout, pieces


def shard_in_kept(policy: ResolvedPolicy, split_by_tp: bool = False) -> bool:
    """A stage-1/2 parameter whose kept copy holds its shard bit for bit: ``Shard(0)``, the stored dtype is
    the compute dtype, no quantization (stored or on the wire), no offload tier, stepped per shard, not split
    by tensor parallelism. Its shard is then a view of the copy's own rows (``perparam.runtime.shard_view``):
    the parameter costs P per rank, not P + P/K (``perparam.memory`` counts it so)."""
    return (policy.keeps_unsharded and policy.placement == Shard(0)
            and policy.stored_dtype == policy.param_dtype
            and policy.quant is None and not policy.offload.offloaded and policy.update == "shard"
            and not split_by_tp)


@dataclass(frozen=True)
class ParamResolution:
    """One parameter as ``fully_shard`` shards it: name, resolved policy, layout, all-gather pieces."""

    name: str
    policy: ResolvedPolicy
    layout: ShardLayout
    pieces: tuple[WirePiece, ...]

    @property
    def requires_grad(self) -> bool:
        return self.policy.requires_grad

    @property
    def stored_quantized(self) -> bool:
        return self.policy.quant is not None and self.policy.quant.store_quantized

    @property
    def placement(self) -> Placement:
        return self.layout.placement

    def scale_bytes(self, rank: int) -> int:
        """Bytes of the fp32 per-row block scales shard ``rank`` keeps beside a stored-quantized parameter
        (``[rows, ceil(row / block_size)]``, sharded with the rows); 0 otherwise."""
        if not self.stored_quantized:
            return 0
        row = math.prod(self.layout.global_shape[1:])
        return self.layout.extent(rank)[1] * ceil_div(row, self.policy.quant.block_size) * 4

    def stored_bytes(self, rank: int) -> int:
        """Bytes shard ``rank`` stores for this parameter: its shard (no padding) plus any scales; a
        stored-quantized shard holds its quantizer's codes (e.g. NF4: two per byte, per row)."""
        if self.stored_quantized:
            q = self.policy.quant
            rows = self.layout.extent(rank)[1]
            codes = q.quantizer.codes_per_row(math.prod(self.layout.global_shape[1:])) * q.dtype.itemsize
            return rows * codes + self.scale_bytes(rank)
        return self.layout.local_bytes(rank)


def aliases_of(module: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of each of ``module``'s parameters, keyed by the first (the one ``named_parameters``
    gives): a parameter tied under several names (``lm_head.weight`` is ``embed.weight``) has them all."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {ns[0]: tuple(ns) for ns in names.values()}


def resolve_params(named: Sequence[tuple[str, torch.Tensor]], mp: MixedPrecisionPolicy | None, param_policy,
                   num_shards: int, owner: str = "the module", *,
                   replicate_below: int = AUTO_REPLICATE_BYTES,
                   aliases: Mapping[str, Sequence[str]] | None = None, tensor_parallel: Collection[str] = (),
                   compute_dtypes: Mapping[str, torch.dtype] | None = None,
                   offload: OffloadPolicy | None = None) -> list[ParamResolution]:
    """Check, resolve and lay out every parameter of one ``fully_shard`` call over a shard axis of K ranks
    (``num_shards``; a parameter whose ``ParamPolicy.mesh`` is set is laid out for that mesh's shard axis).

    ``named``: ``(name, parameter)`` pairs, names relative to the module given (as ``fully_shard`` names
    them); under TP a parameter is its tp DTensor, or (``perparam plan``) a tensor of its tp-local shape
    whose name is in ``tensor_parallel``. ``aliases``: name -> all names of a tied parameter; a mapping
    pattern matching any of them applies. Raises ``ParamError`` or ``PolicyError`` (both ``ValueError``)
    naming the parameter; a mapping pattern that matches no name raises ``PolicyError``, and so do two
    patterns giving different policies to names of one tied parameter. ``compute_dtypes``: name -> the
    dtype that parameter must compute in (``buffer_dtypes``), see ``resolve_param``. ``offload``: the
    call's ``offload_policy``. Nothing is allocated.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    mp = mp or MixedPrecisionPolicy()
    aliases = aliases or {}
    for name, p in named:
        check_param(name, p, owner)
    check_patterns([alias for name, _ in named for alias in aliases.get(name, (name,))], param_policy)
    out = []
    for name, p in named:
        on_tp = isinstance(p, DTensor) or name in tensor_parallel
        policy = resolve_param(name, p, mp, param_policy, num_shards, replicate_below=replicate_below,
                               names=aliases.get(name, (name,)), tensor_parallel=on_tp,
                               compute_dtype=(compute_dtypes or {}).get(name), offload=offload)
        if on_tp and policy.quant is not None and policy.quant.store_quantized:
            raise PolicyError(f"parameter '{name}' is tensor-parallel; store_quantized is not supported for "
                              "tensor-parallel parameters: quantize its communication only")
        if on_tp and policy.update == "owner":  # fully_shard and perparam plan alike (this one check)
            raise PolicyError(f"parameter '{name}' is tensor-parallel and has update='owner': the owner path "
                              "brings whole data-parallel shards to one rank, not tensor-parallel ones; drop "
                              "update='owner' for it (or do not tensor-parallelize it)")
        layout, pieces = shard_layout(dp_shape(p), policy, shard_count(policy.mesh, num_shards))
        out.append(ParamResolution(name, policy, layout, pieces))
    return out


def buffer_dtypes(roots: list[tuple[str, nn.Module]], skip) -> dict[str, torch.dtype]:
    """Parameter name -> the dtype of its module's running statistics, for every stock norm with
    floating-point running statistics in the call's trees (``roots``: ``(name prefix, module)``;
    ``skip(module)``: true for a module sharded by an earlier call, whose subtree is not this call's)."""
    out: dict[str, torch.dtype] = {}
    for prefix, root in roots:
        stack = [(prefix, root, True)]
        while stack:
            path, module, top = stack.pop()
            if not top and skip(module):
                continue
            stats = module._buffers.get("running_mean") if isinstance(module, _NormBase) else None
            if stats is not None and not is_lazy(stats) and stats.is_floating_point():
                for name, p in module._parameters.items():
                    if p is not None:
                        out[path + name] = stats.dtype
            for name, child in module._modules.items():
                if child is not None:
                    stack.append((f"{path}{name}.", child, False))
    return out
