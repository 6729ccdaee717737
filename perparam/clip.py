"""The global gradient norm of a model whose gradients live on different meshes, and clipping by it.

The rule: every rank contributes ``sum over its local shards of ||shard||_p^p / copies`` (``max |x|`` for
``p = inf``, where copies do not matter), ``copies`` being the number of ranks that hold each element of
that gradient; the contributions of all ranks then add up to ``sum |x|^p`` over every distinct element,
each counted once. An empty shard contributes 0. ``copies`` of a DTensor gradient on a mesh ``M`` cut from
a root mesh ``R`` (``M`` itself when it was not cut) is the product of

* the sizes of ``M``'s ``Replicate()`` axes: along its ``Shard``/``_StridedShard`` axes the local shards
  partition the elements (HSDP ``(Replicate(), Shard(0))`` on 2 x 2: 2 copies; TP-composed: 1);
* the sizes of ``R``'s axes that ``M`` does not span and that *replicate* it (``replicated_axes``, e.g. the
  ``tp`` axis for a parameter sharded on ``mesh["dp_shard"]`` only: its tp peers hold the same one). Along
  a *distinct* axis (``distinct_axes``, e.g. ``ep``: a per-rank expert on ``mesh["edp"]``) the ranks hold
  other parameters, which they contribute themselves: factor 1. Ranks outside ``R`` hold other parameters.

A plain (non-DTensor) gradient counts as replicated on every rank of the default group, as DDP's is
(``copies = world size``).

The one assumption: the copies of an element are equal (the gradient really is replicated where the rule
says it is, as after perparam's or DDP's reduction). If they are not, the result is the mean of ``|x|^p``
over the copies: still the same on every rank.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils import clip_grads_with_norm_, get_total_norm
from torch.utils.weak import WeakIdKeyDictionary

from mesh import AXIS_NAMES, default_device_type

from .comm import collectives
from .comm.peers import lost_peers
from .runtime import owner_grads
from .runtime.live_groups import GROUPS

__all__ = ["clip_grad_norm_", "copies", "outside_copies", "local_contribution", "combine", "DISTINCT_AXES",
           "REPLICATED_AXES"]

#: Root-mesh axis names along which ranks hold different parameters (expert and pipeline parallelism).
DISTINCT_AXES = ("ep", "pp")
#: Root-mesh axis names along which ranks hold the same parameters (mesh.AXIS_NAMES, "dp", "cp").
REPLICATED_AXES = (*AXIS_NAMES, "dp", "cp")


def copies(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> int:
    """How many ranks of a mesh of ``mesh_shape`` hold each element of a DTensor with ``placements`` (one per
    mesh axis): the product of the sizes of the ``Replicate()`` axes, 1 when every axis shards.

    Raises ``ValueError`` for a placement that neither shards (``Shard``, ``_StridedShard``) nor replicates,
    e.g. ``Partial``: its local tensors hold summands of the elements, not the elements."""
    if len(mesh_shape) != len(placements):
        raise ValueError(f"mesh shape {tuple(mesh_shape)} and placements {tuple(placements)} need one entry "
                         "per mesh axis")
    n = 1
    for size, placement in zip(mesh_shape, placements):
        if placement.is_replicate():
            n *= size
        elif not isinstance(placement, (Shard, _StridedShard)):
            raise ValueError(f"placement {placement!r} holds partial values, not the gradient's elements; "
                             "reduce the gradient first (grad.redistribute(placements=[Replicate() or "
                             "Shard(d)]))")
    return n


def outside_copies(root_shape: Sequence[int], root_names: Sequence[str] | None, mesh_axes: Collection[int],
                   distinct_axes: Collection[str] = DISTINCT_AXES,
                   replicated_axes: Collection[str] = REPLICATED_AXES) -> int:
    """How many copies of a sub-mesh spanning root axes ``mesh_axes`` hold the same parameter: the product
    of the sizes of the other root axes (``root_shape``, named ``root_names``) in ``replicated_axes``;
    axes in ``distinct_axes`` and of size 1 count 1.

    Raises ``ValueError`` naming an axis of size > 1 outside the sub-mesh that is in neither collection:
    nothing tells whether its ranks hold the same parameters or other ones."""
    n = 1
    for axis, size in enumerate(root_shape):
        if axis in mesh_axes or size == 1:
            continue
        name = root_names[axis] if root_names is not None else None
        if name in replicated_axes:
            n *= size
        elif name not in distinct_axes:
            raise ValueError(f"its mesh was cut from a mesh with axes {root_names} along axis {name or axis} "
                             f"(size {size}), which is neither replicating nor distinct: pass "
                             f"replicated_axes=(..., {name!r}) if the ranks along it hold the same "
                             f"parameters, distinct_axes=(..., {name!r}) if they hold other ones (experts, "
                             "pipeline stages)")
    return n


#: DeviceMesh (by identity, weakly) -> the root axes it spans, read once per mesh
_SPANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _mesh_copies(mesh: DeviceMesh, distinct_axes: Collection[str], replicated_axes: Collection[str]) -> int:
    """``outside_copies`` of a DeviceMesh: the root axes it spans are those its ranks' coordinates vary along
    (read from the mesh tensors once per mesh, not at every clip)."""
    root = mesh._get_root_mesh()
    spans = _SPANS.get(mesh)
    if spans is None:
        ranks = mesh.mesh.flatten().tolist()
        where = torch.stack([(root.mesh == r).nonzero()[0] for r in ranks])  # [mesh size, root ndim]
        spans = _SPANS[mesh] = frozenset(a for a in range(root.ndim)
                                         if bool((where[:, a] != where[0, a]).any()))
    return outside_copies(tuple(root.shape), root.mesh_dim_names, spans, distinct_axes, replicated_axes)


def local_contribution(shards: Iterable[tuple[torch.Tensor, int]], norm_type: float,
                       foreach: bool | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's part of the global ``norm_type``-norm, a 0-dim float64 tensor on ``device``.

    ``shards``: ``(local tensor, copies)`` pairs, any shapes and floating dtypes. Finite ``p``: the sum of
    ``||tensor||_p^p / copies``; ``p = inf``: the largest ``|x|``. Empty tensors contribute 0 (a rank that
    holds nothing returns 0). Per-tensor norms come from ``torch.nn.utils.get_total_norm`` (in the tensors'
    dtype, ``foreach`` as torch means it), one call per distinct ``copies``; the rest is float64."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for t, n in shards:
        if t.numel():
            by_copies.setdefault(n, []).append(t)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for n, tensors in by_copies.items():
        norm = get_total_norm(tensors, norm_type, False, foreach).to(device, torch.float64)
        total = torch.maximum(total, norm) if norm_type == float("inf") else total + norm ** norm_type / n
    return total


def combine(contributions: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The global norm (0-dim float64) from every rank's ``local_contribution`` (``[world]`` float64, in rank
    order): ``max`` for ``p = inf``, else ``sum ** (1 / p)``. NaN propagates."""
    if norm_type == float("inf"):
        return contributions.max()
    return contributions.sum() ** (1.0 / norm_type)


@torch.no_grad()
def check_max_norm(max_norm) -> None:
    """Raise ``ValueError`` naming ``max_norm`` unless it is ``>= 0`` (``float('inf')`` included: the norm
    measured, the gradients left as they are): a negative one flips every gradient's sign, NaN makes every
    gradient NaN (torch's ``clip_grad_norm_`` does both silently). A tensor on an accelerator is not read
    back for this (a host sync)."""
    if isinstance(max_norm, torch.Tensor) and max_norm.device.type != "cpu":
        return
    value = float(max_norm)
    if not value >= 0:
        harm = "make every gradient NaN" if value != value else "flip the sign of every gradient"
        raise ValueError(f"clip_grad_norm_: max_norm={value!r} would {harm}; pass the largest global norm to "
                         "allow (>= 0, e.g. 1.0), or float('inf') to measure the norm and leave the "
                         "gradients as they are")


@lost_peers("perparam.clip_grad_norm_")
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    distinct_axes: Collection[str] = DISTINCT_AXES,
                    replicated_axes: Collection[str] = REPLICATED_AXES) -> torch.Tensor:
    """Clip gradients by their global norm, the same on every rank; return that norm (0-dim float32).

    The norm is over every distinct gradient element held anywhere, each counted once; the rule, its one
    assumption and what ``distinct_axes``/``replicated_axes`` mean (root-mesh axis names along which ranks
    hold other / the same parameters) are in this module's docstring. A plain tensor's gradient counts as
    replicated on every rank, as DDP's. Every rank of the default process group must call it, whatever it
    holds: it issues one all-reduce (sum) of a ``[world, 2]`` float64 tensor
    (``perparam.comm.collectives.all_reduce_sum``) where row ``r`` carries rank ``r``'s contribution and zeros
    elsewhere (adding zeros is exact), then every rank reduces the same rows in the same order, so the norm
    is bitwise equal on every rank; one value is read back to the host (whether some rank refused, so every
    rank raises alike), the norm stays on the device. Every gradient is then scaled by ``min(max_norm / (norm
    + 1e-6), 1)`` (``torch.nn.utils.clip_grads_with_norm_``), in place on the local shards.
    ``error_if_nonfinite`` and ``foreach`` mean what they mean to torch.

    Raises ``TypeError`` for a ``norm_type`` or ``max_norm`` that is not a number (a str such as ``"1"``, a
    bool); ``ValueError`` for a negative or NaN ``max_norm`` (``check_max_norm``), unless ``norm_type > 0``
    (``inf`` included) or when an axis name is in both collections; ``ValueError`` on every rank when a rank
    holds a gradient the rule cannot count (a ``Partial`` placement, a mesh cut along an axis in neither
    collection); ``RuntimeError`` for a non-finite norm with ``error_if_nonfinite=True``.
    """
    for name, value in (("norm_type", norm_type), ("max_norm", max_norm)):
        # a str would be read as a number by float() ("1", "inf"), a bool as 0 or 1: a typo, refused
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
            raise TypeError(f"clip_grad_norm_: {name} must be a number (e.g. 2.0, 1 or float('inf')), got "
                            f"{value!r} ({type(value).__name__})")
    norm_type = float(norm_type)
    check_max_norm(max_norm)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type} must be > 0 (2.0, 1.0, any p, or "
                         "float('inf'))")
    if set(distinct_axes) & set(replicated_axes):
        raise ValueError(f"clip_grad_norm_: axes {sorted(set(distinct_axes) & set(replicated_axes))} are in "
                         "both distinct_axes and replicated_axes; an axis is one or the other")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    shards: list[tuple[torch.Tensor, int]] = []
    refused: list[str] = []
    per_mesh: dict[int, int] = {}  # id(mesh) -> outside copies (meshes compare by value, roots may differ)
    held_for_owner = []
    for i, p in enumerate(parameters):
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor):
            shards.append((g, world))
            continue
        try:
            mesh = g.device_mesh
            if id(mesh) not in per_mesh:
                per_mesh[id(mesh)] = _mesh_copies(mesh, distinct_axes, replicated_axes)
            sp = GROUPS.sharded_param(p)
            # reduced to its owner: the owner's whole gradient counts
            held = None if sp is None else owner_grads.clip_view(sp, g)
            if held is not None:
                held_for_owner.append((sp, g))
            shards.append((g.to_local() if held is None else held,
                           copies(mesh.shape, g.placements) * per_mesh[id(mesh)]))
        except ValueError as e:
            refused.append(f"the gradient of parameter #{i} (shape {tuple(g.shape)}, placements "
                           f"{tuple(g.placements)}, mesh axes {g.device_mesh.mesh_dim_names}): {e}")
    kind = default_device_type() if initialized else "cpu"  # where the world's all-reduce runs
    device = (torch.device(kind, torch.get_device_module(kind).current_device()) if kind != "cpu"
              else torch.device("cpu"))
    rows = torch.zeros(world, 2, dtype=torch.float64, device=device)
    me = dist.get_rank() if initialized else 0
    rows[me, 0] = local_contribution(shards, norm_type, foreach, device)
    rows[me, 1] = len(refused)
    if initialized:
        collectives.all_reduce_sum(rows, dist.group.WORLD, what="clip_grad_norm_")
    if bool(rows[:, 1].any()):
        ranks = [r for r in range(world) if rows[r, 1]]
        raise ValueError("clip_grad_norm_: " + ("; ".join(refused) if refused else
                                                f"rank(s) {ranks} hold a gradient it cannot count (their "
                                                "error names it and the fix)"))
    total = combine(rows[:, 0], norm_type).to(torch.float32)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the "
                           "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    clip_grads_with_norm_([_GradHolder(t) for t, _ in shards], max_norm, total, foreach)
    for sp, g in held_for_owner:  # a whole gradient held for its owner: its rows' record follows the scaling
        owner_grads.refresh(sp, g)
    return total


class _GradHolder:
    """``clip_grads_with_norm_`` reads ``.grad`` off what it is given: here a local shard."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad
