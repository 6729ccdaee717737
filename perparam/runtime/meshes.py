"""Per-parameter meshes (``ParamPolicy.mesh``): one ``fully_shard`` call's parameters split by the mesh
they are sharded on, in an order every rank shares.

A call's group (``perparam.runtime.group.ParamGroup``) has one part per mesh
(``perparam.runtime.part.MeshPart``), which it drives from each of its entry points (unshard, free, reduce,
...) in this order: the call's mesh first, then the other meshes in the order their first parameter
appears in registration order. The order is the same on every rank even where the meshes differ between
ranks (rank 0's expert mesh holds rank 0, rank 1's holds rank 1): position i names "the i-th mesh" on
every rank, and every rank issues its collectives part by part in that order.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from .param import ShardedParam


def split_by_mesh(params: list[ShardedParam], mesh: DeviceMesh
                  ) -> tuple[list[ShardedParam], list[tuple[DeviceMesh, list[ShardedParam]]]]:
    """``params`` (registration order) as (those on ``mesh``, [(other mesh, its parameters)] in order of
    first appearance). A parameter's mesh is its data-parallel mesh (``ShardedParam.dp_mesh``); meshes
    that compare equal are one."""
    own: list[ShardedParam] = []
    others: list[tuple[DeviceMesh, list[ShardedParam]]] = []
    for p in params:
        if p.dp_mesh is mesh or p.dp_mesh == mesh:
            own.append(p)
            continue
        for other, members in others:
            if p.dp_mesh is other or p.dp_mesh == other:
                members.append(p)
                break
        else:
            others.append((p.dp_mesh, [p]))
    return own, others
