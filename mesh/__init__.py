"""mesh: a small, explicit description of the parallel layout, and the one named ``DeviceMesh`` built
from it.

The rule for words: *axis* means a mesh axis, *dim* means a tensor dimension.

The world is one mesh of shape ``(dp_replicate, dp_shard, tp)`` with those axis names (size-1 axes are
kept, so every name is always there)::

    dims = mesh.ParallelDims(dp_replicate=2, dp_shard=-1, tp=1)   # validated against the world size now
    meshes = dims.build()                                         # collective: every rank calls it
    perparam.fully_shard(model, mesh=meshes.dp_mesh)              # 1D (shard) or 2D (replicate, shard)

``-1`` (on at most one axis) means "the rest of the world". Bad sizes raise a ``MeshError`` (a
``ValueError``) subclass when the ``ParallelDims`` is constructed, with a message that says what
multiplies to what. Nothing here holds global state.
"""

from .dims import (
    AXIS_NAMES,
    AxisSizeError,
    IndivisibleWorldError,
    MeshError,
    Meshes,
    MeshNamesError,
    MultipleInferredAxesError,
    ParallelDims,
    WorldSizeMismatchError,
    check_dp_mesh,
    default_device_type,
)

__all__ = [
    "AXIS_NAMES",
    "AxisSizeError",
    "IndivisibleWorldError",
    "MeshError",
    "MeshNamesError",
    "Meshes",
    "MultipleInferredAxesError",
    "ParallelDims",
    "WorldSizeMismatchError",
    "check_dp_mesh",
    "default_device_type",
]
