"""The owner path's two exchanges per bucket at the optimizer step (``perparam.runtime.owner_step``): rows in
to the owners, updated rows back out.

In: one all-to-all per bucket brings each rank's rows of the parameter to its owner, and its rows of the
reduced gradient *unless the owner holds the whole reduced gradient already*:

- a stage-1 parameter (``ParamPolicy(zero_stage=1)``): its gradient is all-reduced whole onto every rank
  (the sharded ``.grad`` views this rank's rows of it). The owner steps from its own whole gradient when
  every rank's rows are still what the reduction wrote. A rank's rows changed in place since (a clip, an
  unscale, a user's edit through ``.grad``) leave the whole gradients of the other ranks stale, and version
  counters do not see every in-place change (a ``torch._foreach_*`` op on a DTensor bumps none), so the
  ranks compare the bits: each rank's rows carry a digest taken when the reduction wrote them
  (``ShardedParam.accumulate_whole_grad``), and one all-reduce of a flag per such parameter per bucket
  (``[n]`` int32, the same on every rank) says whether all K ranks' rows are unchanged; where they are
  not, the rows travel as for any parameter;
- a parameter reduced straight to its owner (``paths.reduce_owner``, ``perparam.configure(owner_grad=
  "owner")``): its whole gradient is on the owner only (``owner_grads``).

Out: each rank's piece of the scatter is led by one element, 1 when its step raised (``owner_step``
raises that on every rank of the axis): ``K (K-1)`` elements per bucket summed over the ranks.

An owner's own rows never pass through either all-to-all: in, they are copied from its shards into the
whole tensors (``assemble``); out, from the stepped whole parameter into its shard (``scatter``, unless
its step raised). Its piece to itself is empty in, the flag alone out. The send and receive buffers come
from the step's ``BufferPool`` (``perparam.comm.buffers``): rows are copied into them, not concatenated.

Bytes on the wire per ``m x n`` matrix, summed over the ranks: ``(K-1)/K m n`` elements of parameter rows
in and ``(K-1)/K m n`` updated rows out, plus ``(K-1)/K m n`` gradient rows in where they travel:
``2 (K-1)/K m n`` or ``3 (K-1)/K m n``. A gradient held on its owner (reduced to it) adds one element
from each other rank, its witness that it saw the ``.grad`` zeroed in place (``owner_grads.witness``: an
owner holding no rows of the matrix cannot see it itself): ``K-1`` elements per such matrix. Every rank issues
the same collectives with the same sizes whatever it owns (empty pieces where it has none).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..comm.buffers import BufferPool
from ..comm.collectives import all_gather_objects, all_reduce_sum, exchange_uneven
from . import owner_grads
from .dtensors import rows_digest
from .owner_grads import OwnerStepError

__all__ = ["OwnerStepError", "Posted", "assemble", "gather", "land", "local_grad", "raised_texts", "remember",
           "scatter", "travels"]


def local_grad(sp) -> torch.Tensor:
    """This rank's rows of ``sp``'s reduced gradient (the sharded ``.grad``'s local tensor)."""
    p = sp.sharded
    grad = p.grad
    if not isinstance(grad, DTensor) or grad.placements != p.placements or grad.dtype != p.dtype:
        raise OwnerStepError(f"parameter '{sp.path}' has update='owner' but its .grad is not a DTensor of "
                             f"its placements and dtype {p.dtype} (got {type(grad).__name__}); leave .grad "
                             "to perparam's reduction, or assign a DTensor like the parameter")
    return grad._local_tensor


def _rows_intact(sp, device) -> torch.Tensor:
    """Stage 1: ``.grad`` still views the whole gradient the reduction wrote, and this rank's rows of it have
    the bits they had then (``ShardedParam._whole_digest``): a 0-dim bool on ``device``, read nothing back."""
    whole = sp._whole_grad()
    if whole is None or sp._whole_digest is None:
        return torch.zeros((), dtype=torch.bool, device=device)
    return rows_digest(sp.layout.local_piece(whole, sp.shard_rank)) == sp._whole_digest


def travels(bucket, entries, held: tuple[bool, ...]) -> tuple[bool, ...]:
    """Per entry of ``entries`` (a bucket's, with gradients), whether its gradient rows travel to the owner:
    not for a gradient reduced to its owner (``held``, per entry, decided once at the step), nor for a
    stage-1 one whose rows are intact on every rank (one all-reduce of ``[n]`` flags over the bucket's shard
    axis when the bucket holds ``n > 0`` stage-1 entries); the same answer on every rank."""
    out = [not h for h in held]
    for e, move in zip(entries, out):
        if not move and owner_grads.reduced_to(e.sp) != e.owner:  # the same on every rank: raised alike
            raise OwnerStepError(f"parameter '{e.sp.path}': its gradient was reduced to rank "
                                 f"{owner_grads.reduced_to(e.sp)} under an earlier optimizer's plan, and "
                                 f"this optimizer's owner of it is rank {e.owner}; step the optimizer the "
                                 "owners were planned for, or zero_grad() and run backward again")
    whole = [i for i, e in enumerate(entries) if out[i] and e.sp.policy.whole_grad]
    if whole:
        device = entries[0].sp.sharded._local_tensor.device
        flags = torch.stack([_rows_intact(entries[i].sp, device) for i in whole]).to(torch.int32)
        all_reduce_sum(flags, bucket.group, what=f"owner stage-1 gradients intact ({len(whole)} params)")
        for i, n in zip(whole, flags.tolist()):
            out[i] = n != bucket.group.size()
    return tuple(out)


def _owner_whole_grad(sp) -> torch.Tensor:
    """On the owner, the whole reduced gradient it holds (reduced to it, or stage 1's kept one)."""
    held = owner_grads.whole(sp)
    return held if held is not None else sp._whole_grad()


class Posted:
    """An all-to-all of the owner path in flight: its work handle (``None`` once waited, or for K = 1) and its
    send and receive buffers (from the step's ``BufferPool``, given back by ``release``)."""

    __slots__ = ("pool", "recv", "send", "work")

    def __init__(self, work, send: torch.Tensor, recv: torch.Tensor, pool: BufferPool | None) -> None:
        self.work, self.send, self.recv, self.pool = work, send, recv, pool

    def wait(self) -> torch.Tensor:
        """Wait for the exchange; returns the receive buffer."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.recv

    def release(self) -> None:
        """Give both buffers back to the pool (the exchange waited, the receive buffer read)."""
        if self.pool is not None:
            self.pool.give_back(self.send)
            if self.recv is not self.send:
                self.pool.give_back(self.recv)
        self.send = self.recv = None


def _take(pool: BufferPool | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if pool is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return pool.take(numel * dtype.itemsize, device).view(dtype)


def gather(bucket, entries, moves: tuple[bool, ...], held: tuple[bool, ...],
           pool: BufferPool | None = None) -> Posted:
    """Post the all-to-all bringing parameter rows (and, where ``moves``, gradient rows) to the owners, with
    the witness of each gradient reduced to its owner (``held``); each rank's rows are copied straight into
    the send buffer (from ``pool`` when given, as the receive buffer)."""
    pg = bucket.group
    k, me = pg.size(), pg.rank()
    dtype = entries[0].sp.sharded.dtype
    device = entries[0].sp.sharded._local_tensor.device
    pieces, send_splits, recv_splits = [], [0] * k, [0] * k
    for dest in range(k):
        for e, move, witnessed in zip(entries, moves, held):
            if e.owner != dest or dest == me:  # this rank's own rows go straight from its shard (assemble)
                continue
            if move:
                pieces.append(local_grad(e.sp))
            pieces.append(e.sp.sharded._local_tensor)
            if witnessed:  # a gradient held on its owner: whether this rank saw it zeroed in place
                pieces.append(owner_grads.witness(e.sp, dtype))
            send_splits[dest] += (2 if move else 1) * e.sp.layout.local_numel(me) + witnessed
    for e, move, witnessed in zip(entries, moves, held):
        if e.owner == me:
            for src in range(k):
                if src != me:
                    recv_splits[src] += (2 if move else 1) * e.sp.layout.local_numel(src) + witnessed
    send = _take(pool, sum(send_splits), dtype, device)
    offset = 0
    for piece in pieces:
        n = piece.numel()
        send[offset:offset + n].view(piece.shape).copy_(piece)
        offset += n
    recv = _take(pool, sum(recv_splits), dtype, device) if k > 1 else None
    logical = (sum((2 if move else 1) * e.sp.sharded.numel() for e, move in zip(entries, moves))
               + k * sum(held)) * dtype.itemsize
    work, recv = exchange_uneven(send, send_splits, recv_splits, pg, logical,
                                 f"owner gather of {len(entries)} params", recv=recv)
    return Posted(work, send, recv, pool)


def assemble(bucket, entries, moves: tuple[bool, ...], held: tuple[bool, ...], recv: torch.Tensor) -> dict:
    """id(sharded parameter) -> (sharded parameter, whole parameter with its whole ``.grad``) for the
    parameters of ``entries`` this rank owns (a held whole gradient is used as it is, not copied)."""
    pg = bucket.group
    k, me = pg.size(), pg.rank()
    mine = [(e, move, h) for e, move, h in zip(entries, moves, held) if e.owner == me]
    out, witnessed = {}, {}
    for e, move, _ in mine:
        p = e.sp.sharded
        whole = torch.empty(p.shape, dtype=p.dtype, device=recv.device)
        whole.grad = torch.empty_like(whole) if move else _owner_whole_grad(e.sp)
        out[id(p)] = (p, whole)
    offset = 0
    for src in range(k):
        for e, move, held in mine:
            lay, whole = e.sp.layout, out[id(e.sp.sharded)][1]
            n, shape = lay.local_numel(src), lay.local_shape(src)
            if src == me:  # this rank's own rows: from its shards, not through the exchange
                if move:
                    lay.local_piece(whole.grad, me).copy_(local_grad(e.sp).reshape(shape))
                lay.local_piece(whole, me).copy_(e.sp.sharded._local_tensor.reshape(shape))
                continue
            for target in ((whole.grad, whole) if move else (whole,)):
                lay.local_piece(target, src).copy_(recv[offset:offset + n].view(shape))
                offset += n
            if held:  # the peer's witness that it saw the held gradient zeroed in place (gather)
                pid, flag = id(e.sp.sharded), recv[offset:offset + 1]
                witnessed[pid] = flag if pid not in witnessed else witnessed[pid] + flag
                offset += 1
    for e, _, held in mine:
        if held and id(e.sp.sharded) in witnessed:
            owner_grads.zero_if_witnessed(e.sp, witnessed[id(e.sp.sharded)])
    return out


def remember(entries, moves: tuple[bool, ...], wholes: dict) -> None:
    """Under ``configure(owner_grad="owner")``, after ``assemble``: for each entry whose gradient rows
    travelled (reduce-scattered, not stage 1's whole gradient nor a qgZ one, which are never reduced to an
    owner), keep the whole gradient the owner assembled for the current ``.grad`` (``owner_grads.remember``),
    so the next reduction to the owner accumulates onto it, or replaces it when zeroed in place. On every
    rank alike."""
    for e, move in zip(entries, moves):
        if move and not e.sp.policy.whole_grad and e.sp.policy.grad_quant is None:
            held = wholes.get(id(e.sp.sharded))
            owner_grads.remember(e.sp, held[1].grad if held is not None else None)


def scatter(bucket, entries, wholes: dict, raised: bool, pool: BufferPool | None = None) -> Posted:
    """Post the all-to-all sending each rank its rows of the updated whole parameters, each piece led by one
    element: 1 when this rank's step raised (``raised``), else 0. The rows are copied into the send buffer
    (from ``pool`` when given), so ``wholes`` may be dropped as soon as this returns."""
    pg = bucket.group
    k, me = pg.size(), pg.rank()
    dtype = entries[0].sp.sharded.dtype
    device = entries[0].sp.sharded._local_tensor.device
    mine = [e for e in entries if e.owner == me]
    send_splits = [1 + (0 if dest == me else sum(e.sp.layout.local_numel(dest) for e in mine))
                   for dest in range(k)]
    recv_splits = [1] * k
    for e in entries:
        if e.owner != me:
            recv_splits[e.owner] += e.sp.layout.local_numel(me)
    send = _take(pool, sum(send_splits), dtype, device)
    offset = 0
    for dest in range(k):
        send[offset] = float(raised)
        offset += 1
        for e in mine if dest != me else ():
            piece = e.sp.layout.local_piece(wholes[id(e.sp.sharded)][1], dest)
            n = piece.numel()
            send[offset:offset + n].view(piece.shape).copy_(piece)
            offset += n
    # this rank's own rows of what it stepped: straight into its shards, not through the exchange
    if not raised:
        for e in mine:
            local = e.sp.sharded._local_tensor
            local.copy_(e.sp.layout.local_piece(wholes[id(e.sp.sharded)][1], me).reshape(local.shape))
    recv = _take(pool, sum(recv_splits), dtype, device) if k > 1 else None
    logical = (sum(e.sp.sharded.numel() for e in entries) + k) * dtype.itemsize
    work, recv = exchange_uneven(send, send_splits, recv_splits, pg, logical,
                                 f"owner scatter of {len(entries)} params", recv=recv)
    return Posted(work, send, recv, pool)


def land(scattered: list) -> list[list[int]]:
    """Finish the scatters ``scattered`` (``(bucket, entries, Posted)`` of ``scatter``, in the order posted):
    wait for each, read every owner's flag at once (the owner path's one host read per step), copy the rows of
    the owners whose step did not raise into the shards (a raising owner's left as before the step), give
    the buffers back. Returns per bucket each owner rank's flag (1 when its step raised, else 0), the same
    on every rank of the axis."""
    recvs = [posted.wait() for _, _, posted in scattered]
    starts = []  # per bucket, the offset of each owner's piece in its receive buffer
    for bucket, entries, _ in scattered:
        me, offset, at = bucket.group.rank(), 0, []
        for owner in range(bucket.group.size()):
            at.append(offset)
            offset += 1 + (0 if owner == me
                           else sum(e.sp.layout.local_numel(me) for e in entries if e.owner == owner))
        starts.append(at)
    heads = [recv[at] for recv, ats in zip(recvs, starts) for at in ats]
    values = iter(torch.stack(heads).tolist() if heads else [])
    flags = [[int(next(values) != 0) for _ in ats] for ats in starts]
    for (bucket, entries, posted), recv, ats, raised in zip(scattered, recvs, starts, flags):
        me = bucket.group.rank()
        for owner, (offset, bad) in enumerate(zip(ats, raised)):
            if bad or owner == me:  # a raising owner's rows stay as before; this rank's own landed in scatter
                continue
            offset += 1
            for e in entries:
                if e.owner == owner:
                    local = e.sp.sharded._local_tensor
                    n = e.sp.layout.local_numel(me)
                    local.copy_(recv[offset:offset + n].view(local.shape))
                    offset += n
        posted.release()
    return flags


def raised_texts(bucket, text: str | None) -> list:
    """Every rank's ``text`` over ``bucket``'s shard axis, in rank order (an object all-gather): the owners
    whose step raised tell their exception, the others ``None``. Issued only after a flag of ``land``
    said an owner raised (the same on every rank of the axis)."""
    return all_gather_objects(text, bucket.group)
