"""One ``fully_shard`` call's parameters: one all-gather per unshard whatever the mix of dtypes,
quantizations and placements; one reduce-scatter per distinct reduce dtype.

The group owns the collectives; ``hooks.py`` decides when they run. States: the padded unsharded storage
is *alive* or *freed*; the module has the *sharded* DTensors or the *unsharded* tensors registered.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import buffers, collectives
from .layout import GroupLayout, ceil_div, reduce_scatter_offsets
from .param import ShardedParam


class ParamGroup:
    """The parameters of one ``fully_shard`` call over a 1D mesh (shard) or 2D mesh (replicate, shard).

    ``modules``: the module(s) given to the call. ``params``: their managed parameters in registration
    order. The all-gather runs over the shard axis; on a 2D mesh gradients are reduce-scattered over the
    shard axis and then all-reduced over the replicate axis (HSDP). Replicated parameters are never
    gathered; their gradients are all-reduced over every data-parallel rank.
    """

    def __init__(self, modules: list[nn.Module], params: list[ShardedParam], mesh: DeviceMesh,
                 reshard_after_forward: bool, mp_policy) -> None:
        self.modules = modules
        self.params = params
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.num_shards = mesh.size(mesh.ndim - 1)
        self.num_replicas = mesh.size(0) if mesh.ndim == 2 else 1
        self.gathered = [p for p in params if p.dim is not None]
        self.replicated = [p for p in params if p.dim is None]
        self.layout = GroupLayout(tuple(p.pieces for p in self.gathered), self.num_shards)
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.registered_unsharded = False
        self._alive = False  # the unsharded storage holds the gathered parameters
        self._pending_gather = None  # (work, send, recv) of an all-gather in flight
        # per-forward/backward bookkeeping, driven by hooks.py
        self.forward_depth = 0
        self.tree: list[ParamGroup] | None = None  # set on a group when it first acts as root
        self.root: ParamGroup | None = None
        self.in_backward = False
        self.post_backward_done = False
        self.grads_arrived: set[int] = set()
        self.num_trainable = 0
        self.frozen_calls = 0  # forwards (with grad) of a group without trainable parameters ...
        self.frozen_backwards = 0  # ... and how many of their backwards have finished
        self.callback_queued = False
        self.forward_order: list[ParamGroup] = []  # on a root: groups in the order this forward ran them
        self.prefetch_order: dict[ParamGroup, int] = {}  # on a root: the last forward's order
        self.prefetch_list: list[ParamGroup] = []

    # The process groups are looked up in the mesh each time, never stored: a ProcessGroup kept alive past
    # destroy_process_group() (the module tree holds groups until interpreter exit) was seen to abort the
    # process at exit ("terminate called without an active exception").
    @property
    def shard_pg(self):
        return self.mesh.get_group(self.mesh.ndim - 1)

    @property
    def replicate_pg(self):
        return self.mesh.get_group(0) if self.mesh.ndim == 2 else None

    def manages(self, tensor: torch.Tensor) -> bool:
        return any(tensor is p.sharded for p in self.params)

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"ParamGroup({names}: {len(self.params)} params)"

    # -- unshard / reshard ------------------------------------------------------------------------------
    @property
    def storage_alive(self) -> bool:
        """The unsharded storage is filled (or being filled by an all-gather in flight)."""
        return self._alive or self._pending_gather is not None

    def trainable(self) -> list[ShardedParam]:
        return [p for p in self.params if p.sharded.requires_grad]

    @torch.no_grad()
    def unshard(self) -> None:
        """All-gather every sharded parameter of the group in one collective into its padded unsharded
        buffer (and copy replicated ones); waits for it. No-op when the storage is already alive.

        Bytes gathered: ``layout.all_gather_bytes`` (recorded by ``CommCounter``).
        """
        self.start_unshard()
        self.wait_unshard()

    @torch.no_grad()
    def start_unshard(self) -> None:
        """Issue the group's all-gather without waiting for it (a prefetch); ``wait_unshard`` finishes it."""
        if not self.params or self.storage_alive:
            return
        for p in self.replicated:
            p.fill_replicated()
        if not self.gathered:
            self._alive = True
            return
        layout = self.layout
        device = self.gathered[0].local_shard().device
        send = buffers.take(layout.slot_bytes, device)
        dsts, srcs = [], []
        for p, offsets in zip(self.gathered, layout.offsets):
            if p.plain:
                src = p.wire_source()
                if src.numel():
                    dsts.append(send.narrow(0, offsets[0], src.numel() * p.pieces[0].dtype.itemsize)
                                .view(p.pieces[0].dtype))
                    srcs.append(src)
            else:
                p.pack([send.narrow(0, off, piece.nbytes) for off, piece in zip(offsets, p.pieces)])
        if dsts:
            torch._foreach_copy_(dsts, srcs)  # casts to the compute dtype on the way
        recv = buffers.take(self.num_shards * layout.slot_bytes, device)
        work = collectives.all_gather(recv, send, self.shard_pg, async_op=True)
        self._pending_gather = (work, send, recv)

    @torch.no_grad()
    def wait_unshard(self) -> None:
        """Wait for the all-gather in flight and copy its rank-major buffer out: straight into the padded
        buffers of plain parameters, through scratch pieces (dequantized) for quantized ones."""
        if self._pending_gather is None:
            return
        work, send, recv = self._pending_gather
        self._pending_gather = None
        if work is not None:
            work.wait()
        buffers.give_back(send)
        layout, k = self.layout, self.num_shards
        targets: list[list[torch.Tensor]] = []
        for p in self.gathered:
            if p.plain:
                targets.append([p.alloc()])
            else:
                targets.append([recv.new_empty(k, piece.nbytes) for piece in p.pieces])
        order = layout.order
        torch.split_with_sizes_copy(recv.view(k, layout.slot_bytes),
                                    [layout.pieces[i][j].nbytes for i, j in order], dim=1,
                                    out=[targets[i][j] for i, j in order])
        for p, pieces in zip(self.gathered, targets):
            if not p.plain:
                p.unpack(pieces)
        buffers.give_back(recv)
        self._alive = True

    def free(self) -> None:
        """Release the unsharded storage (no communication; an all-gather in flight is finished first)."""
        if self._pending_gather is not None:
            self.wait_unshard()
        for p in self.params:
            p.free()
        self._alive = False

    def register_unsharded(self) -> None:
        for p in self.params:
            p.register_unsharded()
        self.registered_unsharded = True

    def register_sharded(self) -> None:
        for p in self.params:
            p.register_sharded()
        self.registered_unsharded = False

    def reshard(self) -> None:
        self.register_sharded()
        self.free()

    # -- gradients --------------------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_grads(self, sync: bool = True, defer: bool = False) -> list[PendingReduce]:
        """Reduce the unsharded gradients into the sharded ``.grad``s, averaged over all data-parallel
        ranks and accumulated into existing sharded gradients.

        Sharded parameters: one reduce-scatter per distinct reduce dtype (then, on HSDP, one all-reduce
        of its output over the replicate axis). Replicated parameters: one all-reduce per reduce dtype
        over each mesh axis. ``sync=False`` only moves the gradients into the reduce-dtype accumulators
        (gradient accumulation without communication). ``defer=True`` returns the reduce-scatters still
        in flight, for ``finish_reduce`` (so backward compute continues meanwhile); otherwise they are
        finished before returning.
        """
        sharded: dict[torch.dtype, list] = defaultdict(list)
        replicated: dict[torch.dtype, list] = defaultdict(list)
        for p in self.params:
            grad = p.take_unsharded_grad(keep=not sync)
            if grad is not None:
                (sharded if p.dim is not None else replicated)[grad.dtype].append((p, grad))
        pending = []
        for items in sharded.values():
            params, grads = zip(*items)
            send = pack_reduce_scatter_input(list(grads), self.num_shards)  # [K, sum(padded_local_numel)]
            offsets, total = reduce_scatter_offsets([p.layout for p in params])
            recv = send.new_empty(total)
            work = collectives.reduce_scatter_sum(recv, send.view(-1), self.shard_pg, async_op=True)
            pending.append(PendingReduce(work, send, recv, params, offsets))
        world = self.num_shards * self.num_replicas
        for items in replicated.values():
            params, grads = zip(*items)
            flat = torch.cat([g.reshape(-1) for g in grads])
            collectives.all_reduce_sum(flat, self.shard_pg)
            if self.replicate_pg is not None:
                collectives.all_reduce_sum(flat, self.replicate_pg)
            flat.div_(world)
            for p, piece in zip(params, flat.split([g.numel() for g in grads])):
                p.accumulate_sharded_grad(piece.view(p.layout.global_shape))  # (tp-local shape under TP)
        if not defer:
            for item in pending:
                self.finish_reduce(item)
            return []
        return pending

    @torch.no_grad()
    def finish_reduce(self, item: PendingReduce) -> None:
        """Wait for a reduce-scatter, all-reduce it over the replicate axis (HSDP), average, and
        accumulate each parameter's piece into its sharded ``.grad``."""
        if item.work is not None:
            item.work.wait()
        buffers.give_back(item.send)
        recv = item.recv
        if self.replicate_pg is not None:
            collectives.all_reduce_sum(recv, self.replicate_pg)
        recv.div_(self.num_shards * self.num_replicas)
        for p, offset in zip(item.params, item.offsets):
            rows = p.layout.extent(p.shard_rank)[1]
            local = recv.narrow(0, offset, p.layout.padded_local_numel).view(p.layout.wire_shape)
            p.accumulate_sharded_grad(local.narrow(0, 0, rows))


@dataclass
class PendingReduce:
    """A reduce-scatter in flight: its work handle, buffers (kept alive until it finishes) and params."""

    work: object
    send: torch.Tensor
    recv: torch.Tensor
    params: tuple[ShardedParam, ...]
    offsets: tuple[int, ...]


def pack_reduce_scatter_input(grads: list[torch.Tensor], num_shards: int) -> torch.Tensor:
    """``[K, sum(padded_local_numel)]``: row r holds every gradient's rank-r ``torch.chunk`` piece,
    padded to the chunk size, in order (``torch._chunk_cat``; empty gradients contribute nothing).
    The buffer comes from ``buffers.take``: give it back once the reduce-scatter has finished."""
    nonempty = [g for g in grads if g.numel()]
    if not nonempty:
        return grads[0].new_empty(num_shards, 0)
    cols = sum(ceil_div(g.shape[0], num_shards) * (g.numel() // g.shape[0]) for g in nonempty)
    dtype = nonempty[0].dtype
    out = buffers.take(num_shards * cols * dtype.itemsize, nonempty[0].device).view(dtype).view(num_shards, cols)
    return torch._chunk_cat(nonempty, dim=0, num_chunks=num_shards, out=out)
