"""Composition with tensor parallelism: a parameter that is already a DTensor on a tp mesh.

A user applies torch's ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, ...) on a tp mesh,
then ``fully_shard(module, mesh=dp_mesh)``. Each rank's tp-local tensor is then sharded further over the
data-parallel axis, and the parameter becomes a DTensor on the combined ``(dp..., tp...)`` mesh. When the
dp axis shards the same tensor dim the tp axis already split, the dp placement is a ``_StridedShard``
(the tp split happened first), so ``full_tensor()`` and distributed checkpoints stay exact; FSDP2 uses the
same placement for the same reason.

A tp-sharded dim need not divide over its tp axis: DTensor splits it as ``torch.chunk`` does (9 rows over
tp = 2: five and four), and so does FSDP2. Every rank of one data-parallel group shares one tp coordinate,
so each rank lays its dp shards out from its own tp-local tensor (``perparam.runtime.param``) and the
ranks of one dp group agree on every collective's sizes; the ``_StridedShard`` placement names the split
for every coordinate at once, and DTensor's own shape arithmetic finds each rank's rows from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..sharding.placement import rule


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
    becomes on the combined mesh). Raises ``CompositionError`` when the meshes have no axis names, are not
    sub-meshes of one mesh, share an axis, or for a tp placement other than ``Shard`` and ``Replicate``.
    """
    tp_mesh = param.device_mesh
    tp_placements = tuple(param.placements)
    shared = set(dp_mesh.mesh_dim_names or ()) & set(tp_mesh.mesh_dim_names or ())
    if tp_mesh == dp_mesh or shared:
        where = f"its axes {tuple(sorted(shared))}" if shared else "the same mesh"
        raise CompositionError(
            f"parameter '{name}' is already a DTensor on the data-parallel mesh fully_shard shards it over "
            f"({where}, placements {tp_placements}; e.g. made by distribute_tensor, an earlier FSDP2 or a "
            "sharded checkpoint load), not on a tensor-parallel mesh. fully_shard takes plain tensors, or "
            "DTensors of a tp mesh disjoint from the dp mesh: before fully_shard, register the full tensor "
            f"instead (on its module, {name.rsplit('.', 1)[-1]} = nn.Parameter(p.full_tensor())), or pass a "
            "dp mesh without these axes")
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise CompositionError(f"parameter '{name}' is a DTensor on a tp mesh; to compose, both the dp mesh "
                               "and the tp mesh need axis names: build one named mesh (mesh.ParallelDims) "
                               "and pass its sub-meshes")
    root = dp_mesh._get_root_mesh()
    # by value, not identity: torch may hand the parameter an equal tp slice of an earlier-built mesh
    tp_names = tuple(tp_mesh.mesh_dim_names)
    same = (root.mesh_dim_names is not None and set(tp_names) <= set(root.mesh_dim_names)
            and root[tp_names] == tp_mesh)
    if not same:
        raise CompositionError(f"parameter '{name}' lives on tp mesh {tp_names}, which is not a sub-mesh of "
                               f"the same mesh as the dp mesh {dp_mesh.mesh_dim_names}: slice both from one "
                               "DeviceMesh (e.g. mesh['dp_shard'] and mesh['tp'])")
    names = (*dp_mesh.mesh_dim_names, *tp_mesh.mesh_dim_names)
    order = [root.mesh_dim_names.index(n) for n in names]
    if order != sorted(order):
        raise CompositionError(f"the dp axes {dp_mesh.mesh_dim_names} must come before the tp axes "
                               f"{tp_mesh.mesh_dim_names} in the mesh {root.mesh_dim_names}")
    for placement in tp_placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise CompositionError(f"parameter '{name}' has tp placement {placement}; only Shard and "
                                   "Replicate can be composed with data parallelism")
    tp_sizes = [tp_mesh.size(a) for a in range(len(tp_placements))]
    return TensorParallel(tp_mesh, tp_placements, root[names],
                          rule(dp_placement).under_tp(tp_placements, tp_sizes))
