"""perparam's gloo all-gather and reduce-scatter (all-to-alls, ``perparam.comm.collectives``) give bitwise
what torch's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` give: every world size 1-4 (so first,
middle and last ranks), rows of 0, 1 and odd numbers of bytes, fp32/bf16/fp64, and the buffer pool; the
unpacked reduce-scatter (``reduce_scatter_in_place``) what the packed one gives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from perparam.comm import collectives
from perparam.comm.buffers import BufferPool
from tests.distributed import run_distributed

ROW_BYTES = (0, 1, 7, 4096 + 3)
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _check(rank: int, world: int) -> list[str]:
    group = dist.group.WORLD
    pool = BufferPool()
    bad = []
    for nbytes in ROW_BYTES:
        g = torch.Generator().manual_seed(1000 * rank + nbytes)
        send = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        expect = torch.empty(world * nbytes, dtype=torch.uint8)
        dist.all_gather_single(expect, send)
        for async_op in (True, False):
            rows = collectives.all_gather_rows(send.clone(), group, pool, async_op=async_op)
            rows.wait()
            got = torch.empty(world, nbytes, dtype=torch.uint8)
            covered = []
            for first, seg in rows.segments:
                got[first:first + seg.shape[0]] = seg
                covered += range(first, first + seg.shape[0])
            if covered != list(range(world)) or not torch.equal(got.view(-1), expect):
                bad.append(f"all_gather_rows {nbytes} B async={async_op}")
            for b in rows.buffers:
                pool.give_back(b)
    for dtype in DTYPES:
        for n in (0, 1, 5, 1023):
            inputs = [torch.randn(world * n, generator=torch.Generator().manual_seed(7 * q + n),
                                  dtype=torch.float64).to(dtype) for q in range(world)]
            inp = inputs[rank]
            expect = torch.empty(n, dtype=dtype)
            if n:
                dist.reduce_scatter_single(expect, inp.clone())
            else:
                expect = inp.new_empty(0)
            if world == 1:
                expect = inp.clone()
            for async_op in (True, False):
                out = torch.full((n,), float("nan"), dtype=dtype)
                work = collectives.reduce_scatter_sum(out, inp, group, async_op=async_op, pool=pool)
                if work is not None:
                    work.wait()
                if world <= 2 and not torch.equal(out, expect):  # K <= 2: one addition, bitwise
                    bad.append(f"reduce_scatter_sum {dtype} n={n} async={async_op}")
                ref = sum(x.view(world, n)[rank].double() for x in inputs)  # this rank's chunk, summed
                low = dtype == torch.bfloat16
                if not torch.allclose(out.double(), ref, rtol=1e-2 if low else 1e-6,
                                      atol=5e-2 if low else 1e-6):
                    bad.append(f"reduce_scatter_sum {dtype} n={n} async={async_op} vs fp64 sum")
    if world > 1:
        bad += _check_in_place(rank, world, group, pool)
    return bad


def _check_in_place(rank: int, world: int, group, pool) -> list[str]:
    """``reduce_scatter_in_place`` (per tensor and peer a send and a receive, no packing) leaves what
    ``reduce_scatter_sum`` leaves for the same tensors packed with zero padding, bit for bit: uneven pieces,
    a rank without rows, zero gaps."""
    bad = []
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(rank)
        rows = (world - 1, 2 * world + 1, 1)  # tensor 0: no rows on the last rank; tensor 2: rank 0 only
        tensors = [torch.randn(n, 3, generator=g, dtype=torch.float64).to(dtype) for n in rows]
        chunks = [t.chunk(world) for t in tensors]
        pieces = [[c[r].reshape(-1) if r < len(c) else t.new_empty(0) for r in range(world)]
                  for t, c in zip(tensors, chunks)]
        padded = [-(-n // world) * 3 for n in rows]
        offsets = [sum(padded[:i]) for i in range(len(rows))]
        packed = torch.zeros(world, sum(padded), dtype=dtype)
        for i, per_rank in enumerate(pieces):
            for r, piece in enumerate(per_rank):
                packed[r, offsets[i]:offsets[i] + piece.numel()] = piece
        expect = torch.empty(sum(padded), dtype=dtype)
        collectives.reduce_scatter_sum(expect, packed.view(-1), group, pool=pool)
        out = torch.full((sum(padded),), float("nan"), dtype=dtype)
        work = collectives.reduce_scatter_in_place(pieces, out, offsets, group, pool=pool)
        work.wait()
        if not torch.equal(out, expect):
            bad.append(f"reduce_scatter_in_place {dtype} K={world}")
    return bad


def test_gloo_all_gather_and_reduce_scatter_decompositions_equal_the_native_collectives():
    for world in (1, 2, 3, 4):
        for bad in run_distributed(_check, world):
            assert bad == []
