"""``ParallelDims``: the sizes of the parallel axes, validated against the world size when constructed,
and the one named ``DeviceMesh`` built from them.

Vocabulary: an *axis* is a mesh axis, a *dim* is a tensor dimension.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: The world mesh's axis names, outermost first. ``tp`` is innermost, so a tensor-parallel group is a
#: run of consecutive ranks (on one host, when ranks are numbered host by host).
AXIS_NAMES = ("dp_replicate", "dp_shard", "tp")
#: Environment variables ``ParallelDims.from_env`` reads besides torchrun's ``WORLD_SIZE``.
ENV_DP_REPLICATE, ENV_DP_SHARD, ENV_TP = "PERPARAM_DP_REPLICATE", "PERPARAM_DP_SHARD", "PERPARAM_TP"


class MeshError(ValueError):
    """A parallel layout that cannot be built; the subclass says which rule was broken."""


class AxisSizeError(MeshError):
    """An axis size that is not a positive int (or -1, "the rest of the world"), or a bad world size."""


class MultipleInferredAxesError(MeshError):
    """More than one axis size is -1: the rest of the world can go to one axis only."""


class IndivisibleWorldError(MeshError):
    """An axis is -1 but the product of the other axes does not divide the world size."""


class WorldSizeMismatchError(MeshError):
    """The axis sizes do not multiply to the world size."""


class MeshNamesError(MeshError):
    """A mesh handed to ``fully_shard`` whose axes cannot be told apart, or that are the wrong axes."""


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AxisSizeError(f"{name} must be an int (a positive size, or -1 for the rest of the world), "
                            f"got {value!r} of type {type(value).__name__}")
    if value == -1 or value >= 1:
        return value
    raise AxisSizeError(f"{name}={value} is not a valid axis size: use a positive size, or -1 for the rest "
                        "of the world")


def _product(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{name}={size}" for name, size in sizes.items())


def _world_size_from_process_group() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise AxisSizeError("ParallelDims needs the world size: pass world_size=..., call "
                            "torch.distributed.init_process_group() first, or use ParallelDims.from_env() "
                            "under torchrun")
    return dist.get_world_size()


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three parallel axes; ``-1`` (at most one) means "the rest of the world".

    ``world_size`` defaults to the default process group's size (which then must be initialized).
    Construction validates and resolves the sizes (a ``-1`` is replaced by the size it stands for), so a
    ``ParallelDims`` that exists is consistent with its world size:

    >>> ParallelDims(dp_replicate=2, world_size=8)
    ParallelDims(dp_replicate=2, dp_shard=4, tp=1, world_size=8)

    Raises (all subclasses of ``MeshError``, a ``ValueError``): ``AxisSizeError`` for a size that is not a
    positive int or -1 (or a world size that is not a positive int), ``MultipleInferredAxesError`` for more
    than one -1, ``IndivisibleWorldError`` for a -1 the other axes leave no whole size for,
    ``WorldSizeMismatchError`` for sizes that do not multiply to the world size.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        sizes = {name: _check_size(name, getattr(self, name)) for name in AXIS_NAMES}
        world = self.world_size if self.world_size is not None else _world_size_from_process_group()
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise AxisSizeError(f"world_size must be a positive int, got {world!r}")
        inferred = [name for name, size in sizes.items() if size == -1]
        if len(inferred) > 1:
            raise MultipleInferredAxesError(
                f"{' and '.join(inferred)} are all -1; at most one axis can take the rest of the world: give "
                "the others explicit sizes")
        if inferred:
            (name,) = inferred
            others = {n: s for n, s in sizes.items() if n != name}
            known = math.prod(others.values())
            if world % known:
                raise IndivisibleWorldError(
                    f"{name}=-1 takes the rest of the world, but {_product(others)} = {known} does not "
                    f"divide the world's {world} ranks")
            sizes[name] = world // known
        total = math.prod(sizes.values())
        if total != world:
            raise WorldSizeMismatchError(f"{_product(sizes)} = {total}, but the world has {world} ranks")
        for name, size in sizes.items():
            object.__setattr__(self, name, size)
        object.__setattr__(self, "world_size", world)

    @classmethod
    def from_env(cls, dp_replicate: int | None = None, dp_shard: int | None = None, tp: int | None = None,
                 environ: Mapping[str, str] | None = None) -> ParallelDims:
        """Sizes from torchrun's environment: ``WORLD_SIZE``, and optionally ``PERPARAM_DP_REPLICATE``,
        ``PERPARAM_DP_SHARD`` and ``PERPARAM_TP``. An argument that is not ``None`` wins over its
        variable; an axis given by neither gets the default (``dp_shard=-1``, the others 1). ``environ``
        defaults to ``os.environ``; nothing is read or kept beyond this call.
        """
        env = os.environ if environ is None else environ

        def read(var: str, name: str, arg: int | None, default: int) -> int:
            if arg is not None:
                return arg
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise AxisSizeError(f"{var}={raw!r} is not an int (it sets {name})") from None

        if env.get("WORLD_SIZE", "").strip() == "":
            raise AxisSizeError("WORLD_SIZE is not set: start the program with torchrun, or build "
                                "ParallelDims(..., world_size=N) directly")
        world = read("WORLD_SIZE", "the world size", None, 0)
        return cls(read(ENV_DP_REPLICATE, "dp_replicate", dp_replicate, 1),
                   read(ENV_DP_SHARD, "dp_shard", dp_shard, -1),
                   read(ENV_TP, "tp", tp, 1), world_size=world)

    # -- derived sizes ----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int]:
        """The world mesh's shape, ``(dp_replicate, dp_shard, tp)``."""
        return self.dp_replicate, self.dp_shard, self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (``dp_replicate x dp_shard``): how many slices the global batch is cut in."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        """More than one replica: ``dp_mesh`` is 2D (replicate, shard)."""
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    # -- building ---------------------------------------------------------------------------------------
    def build(self, device_type: str | None = None) -> Meshes:
        """Build the world ``DeviceMesh`` (collective: every rank must call it) and its sub-meshes.

        One mesh of shape ``(dp_replicate, dp_shard, tp)`` named ``AXIS_NAMES``; size-1 axes are kept so
        every name is always there. ``device_type`` defaults to ``"cuda"`` when torch.distributed's
        backend is NCCL, else ``"cpu"`` (with no process group yet: ``"cuda"`` if CUDA is available, else
        ``"cpu"``, and ``init_device_mesh`` starts the process group from the environment).

        Raises ``WorldSizeMismatchError`` when the running process group's size differs from
        ``world_size``.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise WorldSizeMismatchError(
                f"{_product(dict(zip(AXIS_NAMES, self.shape)))} = {self.world_size}, but the process group "
                f"has {dist.get_world_size()} ranks")
        world = init_device_mesh(device_type or default_device_type(), self.shape, mesh_dim_names=AXIS_NAMES)
        return Meshes(self, world)


def default_device_type(group=None) -> str:
    """The device type collectives of the process group ``group`` (default: the default group) run on:
    the first accelerator the group has a device-native backend for (``"cuda"`` for ``"nccl"`` or
    ``"cpu:gloo,cuda:nccl"``), else ``"cpu"`` (``"gloo"``, even where gloo also serves CUDA tensors);
    before ``init_process_group``: ``"cuda"`` when CUDA is available (``init_device_mesh`` will then start
    NCCL), else ``"cpu"``."""
    import torch

    if dist.is_available() and dist.is_initialized():
        try:
            config = dist.get_backend_config(group)
        # a backend without a config (torch's threaded one)
        except (RuntimeError, ValueError, AttributeError):
            config = str(dist.get_backend(group))
        return device_type_of_backends(config)
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type_of_backends(config: str) -> str:
    """``default_device_type``'s rule on a backend config string (``dist.get_backend_config``'s form,
    ``"cpu:gloo,cuda:nccl"``, or one backend name such as ``"nccl"``): the first ``device:backend`` pair
    whose device is not the CPU and whose backend is not gloo; ``"cpu"`` when there is none."""
    known = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}
    for part in config.lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        if not device:
            device = known.get(backend, "cpu")
        if device != "cpu" and backend not in ("gloo", "fake", "threaded", "mpi"):
            return device
    return "cpu"


@dataclass(frozen=True)
class Meshes:
    """The world mesh built by ``ParallelDims.build`` and the sub-meshes to pass on.

    ``world_mesh``: 3D, ``(dp_replicate, dp_shard, tp)``. ``dp_mesh``: what ``fully_shard`` takes, 1D
    ``world_mesh["dp_shard"]`` when ``dp_replicate == 1``, else 2D ``world_mesh["dp_replicate",
    "dp_shard"]`` (HSDP). ``tp_mesh``: 1D ``world_mesh["tp"]`` (size 1 when tensor parallelism is off).
    """

    dims: ParallelDims
    world_mesh: DeviceMesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        if self.dims.hsdp:
            return self.world_mesh["dp_replicate", "dp_shard"]
        return self.world_mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.world_mesh["tp"]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ``dp_size`` data-parallel ranks (which batch slice it reads):
        ``replicate coordinate x dp_shard + shard coordinate``. Ranks of one TP group share it."""
        replicate, shard, _ = self.world_mesh.get_coordinate()
        return replicate * self.dims.dp_shard + shard

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_group(self):
        """The process group of this rank's ``dp_size`` data-parallel ranks (those sharing its tp
        coordinate), for reductions over what they computed. HSDP: the 2D ``dp_mesh`` flattened once
        (a collective the first time: every rank asks for it)."""
        if self.dims.hsdp:
            return self.dp_mesh._flatten("dp").get_group()
        return self.world_mesh["dp_shard"].get_group()


def check_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Check that ``mesh`` can be a data-parallel mesh for ``fully_shard``; returns it unchanged.

    1D: the shard axis. 2D: (replicate, shard) by position, as FSDP2 takes it: an unnamed 2D mesh, or one
    with names other than this package's, is taken as given (outer = replicate, inner = shard). With this
    package's names the axes must be ``("dp_replicate", "dp_shard")`` in that order; a ``"tp"`` axis is
    never data-parallel.

    Raises ``MeshNamesError`` (a ``MeshError``, a ``ValueError``).
    """
    if not isinstance(mesh, DeviceMesh):
        raise MeshNamesError("expected a torch.distributed.device_mesh.DeviceMesh, got "
                             f"{type(mesh).__name__}")
    names = mesh.mesh_dim_names
    shape = tuple(mesh.shape)
    if mesh.ndim > 2:
        raise MeshNamesError("a data-parallel mesh has 1 axis (shard) or 2 (replicate, shard); got a "
                             f"{mesh.ndim}D mesh of shape {shape} (axes {names}): pass the data-parallel "
                             "sub-mesh, e.g. world_mesh['dp_replicate', 'dp_shard']")
    if names is not None and "tp" in names:
        raise MeshNamesError(f"the mesh of shape {shape} has axes {names}: 'tp' is the tensor-parallel axis, "
                             "not a data-parallel one; pass the data-parallel sub-mesh (Meshes.dp_mesh)")
    if mesh.ndim == 2:
        if names is not None and set(names) <= set(AXIS_NAMES) and names != ("dp_replicate", "dp_shard"):
            raise MeshNamesError(f"the 2D mesh of shape {shape} has axes {names}; a data-parallel mesh is "
                                 "(replicate, shard): pass world_mesh['dp_replicate', 'dp_shard']")
    elif names == ("dp_replicate",):
        raise MeshNamesError(f"the 1D mesh of shape {shape} is the replicate axis, but fully_shard shards "
                             "over a 1D mesh: pass world_mesh['dp_shard'], or the 2D "
                             "world_mesh['dp_replicate', 'dp_shard'] for HSDP")
    return mesh
