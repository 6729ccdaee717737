"""Composition with tensor parallelism: a parameter that is already a DTensor on a tp mesh.

A user applies torch's ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, ...) on a tp mesh,
then ``fully_shard(module, mesh=dp_mesh)``. Each rank's tp-local tensor is then sharded further over the
data-parallel axis, and the parameter becomes a DTensor on the combined ``(dp..., tp...)`` mesh. When the
dp axis shards the same tensor dim the tp axis already split, the dp placement is a ``_StridedShard``
(the tp split happened first), so ``full_tensor()`` and distributed checkpoints stay exact; FSDP2 uses the
same placement for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..sharding.placement import chunk_extent, rule


class CompositionError(ValueError):
    """A tensor-parallel parameter that cannot be composed with the data-parallel mesh."""


@dataclass(frozen=True)
class TensorParallel:
    """How a tp DTensor parameter composes with the dp mesh.

    ``tp_mesh``/``tp_placements``: the parameter's own mesh and placements (what the module computes
    with). ``mesh``: the combined (dp..., tp...) mesh of the sharded parameter. ``dp_placement``: the
    placement of the dp shard axis on the combined mesh.
    """

    tp_mesh: DeviceMesh
    tp_placements: tuple[Placement, ...]
    mesh: DeviceMesh
    dp_placement: Placement


def compose(name: str, param: DTensor, dp_mesh: DeviceMesh, dp_placement: Placement) -> TensorParallel:
    """Check that ``param`` (a DTensor on a tp mesh) can be sharded further over ``dp_mesh``.

    ``dp_placement``: the parameter's concrete dp placement (``perparam.sharding.placement.rule`` says what it
    becomes on the combined mesh). Raises ``CompositionError`` when the meshes have no axis names, are not sub-meshes of one mesh, share
    an axis, or when a tp-sharded dim does not divide evenly over its axis.
    """
    tp_mesh = param.device_mesh
    tp_placements = tuple(param.placements)
    shared = set(dp_mesh.mesh_dim_names or ()) & set(tp_mesh.mesh_dim_names or ())
    if tp_mesh == dp_mesh or shared:
        where = f"its axes {tuple(sorted(shared))}" if shared else "the same mesh"
        raise CompositionError(
            f"parameter '{name}' is already a DTensor on the data-parallel mesh fully_shard shards it over ({where}, "
            f"placements {tp_placements}; e.g. made by distribute_tensor, an earlier FSDP2 or a sharded checkpoint "
            "load), not on a tensor-parallel mesh. fully_shard takes plain tensors, or DTensors of a tp mesh disjoint "
            "from the dp mesh: before fully_shard, register the full tensor instead (on its module, "
            f"{name.rsplit('.', 1)[-1]} = nn.Parameter(p.full_tensor())), or pass a dp mesh without these axes")
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise CompositionError(f"parameter '{name}' is a DTensor on a tp mesh; to compose, both the dp mesh and "
                               "the tp mesh need axis names: build one named mesh (mesh.ParallelDims) and pass "
                               "its sub-meshes")
    root = dp_mesh._get_root_mesh()
    # by value, not identity: torch may hand the parameter an equal tp slice of an earlier-built mesh
    tp_names = tuple(tp_mesh.mesh_dim_names)
    same = (root.mesh_dim_names is not None and set(tp_names) <= set(root.mesh_dim_names)
            and root[tp_names] == tp_mesh)
    if not same:
        raise CompositionError(f"parameter '{name}' lives on tp mesh {tp_names}, which is not a sub-mesh of the "
                               f"same mesh as the dp mesh {dp_mesh.mesh_dim_names}: slice both from one "
                               "DeviceMesh (e.g. mesh['dp_shard'] and mesh['tp'])")
    names = (*dp_mesh.mesh_dim_names, *tp_mesh.mesh_dim_names)
    order = [root.mesh_dim_names.index(n) for n in names]
    if order != sorted(order):
        raise CompositionError(f"the dp axes {dp_mesh.mesh_dim_names} must come before the tp axes "
                               f"{tp_mesh.mesh_dim_names} in the mesh {root.mesh_dim_names}")
    for axis, placement in enumerate(tp_placements):
        if isinstance(placement, Shard):
            size, parts = param.shape[placement.dim], tp_mesh.size(axis)
            if size % parts:
                local = [chunk_extent(size, parts, i)[1] for i in range(parts)]
                raise CompositionError(
                    f"parameter '{name}' dim {placement.dim} has size {size}, which does not divide over the tp axis "
                    f"of size {parts}: DTensor (and FSDP2) shard it unevenly ({', '.join(map(str, local))} per tp "
                    "rank), but perparam lays out the dp shards, the all-gather slots and the _StridedShard placement "
                    "once for all tp ranks of the combined mesh, from one tp-local shape, so uneven tp shards are "
                    f"refused rather than laid out wrong. Pad the layer to a multiple of {parts} (e.g. "
                    f"{-(-size // parts) * parts}), or leave '{name}' out of the tensor-parallel plan (replicated on tp)")
        elif not isinstance(placement, Replicate):
            raise CompositionError(f"parameter '{name}' has tp placement {placement}; only Shard and Replicate "
                                   "can be composed with data parallelism")
    tp_sizes = [tp_mesh.size(a) for a in range(len(tp_placements))]
    return TensorParallel(tp_mesh, tp_placements, root[names], rule(dp_placement).under_tp(tp_placements, tp_sizes))
