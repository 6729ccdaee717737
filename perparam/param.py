"""One managed parameter: its sharded DTensor, its layout, and the unsharded tensor used in compute.

The sharded parameter (an ``nn.Parameter`` wrapping a DTensor) is what the optimizer, ``state_dict`` and
the user see between forwards. The unsharded parameter is a plain ``nn.Parameter`` over one persistent
padded buffer of shape ``padded_global_shape``; "freeing" it resizes that buffer's storage to 0 bytes
and "unsharding" refills the same storage, so tensors autograd saved in forward become valid again when
the backward all-gather has run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from .layout import ShardLayout


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class ShardedParam:
    """A parameter managed by one group.

    ``slots``: every ``(module, attribute name)`` under which the parameter is registered (several for a
    parameter tied inside one group). ``fqn``: its name relative to the module given to ``fully_shard``.
    ``layout``: the pure sharding layout. ``wire_dtype``: the dtype it is all-gathered and computed in.
    """

    def __init__(self, fqn: str, slots: list[tuple[nn.Module, str]], original: nn.Parameter,
                 mesh: DeviceMesh, placements: tuple[Placement, ...], shard_rank: int, num_shards: int,
                 wire_dtype: torch.dtype | None = None) -> None:
        self.fqn = fqn
        self.slots = slots
        self.mesh = mesh
        self.placements = placements
        self.layout = ShardLayout(tuple(original.shape), original.dtype, num_shards, 0)
        self.shard_rank = shard_rank
        self.wire_dtype = wire_dtype or original.dtype
        self.sharded = self._make_sharded(original)
        self._padded: torch.Tensor | None = None  # [K * chunk, *rest], wire dtype
        self._padded_write: torch.Tensor | None = None  # uint8 [K, slot bytes] alias used as copy target
        self.unsharded: nn.Parameter | None = None
        self._grad_hook = None

    # -- construction -----------------------------------------------------------------------------------
    def _make_sharded(self, original: nn.Parameter) -> nn.Parameter:
        start, length = self.layout.extent(self.shard_rank)
        device = torch.device("meta") if original.is_meta else self.mesh_device
        with torch.no_grad():
            if original.is_meta:
                local = torch.empty(self.layout.local_shape(self.shard_rank), dtype=original.dtype, device=device)
            else:
                local = original.detach().to(device).narrow(0, start, length).clone()
        dtensor = DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                     shape=torch.Size(self.layout.global_shape),
                                     stride=contiguous_stride(self.layout.global_shape))
        return nn.Parameter(dtensor, requires_grad=original.requires_grad)

    @property
    def mesh_device(self) -> torch.device:
        if self.mesh.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.mesh.device_type, torch.get_device_module(self.mesh.device_type).current_device())

    # -- views ------------------------------------------------------------------------------------------
    def local_shard(self) -> torch.Tensor:
        """This rank's shard, ``local_shape(rank)``, as stored (re-read every time: ``to_empty`` and
        ``load_state_dict`` may replace it)."""
        return self.sharded.to_local()

    def _ensure_buffers(self) -> None:
        device = self.local_shard().device
        if self._padded is not None and self._padded.device == device:
            return
        with torch.inference_mode(False), torch.no_grad():
            padded = torch.empty(self.layout.padded_global_shape, dtype=self.wire_dtype, device=device)
            self._padded = padded
            # ``.data`` has its own version counter: refilling the buffer must not look like an in-place
            # change of the tensors autograd saved from the unsharded parameter.
            nbytes = self.layout.padded_local_numel * padded.element_size()
            self._padded_write = padded.data.view(torch.uint8).view(self.layout.num_shards, nbytes)
            view = padded.narrow(0, 0, self.layout.global_shape[0])
            self.unsharded = nn.Parameter(view, requires_grad=self.sharded.requires_grad)
        self.free()

    # -- storage ----------------------------------------------------------------------------------------
    @property
    def storage_alive(self) -> bool:
        return self._padded is not None and self._padded.untyped_storage().size() > 0

    def alloc(self) -> torch.Tensor:
        """Give the padded buffer its storage back; returns the uint8 ``[K, bytes]`` copy target."""
        self._ensure_buffers()
        storage = self._padded.untyped_storage()
        nbytes = self._padded.numel() * self._padded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        return self._padded_write

    def free(self) -> None:
        if self._padded is not None:
            self._padded.untyped_storage().resize_(0)

    # -- registration -----------------------------------------------------------------------------------
    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.slots:
            module._parameters[name] = tensor

    def register_unsharded(self) -> None:
        self.unsharded.requires_grad_(self.sharded.requires_grad)
        self.register(self.unsharded)

    def register_sharded(self) -> None:
        self.register(self.sharded)

    def ensure_post_accumulate_hook(self, fn) -> None:
        """Call ``fn(unsharded)`` each time autograd has accumulated the unsharded gradient."""
        if self._grad_hook is None and self.unsharded is not None:
            self._grad_hook = self.unsharded.register_post_accumulate_grad_hook(fn)

    # -- gradients --------------------------------------------------------------------------------------
    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Add this rank's reduced gradient (``local_shape(rank)``) into the sharded ``.grad``."""
        if local_grad.dtype != self.sharded.dtype:
            local_grad = local_grad.to(self.sharded.dtype)
        grad = self.sharded.grad
        if grad is None:
            self.sharded.grad = DTensor.from_local(
                local_grad, self.mesh, self.placements, run_check=False,
                shape=self.sharded.shape, stride=self.sharded.stride())
        else:
            grad.to_local().add_(local_grad)
