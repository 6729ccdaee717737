"""One managed parameter: its sharded DTensor, its layout and policy, and the unsharded tensor used in
compute.

The sharded parameter (an ``nn.Parameter`` wrapping a DTensor) is what the optimizer, ``state_dict`` and
the user see between forwards. The unsharded parameter is a plain ``nn.Parameter`` over one persistent
padded buffer; "freeing" it resizes that buffer's storage to 0 bytes and "unsharding" refills the same
storage, so tensors autograd saved in forward become valid again when the backward all-gather has run.

The padded buffer is laid out as the gathered pieces arrive: ``(K * chunk, *other dims)`` with the shard
dim first; the unsharded parameter is a view of it (``narrow`` then ``movedim`` back for ``Shard(d)``).

Its gradients: the unsharded gradient moved into the reduce dtype and accumulated over micro-batches
without sync, the zeros a rank without a gradient reduces, and the reduced pieces accumulated into the
sharded (or, stage 1, whole) ``.grad``, the division fused where it is exact.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..sharding.errors import ShardingError
from ..sharding.resolution import ParamResolution, shard_layout
from . import registration, shard_view, writes
from .dtensors import dtensor_spec, local_dtensor, rows_digest
from .tp import TensorParallel


def _power_of_two(x: float) -> bool:
    """``x`` is ``2**m`` for an integer ``m`` (dividing by it is exact, barring subnormal results)."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


class ReplacedAfterShardingError(ShardingError, RuntimeError):
    """A managed parameter slot holds an object perparam did not register (assigned after sharding).
    A ``ShardingError`` and a ``RuntimeError`` (the type FSDP2 raises for a model it cannot run as
    changed, e.g. parameters left on the meta device)."""


class ShardedParam:
    """A parameter managed by one group.

    ``slots``: every ``(module, attribute name)`` under which the parameter is registered (several for a
    parameter tied inside one group). ``fqn``: its name relative to the module given to ``fully_shard``.
    ``resolution``: the parameter as ``fully_shard`` resolved it (``perparam.sharding.resolution``, once per
    call): its policy, layout and all-gather pieces are taken from it, never worked out again here. Raises
    ``ValueError`` when its layout was made for another number of shards than ``mesh``'s shard axis.
    """

    def __init__(self, fqn: str, slots: list[tuple[nn.Module, str]], original: nn.Parameter, mesh: DeviceMesh,
                 shard_rank: int, resolution: ParamResolution, tp: TensorParallel | None = None) -> None:
        policy = resolution.policy
        self.fqn = fqn
        self.path = fqn  # its name in the model: from the outermost single module sharded so far (api.py)
        self.slots = slots
        self.dp_mesh = mesh
        self.policy = policy
        self.shard_rank = shard_rank
        self.tp = tp
        self.global_shape = tuple(original.shape)
        inner = tp.dp_placement if tp else policy.placement  # on the combined mesh under TP
        dp_placements = (inner,) if mesh.ndim == 1 else (Replicate(), inner)
        self.mesh = tp.mesh if tp else mesh  # the sharded parameter's mesh: (dp..., tp...) under TP
        self.placements = (*dp_placements, *tp.tp_placements) if tp else dp_placements
        # what the dp axis splits: the whole parameter, or under TP this rank's tp-local tensor
        dp_shape = tuple(original.to_local().shape) if tp else self.global_shape
        q = policy.quant
        self.stored_quantized = q is not None and q.store_quantized
        if (resolution.layout.global_shape != dp_shape
            or resolution.layout.num_shards != mesh.size(mesh.ndim - 1)):
            raise ValueError(f"parameter '{fqn}': its resolution is laid out as "
                             f"{resolution.layout.global_shape} over {resolution.layout.num_shards} shards, "
                             f"not {dp_shape} over {mesh.size(mesh.ndim - 1)}")
        self.layout, self.pieces = resolution.layout, resolution.pieces
        self._scales: DTensor | None = None  # stored-quantized parameters: fp32 [rows, blocks per row]
        self.scales_name = f"{slots[0][1]}_qscale"
        self.sharded = self._make_sharded(original)
        #: writes to the sharded parameter seen on every rank alike (``runtime/writes.py``)
        self._writes = 0
        writes.bind(self)
        #: ``layout.buffer_shape`` in the compute dtype: (K * chunk, *other dims) for Shard(0), the global
        #: shape for Shard(d > 0) and Replicate(); ``_padded_data`` is its ``.data`` (see ``_ensure_buffers``)
        self._padded: torch.Tensor | None = None
        self._padded_data: torch.Tensor | None = None
        # uint8 [buffer_rows, bytes] alias: the Shard(0) copy target
        self._padded_write: torch.Tensor | None = None
        self._padded_nbytes = 0  # bytes of ``_padded``'s storage when allocated
        # (``_padded_data``, its per-rank regions, own region): ``rank_regions``
        self._regions: tuple | None = None
        self.unsharded: nn.Parameter | None = None
        self.grad_acc: torch.Tensor | None = None  # unsharded gradient kept in the reduce dtype
        #: called with this parameter each time autograd accumulated a gradient into the unsharded parameter
        self.on_grad_ready: Callable[[ShardedParam], None] | None = None
        self._grad_spec: DTensorSpec | None = None
        #: stage 1: the version counter of the sharded ``.grad`` (the rows of the whole gradient) when
        #: perparam last wrote the whole gradient (``accumulate_whole_grad``)
        self._whole_version = -1
        #: stage 1 under ``update="owner"``: ``rows_digest`` of this rank's rows when perparam last wrote the
        #: whole gradient (``runtime.owner_exchange``: the owner steps from its whole gradient while every
        #: rank's match)
        self._whole_digest: torch.Tensor | None = None
        #: ``update="owner"``: its owner's rank on the shard axis once an optimizer planned it
        #: (``owner_step.plan``)
        self.owner_rank: int | None = None
        #: ``update="owner"``: the gradients perparam wrote for it (``owner_grads.OwnerGradRecords``), from
        #: its first reduction to its owner
        self.owner_grads = None
        #: stage 1/2 (``policy.keeps_unsharded``): the unsharded buffer is kept across steps
        self.kept = policy.keeps_unsharded
        #: (optimizer steps, load generation, trainable, writes, DTensor version) when the kept copy was
        #: gathered (``runtime.zero``)
        self.kept_key: tuple | None = None
        #: steps taken by the ``torch.optim`` optimizers holding this parameter (``perparam.runtime.optim``):
        #: storage gathered before one is stale (``ParamGroup.stale``)
        self.optimizer_steps = 0
        #: the offload tier's record of this parameter (``perparam.offload.tier.ParamOffload``: its disk or
        #: host slots), set by ``offload.tier.attach`` at ``fully_shard``; ``None``: not offloaded
        self.offload = None
        #: (weak reference, version) of each live tensor ``state_dict()`` handed out for the shard (they share
        #: its storage), whether one died since the baseline, and (weak reference, version) of the local shard
        #: when the unsharded storage was last gathered (``runtime.zero.check_unwritten``)
        self.aliases: list = []
        self.aliases_lost = False
        self.write_sig: tuple | None = None
        #: stage 1/2 at P (``runtime/shard_view.py``): the local shard as a view of the kept copy's own rows,
        #: the buffer it views, and the ``.data`` alias the ``state_dict()`` values are views of
        self._view: torch.Tensor | None = None
        self._view_of: torch.Tensor | None = None
        self._lend: torch.Tensor | None = None
        self._no_view = None  # the policy ``shard_view.applies`` last said no for

    @property
    def writes(self) -> int:
        """The writes to the sharded parameter seen so far (``runtime/writes.py``), the same count on every
        rank. A sharded object no longer tracked for this parameter (swapped in by ``to_empty``, a
        ``copy.deepcopy`` of the model) is tracked again and counts as written."""
        if not writes.bound(self):
            writes.bind(self)
            self._writes += 1
        return self._writes

    @property
    def plain(self) -> bool:
        """Sent as one piece in the compute dtype (no quantization, not replicated)."""
        return self.layout.gathered and self.policy.quant is None

    # -- construction -----------------------------------------------------------------------------------
    def _dp_piece(self, local_full: torch.Tensor) -> torch.Tensor:
        """This rank's piece on the dp shard axis of ``local_full`` (the whole parameter, or under TP this
        rank's tp-local tensor), as a new tensor on the mesh device."""
        return self.layout.local_piece(local_full, self.shard_rank).to(self.mesh_device, copy=True)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local shard of ``full``, a plain tensor of the parameter's global shape (as
        ``full_tensor()`` gives it), without communication: under TP the tp-local part first, then the
        rows this rank holds on the dp shard axis. The dtype is ``full``'s."""
        if self.tp:
            full = distribute_tensor(full.to(self.mesh_device), self.tp.tp_mesh, self.tp.tp_placements,
                                     src_data_rank=None).to_local()
        return self._dp_piece(full)

    def _make_sharded(self, original: nn.Parameter) -> nn.Parameter:
        meta = original.is_meta
        device = torch.device("meta") if meta else self.mesh_device
        with torch.no_grad():
            if meta:
                local = torch.empty(self.layout.local_shape(self.shard_rank), dtype=self.policy.stored_dtype,
                                    device=device)
            else:
                # a copy of its own in the stored dtype (master weights: upcast once, here)
                local = self._dp_piece((original.to_local() if self.tp
                                        else original).detach()).to(self.policy.stored_dtype)
        shape = self.global_shape
        if self.stored_quantized:  # codes (the parameter) and per-row block scales (a buffer), see quant.py
            q = self.policy.quant
            rows = local.reshape(local.shape[0], math.prod(local.shape[1:]))  # (0 rows on an empty shard)
            if meta:
                n = rows.shape[1]
                codes = torch.empty(rows.shape[0], q.quantizer.codes_per_row(n), dtype=q.dtype, device=device)
                scales = torch.empty(rows.shape[0], -(-n // q.block_size), device=device)
            else:
                codes, scales = q.quantizer.pack(rows, q.block_size)
            shape = q.quantizer.stored_shape(self.global_shape)
            local = codes.view(local.shape[0], *shape[1:])
            self._scales = local_dtensor(scales, self.mesh, self.placements, (shape[0], scales.shape[1]))
        dtensor = local_dtensor(local, self.mesh, self.placements, shape)
        return nn.Parameter(dtensor, requires_grad=self.policy.requires_grad)

    @property
    def scales(self) -> DTensor | None:
        """The fp32 per-row block scales of a stored-quantized parameter, registered as the buffer
        ``<name>_qscale`` beside it (read from the module: ``to_empty`` may replace the object)."""
        if not self.stored_quantized:
            return None
        module = self.slots[0][0]
        return module._buffers.get(self.scales_name, self._scales)

    def register_scales(self) -> None:
        for module, name in self.slots:
            module.register_buffer(f"{name}_qscale", self._scales)

    @property
    def mesh_device(self) -> torch.device:
        kind = self.dp_mesh.device_type
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(kind, torch.get_device_module(kind).current_device())

    # -- views ------------------------------------------------------------------------------------------
    def local_shard(self) -> torch.Tensor:
        """This rank's shard, ``local_shape(rank)``, as stored (re-read every time: ``to_empty`` and
        ``load_state_dict`` may replace it)."""
        return self.sharded._local_tensor

    def send_pair(self, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(destination, source)``: where the local shard goes in this rank's all-gather piece ``piece``
        (``padded_local_numel`` elements, ``layout.send_view``), and the local shard; ``None`` when empty."""
        src = self.local_shard()
        return (self.layout.send_view(piece, self.shard_rank), src) if src.numel() else None

    def _ensure_buffers(self) -> None:
        device = self.local_shard().device
        if self._padded is not None and self._padded.device == device:
            return
        lay = self.layout
        with torch.inference_mode(False), torch.no_grad():
            padded = torch.empty(lay.buffer_shape, dtype=self.policy.param_dtype, device=device)
            self._padded = padded
            # ``.data`` has its own version counter: refilling the buffer must not look like an in-place
            # change of the tensors autograd saved from the unsharded parameter.
            rows = lay.buffer_rows  # (reshape first: a 0-dim buffer cannot change its element size)
            nbytes = padded.numel() * padded.element_size()
            self._padded_nbytes = nbytes  # what ``alloc`` gives the storage back
            self._padded_data = padded.data
            self._padded_write = padded.data.reshape(-1).view(torch.uint8).view(rows, nbytes // rows)
            self._regions = None
            view = lay.unpad(padded)
            if self.tp:  # the module computes with DTensors on the tp mesh
                view = local_dtensor(view, self.tp.tp_mesh, self.tp.tp_placements, self.global_shape)
            self.unsharded = nn.Parameter(view, requires_grad=self.sharded.requires_grad)
            registration.bump()  # a new parameter object perparam holds
            if self.on_grad_ready is not None and self.unsharded.is_floating_point():
                # also on a frozen parameter: it may be unfrozen later (the hook only fires on gradients)
                self.unsharded.requires_grad_(True)
                self.unsharded.register_post_accumulate_grad_hook(_grad_ready_hook(weakref.ref(self)))
                self.unsharded.requires_grad_(self.sharded.requires_grad)
        self.free()

    def recast(self) -> bool:
        """Follow a cast of the sharded DTensor to another floating-point dtype (``module.to(dtype)``,
        ``perparam.runtime.recast``): the stored dtype becomes the shard's, a ``param_dtype`` /
        ``reduce_dtype`` the policy did not give (``ResolvedPolicy.given``) and equal to the old stored /
        compute dtype follows it (one the policy gave stays, as FSDP2's: a bf16 model with
        ``param_dtype=torch.bfloat16`` cast to fp32 computes and reduces in bf16), the layout and wire pieces
        are derived again and the unsharded buffers dropped (made again in the new compute dtype at the next
        unshard; a stage-1/2 kept copy is gathered again). Returns whether anything changed."""
        new, pol = self.local_shard().dtype, self.policy
        if new == pol.stored_dtype or self.stored_quantized:
            return False
        param = (new if pol.param_dtype == pol.stored_dtype and "param_dtype" not in pol.given
                 else pol.param_dtype)
        reduce = (param if pol.reduce_dtype == pol.param_dtype and "reduce_dtype" not in pol.given
                  else pol.reduce_dtype)
        self.policy = dataclasses.replace(pol, stored_dtype=new, param_dtype=param, reduce_dtype=reduce)
        self.layout, self.pieces = shard_layout(self.layout.global_shape, self.policy, self.layout.num_shards)
        self.free()
        self._padded = self._padded_data = self._padded_write = self._regions = self.unsharded = None
        self._view = self._view_of = self._lend = None  # (the cast shard has storage of its own)
        self._padded_nbytes = 0
        self._grad_spec = None  # (its tensor meta holds the dtype)
        self.kept_key = None
        registration.bump()  # the unsharded parameter object is gone
        return True

    # -- storage ----------------------------------------------------------------------------------------
    @property
    def storage_alive(self) -> bool:
        return self._padded is not None and self._padded.untyped_storage().size() > 0

    def alloc(self) -> torch.Tensor:
        """Give the padded buffer its storage back; returns the uint8 ``[K, bytes]`` copy target. The buffer
        is made again first when the local shard moved to another device (``_ensure_buffers``)."""
        padded = self._padded
        if padded is None or padded.device != self.sharded._local_tensor.device:
            self._ensure_buffers()
            padded = self._padded
        storage = padded.untyped_storage()
        if storage.size() != self._padded_nbytes:
            storage.resize_(self._padded_nbytes)
        return self._padded_write

    def free(self) -> None:
        """Give the padded buffer's storage back (``resize_(0)``), unless the local shard is a view of it
        (``runtime/shard_view.py``)."""
        if self._padded is not None and not shard_view.linked(self):
            self._padded.untyped_storage().resize_(0)

    def fill_replicated(self) -> None:
        """A replicated parameter is not gathered: copy (and cast) the local tensor into the buffer."""
        self.alloc()
        self._padded.data.copy_(self.local_shard())

    # -- quantized pieces -------------------------------------------------------------------------------
    def pack(self, views: list[torch.Tensor]) -> None:
        """Write this rank's quantized pieces (``self.pieces``: e.g. codes, scales) into ``views`` (uint8
        slices of the send buffer, one per piece), through the parameter's quantizer."""
        q = self.policy.quant
        outs = [v.view(piece.dtype) for v, piece in zip(views, self.pieces)]
        if self.stored_quantized:  # the stored codes and scales; zeros for the padding rows
            pieces = [self.local_shard().reshape(-1), self.scales.to_local().reshape(-1)]
            for out in outs:
                out.view(torch.uint8).zero_()
            for out, piece in zip(outs, pieces):
                out[:piece.numel()].copy_(piece)
            return
        lay, src = self.layout, self.local_shard()
        if (src.dtype == torch.float32 and src.is_contiguous()
            and tuple(src.shape) == tuple(lay.padded_local_shape)
                and src.numel()):  # the shard is its whole piece (send_view): quantized where it is, no copy
            q.quantizer.pack_into(src.view(1, -1), q.block_size, outs, overwrite=False)
            return
        flat = torch.zeros(lay.padded_local_numel, dtype=torch.float32, device=views[0].device)
        pair = self.send_pair(flat)
        if pair is not None:
            pair[0].copy_(pair[1])
        q.quantizer.pack_into(flat.view(1, -1), q.block_size, outs, overwrite=True)

    def unpack(self, gathered: list[torch.Tensor]) -> None:
        """Dequantize the gathered pieces (uint8 ``[K, piece bytes]`` each) into the padded buffer."""
        q = self.policy.quant
        k = self.layout.num_shards
        target = self.alloc().view(self._padded.dtype)  # [K, padded_local_numel] for Shard(0)
        scattered = not self.layout.wire_is_layout  # Shard(d > 0): through a scratch tensor, then scattered
        if scattered:
            target = torch.empty(k, self.layout.padded_local_numel, dtype=self._padded.dtype,
                                 device=target.device)
        rows = k * self.layout.chunk if self.stored_quantized else k  # the quantizer's rows (see quant.py)
        pieces = [g.view(piece.dtype) for g, piece in zip(gathered, self.pieces)]
        q.quantizer.unpack(pieces, q.block_size, out=target.reshape(rows, -1))
        if scattered:
            self.copy_out(target, 0)

    def rank_regions(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Zero-copy all-gather (``paths.gather_zero_copy``): per rank, the contiguous flat region of the
        allocated padded buffer (``alloc()`` first) holding that rank's local shard, ``local_numel(rank)``
        elements in the compute dtype (empty for a rank without rows); and this rank's region viewed as
        ``local_shape(shard_rank)`` (``None`` when empty), where the local shard is copied in. Only for a
        gathered parameter whose pieces are the buffer's rows (``layout.wire_is_layout``, i.e. ``Shard(0)``).
        Views of the padded buffer, built once per buffer (they stay valid across ``free``/``alloc``, which
        resize its storage in place)."""
        data = self._padded_data
        cached = self._regions
        if cached is None or cached[0] is not data:
            lay = self.layout
            with torch.inference_mode(False):  # kept views: never views made in inference mode
                rows = data.view(lay.num_shards, lay.padded_local_numel)
                regions = [rows[r].narrow(0, 0, lay.local_numel(r)) for r in range(lay.num_shards)]
                own = regions[self.shard_rank]
                own = own.view(lay.local_shape(self.shard_rank)) if own.numel() else None
            self._regions = cached = (data, regions, own)
        return cached[1], cached[2]

    def copy_out_pairs(self, rows: torch.Tensor, first: int) -> list:
        """``(destination, source)`` views putting gathered pieces ``rows`` (``[m, padded_local_numel]`` in
        the compute dtype, ranks ``first ..``) into the unsharded buffer (allocated: ``alloc()`` first)."""
        return self.layout.copy_out_pairs(self._padded_data, rows, first)

    def copy_out(self, rows: torch.Tensor, first: int) -> None:
        pairs = self.copy_out_pairs(rows, first)
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])

    # -- registration -----------------------------------------------------------------------------------
    def check_slots(self) -> None:
        """Raise ``ReplacedAfterShardingError`` when a slot holds an object perparam did not put there (a
        parameter assigned after ``fully_shard`` where no registration hook saw it, e.g.
        ``module._parameters[name] = ...`` or ``torch.func.functional_call``) or nothing (``del
        module.weight``)."""
        for module, name in self.slots:
            current = module._parameters.get(name)
            if current is None or (current is not self.sharded and current is not self.unsharded):
                raise ReplacedAfterShardingError(
                    registration.replaced_message(self, module, name, removed=current is None))

    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.slots:
            module._parameters[name] = tensor

    def register_unsharded(self) -> None:
        unsharded, trainable = self.unsharded, self.sharded.requires_grad
        if unsharded.requires_grad is not trainable:
            unsharded.requires_grad_(trainable)
        for module, name in self.slots:
            module._parameters[name] = unsharded

    def register_sharded(self) -> None:
        sharded = self.sharded
        for module, name in self.slots:
            module._parameters[name] = sharded

    # -- gradients --------------------------------------------------------------------------------------
    def take_unsharded_grad(self, keep: bool) -> torch.Tensor | None:
        """Move the unsharded gradient into the reduce dtype, summed with what earlier micro-batches left.

        ``keep``: hold it for the next micro-batch (gradient sync off) and return ``None``; otherwise
        return it (shard dim first, for packing) and hold nothing.
        """
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is not None:
            self.unsharded.grad = None
            # cast first, reduce after: reduce_dtype governs every reduction the gradient goes through,
            # the tp one included (a Partial gradient of a parameter replicated on the tp axis is summed
            # over the tp ranks by the redistribute below)
            if grad.dtype != self.policy.reduce_dtype:
                grad = grad.to(self.policy.reduce_dtype)
            if isinstance(grad, DTensor):  # tp: e.g. Partial -> the parameter's own tp placements
                if tuple(grad.placements) != self.tp.tp_placements:
                    grad = grad.redistribute(self.tp.tp_mesh, self.tp.tp_placements)
                grad = grad.to_local()
        if self.grad_acc is not None:
            grad = self.grad_acc if grad is None else self.grad_acc.add_(grad)
            self.grad_acc = None
        if keep:
            self.grad_acc = grad
            return None
        if grad is None or self.layout.wire_is_layout:  # wire order is the parameter's (to_wire: itself)
            return grad
        return self.layout.to_wire(grad)

    def zero_grad_for_reduce(self) -> torch.Tensor:
        """Zeros in the reduce dtype, shaped like ``take_unsharded_grad``'s result (shard dim first): what a
        rank without a gradient for this parameter contributes to the group's reduction."""
        shape = self.layout.rule.wire_shape(self.layout.global_shape)
        return torch.zeros(shape, dtype=self.policy.reduce_dtype, device=self.local_shard().device)

    def _whole_grad(self) -> torch.Tensor | None:
        """Stage 1: the whole gradient (dp shape, stored dtype) whose rows the sharded ``.grad`` views, or
        ``None`` when ``.grad`` is not such a view (``None``, or replaced by the user)."""
        grad = self.sharded.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else None
        base = local._base if local is not None else None
        if base is None or base.dtype != local.dtype or tuple(base.shape) != self.layout.global_shape:
            return None
        rows = self.layout.local_piece(base, self.shard_rank)
        same = (rows.data_ptr() == local.data_ptr() and rows.shape == local.shape
                and rows.stride() == local.stride())
        return base if same else None

    def accumulate_whole_grad(self, whole: torch.Tensor) -> None:
        """Stage 1: add the all-reduced whole gradient (wire order: shard dim first, e.g. a piece of the
        all-reduce buffer) into the whole gradient kept on this rank, whose rows (this rank's shard, a view)
        are the sharded ``.grad``. Per rank: the dp shape's elements in the stored dtype.

        ``zero_grad(set_to_none=False)`` (the optimizer's or the module's) zeroes ``.grad``, i.e. this rank's
        rows only: when ``.grad`` changed in place since perparam last wrote the whole gradient (the
        DTensor's version counter; under ``update="owner"`` also the rows' digest, since a foreach zeroing
        moves no counter: a local decision, no collective depends on it) and this rank's rows are
        all zero (none, for an empty shard), the whole gradient is zeroed before the sum is added, so every
        row holds this backward's gradient, not earlier steps'. (Not seen: a foreach zeroing on an owner whose
        rows are empty or were zero already.) Rows changed in place to anything else
        (scaled by the user) leave the other rows as perparam wrote them."""
        whole = self.layout.from_wire(whole.view(self.layout.rule.wire_shape(self.layout.global_shape)))
        kept = self._whole_grad()
        if kept is not None:
            grad = self.sharded.grad  # an in-place op on it bumps its own counter (not the local tensor's)
            rows = grad._local_tensor
            if grad._version != self._whole_version:
                if not rows.any():
                    kept.zero_()  # zeroed through .grad: the rows of the other ranks too
                kept.add_(whole)
            elif self._whole_digest is not None:  # update="owner": its whole may be stepped, so a foreach
                # zeroing (``torch._foreach_zero_`` moves no DTensor's counter) is told by the rows' digest,
                # on the device: all zero now and not what perparam wrote
                zero = (rows.count_nonzero() == 0) & (rows_digest(rows) != self._whole_digest)
                kept.add_(whole)
                torch.where(zero, whole if whole.dtype == kept.dtype else whole.to(kept.dtype), kept,
                            out=kept)
            else:
                kept.add_(whole)
            self._whole_version = grad._version
            self._note_whole(kept)
            return
        grad = self.sharded.grad
        if grad is not None:  # a .grad of the user's: add this rank's rows to it
            grad._local_tensor.add_(self.layout.local_piece(whole, self.shard_rank))
            return
        kept = torch.empty(self.layout.global_shape, dtype=self.sharded.dtype, device=whole.device)
        kept.copy_(whole)  # its own storage: ``whole`` may view the reduction's buffer
        if self._grad_spec is None:
            self._grad_spec = dtensor_spec(self.mesh, self.placements, self.global_shape, self.sharded.dtype)
        rows = self.layout.local_piece(kept, self.shard_rank)
        self.sharded.grad = local_dtensor(rows, self.mesh, self.placements, self.global_shape,
                                          self._grad_spec)
        self._whole_version = self.sharded.grad._version
        self._note_whole(kept)

    def _note_whole(self, kept: torch.Tensor) -> None:
        """Under ``update="owner"``: the digest of this rank's rows of the whole gradient just written."""
        if self.policy.update == "owner":
            self._whole_digest = rows_digest(self.layout.local_piece(kept, self.shard_rank))

    def grad_is_own(self, grad) -> bool:
        """``grad`` (the sharded ``.grad``) is one perparam built (``accumulate_sharded_grad`` or
        ``accumulate_whole_grad``, then changed in place or not): a DTensor of this parameter's mesh,
        placements and stored dtype whose local tensor has the local shard's shape. Told by its spec, the
        object perparam gives every gradient of this parameter (a DTensor op's result gets a new one)."""
        return self._grad_spec is not None and getattr(grad, "dtensor_spec", None) is self._grad_spec

    def accumulate_sharded_grad(self, local_grad: torch.Tensor, divisor: float | None = None) -> None:
        """Add this rank's reduced gradient (shard dim first) into the sharded ``.grad``; ``divisor``: divide
        it by that first (``None``: divided already), bit for bit as a division followed by a cast to the
        stored dtype and an addition, in fewer passes: the cast in the division's pass (``out=``), and
        for a power-of-two divisor added to an existing ``.grad`` of the reduce dtype as ``alpha=1/divisor``
        (``x / 2**m == x * 2**-m`` exactly; fused with the addition it equals dividing first unless
        ``x / 2**m`` is subnormal). ``local_grad`` may be overwritten (it is the reduction's buffer)."""
        if not self.layout.wire_is_layout:  # (else from_wire is the tensor itself)
            local_grad = self.layout.from_wire(local_grad, contiguous=True)
        dtype = self.sharded.dtype
        grad = self.sharded.grad
        tier = self.offload
        if grad is not None and tier is not None:
            tier.grad_in()  # an evicted gradient shard read back before adding to it
        if grad is not None and divisor is not None and local_grad.dtype == dtype and _power_of_two(divisor):
            grad._local_tensor.add_(local_grad, alpha=1.0 / divisor)  # one pass: divide and add
            divisor = local_grad = None
        elif divisor is not None:  # one pass: divide and cast
            out = local_grad if local_grad.dtype == dtype else torch.empty_like(local_grad, dtype=dtype)
            local_grad = torch.div(local_grad, divisor, out=out)
        elif local_grad.dtype != dtype:
            local_grad = local_grad.to(dtype)
        if grad is None:
            if self._grad_spec is None:
                self._grad_spec = dtensor_spec(self.mesh, self.placements, self.global_shape,
                                               self.sharded.dtype)
            if tier is not None:
                local_grad = tier.grad_new(local_grad)  # in the gradient shard's file, when it has one
            self.sharded.grad = local_dtensor(local_grad, self.mesh, self.placements, self.global_shape,
                                              self._grad_spec)
        elif local_grad is not None:
            grad._local_tensor.add_(local_grad)
        if tier is not None:
            tier.grad_out()  # written out and dropped until the step's read-ahead


def _grad_ready_hook(ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    """The unsharded parameter's post-accumulate-grad hook: calls the ShardedParam's ``on_grad_ready``.
    It holds the ShardedParam weakly: a closure over it made the cycle ShardedParam -> ``unsharded`` ->
    its hooks -> ShardedParam, which Python's collector does not free (the hooks are held on the tensor's
    C++ side), and the ShardedParam holds its module (``slots``) and group: every sharded model, its
    shards included, stayed resident after ``del`` (``tests/test_freed_after_del.py``)."""
    def hook(_t: torch.Tensor) -> None:
        sp = ref()
        if sp is not None:  # else its model was freed during a backward: nothing left to reduce into
            sp.on_grad_ready(sp)
    return hook
