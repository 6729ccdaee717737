"""The ``mesh`` package: sizes validated at construction with messages that say what multiplies to what
(one process, no process group), and the named world mesh and its sub-meshes built on 4 ranks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import mesh
from mesh import (
    AxisSizeError,
    IndivisibleWorldError,
    MeshError,
    MeshNamesError,
    MultipleInferredAxesError,
    ParallelDims,
    WorldSizeMismatchError,
    check_dp_mesh,
)
from tests.distributed import run_distributed

# -- validation (one process) --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, shape", [
    (dict(world_size=4), (1, 4, 1)),
    (dict(dp_replicate=2, world_size=4), (2, 2, 1)),
    (dict(dp_replicate=2, dp_shard=2, tp=1, world_size=4), (2, 2, 1)),
    (dict(tp=2, world_size=4), (1, 2, 2)),
    (dict(dp_replicate=-1, dp_shard=2, tp=2, world_size=8), (2, 2, 2)),
    (dict(dp_shard=1, tp=-1, world_size=3), (1, 1, 3)),
    (dict(world_size=1), (1, 1, 1)),
])
def test_sizes_resolve(kwargs, shape):
    dims = ParallelDims(**kwargs)
    assert dims.shape == shape
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == shape
    assert dims.world_size == kwargs["world_size"]
    assert dims.dp_size == shape[0] * shape[1]
    assert dims.hsdp == (shape[0] > 1) and dims.tp_enabled == (shape[2] > 1)


def test_positional_sizes_and_repr_shows_resolved_sizes():
    dims = ParallelDims(2, -1, 1, world_size=8)
    assert repr(dims) == "ParallelDims(dp_replicate=2, dp_shard=4, tp=1, world_size=8)"
    assert dims == ParallelDims(2, 4, 1, world_size=8)


def test_mismatch_says_what_multiplies_to_what():
    with pytest.raises(WorldSizeMismatchError) as e:
        ParallelDims(dp_replicate=2, dp_shard=3, tp=1, world_size=4)
    assert str(e.value) == "dp_replicate=2 x dp_shard=3 x tp=1 = 6, but the world has 4 ranks"


def test_indivisible_rest_of_world():
    with pytest.raises(IndivisibleWorldError) as e:
        ParallelDims(dp_replicate=3, tp=1, world_size=4)
    assert str(e.value) == ("dp_shard=-1 takes the rest of the world, but dp_replicate=3 x tp=1 = 3 does not "
                            "divide the world's 4 ranks")


def test_more_than_one_rest_of_world():
    with pytest.raises(MultipleInferredAxesError, match="dp_shard and tp are all -1"):
        ParallelDims(dp_shard=-1, tp=-1, world_size=4)


@pytest.mark.parametrize("axis", ["dp_replicate", "dp_shard", "tp"])
@pytest.mark.parametrize("value", [0, -2, 1.0, "2", True, None])
def test_bad_axis_sizes(axis, value):
    with pytest.raises(AxisSizeError, match=axis):
        ParallelDims(**{axis: value}, world_size=4)


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True])
def test_bad_world_size(world_size):
    with pytest.raises(AxisSizeError, match="world_size"):
        ParallelDims(world_size=world_size)


def test_no_world_size_and_no_process_group():
    with pytest.raises(AxisSizeError, match="init_process_group"):
        ParallelDims(dp_replicate=1)


def test_every_error_is_one_mesh_error_subclass_of_value_error():
    kinds = [AxisSizeError, MultipleInferredAxesError, IndivisibleWorldError, WorldSizeMismatchError,
             MeshNamesError]
    assert all(issubclass(k, MeshError) and issubclass(k, ValueError) for k in kinds)
    assert len(set(kinds)) == len(kinds)


def test_frozen():
    dims = ParallelDims(world_size=2)
    with pytest.raises(AttributeError):
        dims.tp = 2


def test_from_env():
    assert ParallelDims.from_env(environ={"WORLD_SIZE": "8"}).shape == (1, 8, 1)
    env = {"WORLD_SIZE": "8", "PERPARAM_DP_REPLICATE": "2", "PERPARAM_TP": "2"}
    assert ParallelDims.from_env(environ=env).shape == (2, 2, 2)
    assert ParallelDims.from_env(tp=1, environ=env).shape == (2, 4, 1)  # an argument wins
    assert ParallelDims.from_env(dp_replicate=4, tp=1, environ=env).shape == (4, 2, 1)
    env = {"WORLD_SIZE": "4", "PERPARAM_DP_SHARD": "2", "PERPARAM_DP_REPLICATE": "-1", "PERPARAM_TP": ""}
    assert ParallelDims.from_env(environ=env).shape == (2, 2, 1)


def test_from_env_errors():
    with pytest.raises(AxisSizeError, match="WORLD_SIZE is not set"):
        ParallelDims.from_env(environ={})
    with pytest.raises(AxisSizeError, match="PERPARAM_TP='two' is not an int"):
        ParallelDims.from_env(environ={"WORLD_SIZE": "4", "PERPARAM_TP": "two"})
    with pytest.raises(WorldSizeMismatchError, match="= 3, but the world has 4 ranks"):
        ParallelDims.from_env(environ={"WORLD_SIZE": "4", "PERPARAM_DP_REPLICATE": "3",
                                       "PERPARAM_DP_SHARD": "1"})


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("PERPARAM_TP", "3")
    monkeypatch.delenv("PERPARAM_DP_REPLICATE", raising=False)
    monkeypatch.delenv("PERPARAM_DP_SHARD", raising=False)
    assert ParallelDims.from_env().shape == (1, 2, 3)


def _fake_mesh(shape, names=None) -> DeviceMesh:
    """A mesh object with no process group behind it (enough for the name checks)."""
    return DeviceMesh("cpu", torch.arange(torch.Size(shape).numel()).view(shape), mesh_dim_names=names,
                      _init_backend=False, _rank=0)


def test_check_dp_mesh_accepts():
    for m in [_fake_mesh((4,)), _fake_mesh((4,), ("dp_shard",)),
              _fake_mesh((2, 2), ("dp_replicate", "dp_shard")), _fake_mesh((2, 2), ("replicate", "shard")),
              _fake_mesh((2, 2))]:  # unnamed: by position, as FSDP2
        assert check_dp_mesh(m) is m


@pytest.mark.parametrize("shape, names, match", [
    ((2, 2), ("dp_shard", "dp_replicate"), r"is \(replicate, shard\)"),
    ((2, 2), ("dp_shard", "tp"), "'tp' is the tensor-parallel axis"),
    ((2,), ("tp",), "'tp' is the tensor-parallel axis"),
    ((2,), ("dp_replicate",), "is the replicate axis"),
    ((1, 2, 2), ("dp_replicate", "dp_shard", "tp"), "got a 3D mesh"),
])
def test_check_dp_mesh_rejects(shape, names, match):
    with pytest.raises(MeshNamesError, match=match):
        check_dp_mesh(_fake_mesh(shape, names))


def test_check_dp_mesh_rejects_non_mesh():
    with pytest.raises(MeshNamesError, match="got list"):
        check_dp_mesh([0, 1])


def test_module_docstring_states_the_vocabulary():
    assert "axis* means a mesh axis, *dim* means a tensor dimension" in mesh.__doc__
    assert mesh.AXIS_NAMES == ("dp_replicate", "dp_shard", "tp")


# -- building (4 ranks) ---------------------------------------------------------------------------------


def _describe(m: DeviceMesh) -> dict:
    return {"shape": tuple(m.shape), "names": m.mesh_dim_names, "ranks": m.mesh.tolist(),
            "groups": [m.get_group(i).size() for i in range(m.ndim)],
            "coordinate": m.get_coordinate()}


def build_meshes(rank: int, world_size: int, sizes: tuple[int, int, int]) -> dict:
    dims = ParallelDims(*sizes)  # world size from the process group
    assert mesh.default_device_type() == "cpu"  # gloo
    meshes = dims.build()
    assert meshes.world_mesh.device_type == "cpu"
    check_dp_mesh(meshes.dp_mesh)
    # the sub-meshes' process groups really connect the ranks they name
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=meshes.dp_mesh.get_group(meshes.dp_mesh.ndim - 1))
    dp = torch.tensor([float(rank)])
    assert meshes.dp_group is meshes.dp_group  # HSDP's flattened once
    torch.distributed.all_reduce(dp, group=meshes.dp_group)
    return {"world": _describe(meshes.world_mesh), "dp": _describe(meshes.dp_mesh),
            "tp": _describe(meshes.tp_mesh), "dp_rank": meshes.dp_rank, "dp_size": meshes.dp_size,
            "shard_sum": t.item(), "dp_sum": dp.item(), "dims": dims}


@pytest.mark.parametrize("sizes", [(2, 2, 1), (1, 2, 2), (1, -1, 1), (4, 1, 1), (2, 1, 2)])
def test_build_on_four_ranks(sizes):
    results = run_distributed(build_meshes, 4, sizes)
    dims = results[0]["dims"]
    r, s, t = dims.shape
    assert r * s * t == 4 and all(x > 0 for x in dims.shape)
    grid = torch.arange(4).view(r, s, t)
    dp_slices = set()
    for rank, res in enumerate(results):
        assert res["dims"] == dims
        coord = tuple((grid == rank).nonzero()[0].tolist())
        assert res["world"] == {"shape": (r, s, t), "names": ("dp_replicate", "dp_shard", "tp"),
                                "ranks": grid.tolist(), "groups": [r, s, t], "coordinate": coord}
        ci, cj, ck = coord
        if r > 1:
            assert res["dp"] == {"shape": (r, s), "names": ("dp_replicate", "dp_shard"),
                                 "ranks": grid[:, :, ck].tolist(), "groups": [r, s], "coordinate": (ci, cj)}
        else:
            assert res["dp"] == {"shape": (s,), "names": ("dp_shard",), "ranks": grid[ci, :, ck].tolist(),
                                 "groups": [s], "coordinate": (cj,)}
        assert res["tp"] == {"shape": (t,), "names": ("tp",), "ranks": grid[ci, cj, :].tolist(),
                             "groups": [t], "coordinate": (ck,)}
        assert res["dp_size"] == r * s and res["dp_rank"] == ci * s + cj
        assert res["shard_sum"] == float(grid[ci, :, ck].sum())
        assert res["dp_sum"] == float(grid[:, :, ck].sum())  # Meshes.dp_group: every dp rank, no tp peer
        dp_slices.add(res["dp_rank"])
    assert dp_slices == set(range(r * s))


def build_wrong_world(rank: int, world_size: int) -> str:
    dims = ParallelDims(dp_replicate=2, dp_shard=1, tp=1, world_size=2)
    try:
        dims.build()
    except WorldSizeMismatchError as e:
        return str(e)
    return "no error"


def test_build_checks_the_process_group_size():
    for msg in run_distributed(build_wrong_world, 4):
        assert msg == "dp_replicate=2 x dp_shard=1 x tp=1 = 2, but the process group has 4 ranks"
