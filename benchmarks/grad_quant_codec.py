"""CPU time of each pass of the int8 block codec (qgZ's gradient reduce-scatter, the int8 all-gather) on one
transformer block's gradients of the benchmark's 27.4M GPT (3.15M fp32 values, 12.6 MB), one thread.

    python -m benchmarks.grad_quant_codec [--k 2] [--reps 15] [--transfer]

Per candidate: the median CPU ms (``time.thread_time``) of ``--reps`` runs and whether its codes (or decoded
sums) are bitwise those of the reference implementation. Candidates for each pass:

* block absmax: ``amax`` and ``amin`` apart, ``abs().amax``, ``torch.aminmax``, ``linalg.vector_norm(inf)``;
* scale-divide-round-cast: ``div_``, ``round_``, ``copy_`` to int8 on the packed copy (before this change);
  the same with the division reading the gradients where they lie (``div(out=scratch)``: no packing copy;
  after); ``div`` then ``quantize_per_tensor(scale 1)`` (its storage read as int8);
  ``quantize_per_channel`` (one call, but multiplies by the reciprocal: other roundings);
  the 1.5 * 2**23 trick (``x / s + 1.5 * 2**23`` is an integer-valued float holding ``round(x / s)``, half
  to even, in its low bits): ``addcdiv`` or ``div`` + ``add_``, then a narrowing int32 -> int8 copy;
* decode and sum of K rows: ``copy_`` + ``mul_`` + ``add`` (before); ``copy_`` + ``mul`` + ``addcmul_``.

``--transfer``: the other side of the trade, on K gloo ranks over loopback: CPU ms per rank
(``time.process_time``, gloo's threads included) of the all-to-all of the fp32 ``[K, n]`` rows against the
int8 rows (codes + scales), so the codec's CPU per MB saved can be set against the transfer's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")

BLOCK = 256
# x + MAGIC, for |x| < 2**22, is an integer-valued float whose low byte is round(x) mod 256
MAGIC = 1.5 * 2**23


def _timed(fn, reps: int) -> float:
    fn()  # warm: allocations, page faults
    out = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return statistics.median(out) * 1e3


def _transfer_rank(rank: int, k: int, n: int, reps: int, port: int, queue) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=k,
                            timeout=timedelta(seconds=300))
    out = {}
    for name, send in (("fp32", torch.randn(k, n)), ("int8", torch.randint(0, 255, (k, n + 4 * (n // BLOCK)),
                                                                            dtype=torch.uint8))):
        recv = torch.empty_like(send)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            c0 = time.process_time()
            dist.all_to_all_single(recv, send)
            if i:
                times.append(time.process_time() - c0)
        out[name] = (statistics.median(times) * 1e3, send.numel() * send.element_size())
    queue.put((rank, out))
    dist.destroy_process_group()


def _transfer(k: int, n: int, reps: int) -> None:
    import torch.multiprocessing as mp

    from benchmarks.harness.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_transfer_rank, args=(r, k, n, reps, port, queue)) for r in range(k)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    for name in ("fp32", "int8"):
        ms = [r[1][name][0] for r in results]
        nbytes = results[0][1][name][1]
        print(f"  all-to-all {name}: {nbytes / 1e6:.2f} MB per rank, CPU ms per rank "
              + ", ".join(f"{m:.2f}" for m in ms)
              + f" ({statistics.mean(ms) / (nbytes / 1e6):.3f} ms per MB)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2, help="ranks (rows of the packed gradients; default 2)")
    ap.add_argument("--numel", type=int, default=3_145_728, help="values in all (default 3,145,728: 12.6 MB)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--transfer", action="store_true", help="also time the all-to-alls on K gloo ranks")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    k, reps = args.k, args.reps
    n = args.numel // k // BLOCK * BLOCK
    nb = n // BLOCK
    torch.manual_seed(0)
    src = torch.randn(k, n) * torch.rand(k, nb, 1).repeat_interleave(BLOCK, 1).view(k, n)
    x = src.clone()
    blocks = x.view(k, nb, BLOCK)
    rows = torch.empty(k, n + 4 * nb, dtype=torch.uint8)
    codes_out = rows.narrow(1, 0, n).view(torch.int8)
    print(f"K={k}, {k * n:,} fp32 values ({k * n * 4 / 1e6:.1f} MB), blocks of {BLOCK}, one thread; "
          f"CPU ms, median of {reps}")

    # -- absmax ------------------------------------------------------------------------------------------
    ref_amax = torch.maximum(blocks.amax(dim=2), blocks.amin(dim=2).neg())
    amax = {
        "amax, amin apart (before)": lambda: torch.maximum(blocks.amax(dim=2), blocks.amin(dim=2).neg_()),
        "abs().amax": lambda: blocks.abs().amax(dim=2),
        "aminmax": lambda: (lambda mm: torch.maximum(mm[1], mm[0].neg_()))(torch.aminmax(blocks, dim=2)),
        "linalg.vector_norm(inf)": lambda: torch.linalg.vector_norm(blocks, float("inf"), dim=2),
    }
    for name, fn in amax.items():
        print(f"  absmax   {name:34s} {_timed(fn, reps):7.2f}  bitwise={torch.equal(fn(), ref_amax)}")

    scales = ref_amax / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    ref_codes = (src.view(k, nb, BLOCK) / safe).round_().to(torch.int8).view(k, n)
    magic = torch.tensor(MAGIC)

    def before():
        x.copy_(src)  # the packed scratch is overwritten: refill it (timed apart below)
        blocks.div_(safe).round_()
        codes_out.copy_(x)

    def per_tensor():
        x.copy_(src)
        blocks.div_(safe)
        q = torch.quantize_per_tensor(x, 1.0, 0, torch.qint8)
        codes_out.copy_(torch.empty(0, dtype=torch.int8).set_(q.untyped_storage(), 0, (k, n), (n, 1)))

    zps = torch.zeros(k * nb, dtype=torch.long)
    safe_d = safe.reshape(-1).double()

    def per_channel():
        q = torch.quantize_per_channel(src.view(k * nb, BLOCK), safe_d, zps, 0, torch.qint8)
        codes_out.copy_(q.int_repr().view(k, n))

    y = torch.empty(k, n)
    y_blocks = y.view(k, nb, BLOCK)

    def from_grads():  # reads the gradients, writes the scratch: no refill needed
        torch.div(src.view(k, nb, BLOCK), safe, out=y_blocks).round_()
        codes_out.copy_(y)

    def magic_addcdiv():
        torch.addcdiv(magic, src.view(k, nb, BLOCK), safe, out=y_blocks)
        codes_out.copy_(y.view(torch.int32))  # the low byte of each word

    def magic_div_add():
        torch.div(src.view(k, nb, BLOCK), safe, out=y_blocks).add_(MAGIC)
        codes_out.copy_(y.view(torch.int32))

    refill = _timed(lambda: x.copy_(src), reps)
    print(f"  (refill of the scratch, subtracted from the in-place candidates: {refill:.2f})")
    for name, fn, in_place in (("div_ round_ copy_ (before)", before, True),
                               ("div(out=) round_ copy_ (after)", from_grads, False),
                               ("div_ quantize_per_tensor copy_", per_tensor, True),
                               ("quantize_per_channel int_repr copy_", per_channel, False),
                               ("addcdiv(1.5*2^23) int32->int8 copy_", magic_addcdiv, False),
                               ("div add_(1.5*2^23) int32->int8 copy_", magic_div_add, False)):
        ms = _timed(fn, reps) - (refill if in_place else 0.0)
        fn()
        same = torch.equal(codes_out, ref_codes)
        diff = int((codes_out != ref_codes).sum())
        print(f"  quantize {name:34s} {ms:7.2f}  bitwise={same} (codes differing: {diff})")

    # -- decode and sum ----------------------------------------------------------------------------------
    recv_codes = ref_codes
    recv_scales = scales
    scratch = torch.empty(k, n)
    out = torch.empty(n)

    def dec_before():
        values = scratch.copy_(recv_codes)
        values.view(k, nb, BLOCK).mul_(recv_scales.unsqueeze(2))
        torch.add(values[0], values[1], out=out)
        for r in range(2, k):
            out.add_(values[r])

    def dec_addcmul():
        values = scratch.copy_(recv_codes).view(k, nb, BLOCK)
        s = recv_scales.unsqueeze(2)
        o = out.view(nb, BLOCK)
        torch.mul(values[0], s[0], out=o)
        for r in range(1, k):
            o.addcmul_(values[r], s[r])

    dec_before()
    ref_out = out.clone()
    for name, fn in (("copy_ mul_ add (before)", dec_before), ("copy_ mul addcmul_", dec_addcmul)):
        ms = _timed(fn, reps)
        fn()
        print(f"  decode   {name:34s} {ms:7.2f}  bitwise={torch.equal(out, ref_out)} "
              f"(max diff {float((out - ref_out).abs().max()):.3g})")
    print(f"  fp32 sum of the K rows (what the fp32 reduce-scatter does): "
          f"{_timed(lambda: torch.sum(src, dim=0, out=out), reps):.2f}")
    _as_run(k, reps)
    if args.transfer:
        _transfer(k, n, reps)


#: the Linear weights of one block of the benchmark's GPT (width 512): qkv, proj, fc1, fc2
BLOCK_WEIGHTS = ((1536, 512), (512, 512), (2048, 512), (512, 2048))


def _as_run(k: int, reps: int) -> None:
    """Before and after, as the runtime runs them on one block's Linear weights: qgZ's encode (pack and
    encode, or ``encode_grads``) and decode-and-sum; the int8 all-gather's pack of one rank's shards and
    unpack of the K gathered rows (the quantizer protocol's base methods are the code before)."""
    from perparam.comm.buffers import BufferPool
    from perparam.runtime.paths import reduce_qgz
    from perparam.runtime.reduction import pack_reduce_scatter_input
    from perparam.sharding import quant
    from perparam.sharding.grad_quant import grad_wire
    from perparam.sharding.policy import resolve_grad_quant

    torch.manual_seed(1)
    grads = tuple(torch.randn(shape) for shape in BLOCK_WEIGHTS)
    gq = resolve_grad_quant("w", "int8")
    numels = [g.numel() // k for g in grads]
    wire = grad_wire(numels, gq)
    pool = BufferPool()
    rows_before, rows_after = (torch.zeros(k, wire.row_bytes, dtype=torch.uint8) for _ in range(2))
    q = quant.get("int8")

    def encode_before():  # the packing pass, then amax, amin, div_, round_, copy_
        packed = pack_reduce_scatter_input(list(grads), k)
        x = packed.view(k, -1, BLOCK)
        amax = torch.maximum(x.amax(dim=2), x.amin(dim=2).neg_())
        scales = torch.div(amax, 127.0, out=rows_before[:, wire.scales_at:wire.flags_at].view(torch.float32))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
        x.div_(safe).round_()
        rows_before[:, :wire.total].view(torch.int8).copy_(packed)
        return packed

    def encode_after():
        pool.give_back(reduce_qgz.encode_grads(grads, wire, gq, rows_after, pool))

    scratch = encode_before()
    out_before, out_after = (torch.empty(sum(numels) + len(numels)) for _ in range(2))

    def decode_before():  # widen, multiply every row, add
        values = scratch.copy_(rows_before[:, :wire.total].view(torch.int8))
        values.view(k, -1, BLOCK).mul_(rows_before[:, wire.scales_at:wire.flags_at].view(torch.float32)
                                       .unsqueeze(2))
        target = out_before.narrow(0, 0, wire.total)
        torch.add(values[0], values[1], out=target)
        for r in range(2, k):
            target.add_(values[r])

    def decode_after():
        reduce_qgz.decode_sum(rows_after, wire, gq, out_after, scratch)

    print(f"  as run on one block's Linear weights ({sum(g.numel() for g in grads) * 4 / 1e6:.1f} MB of "
          f"fp32 gradients, K={k}): CPU ms before -> after")
    for name, before, after in (("qgZ encode (pack + quantize)", encode_before, encode_after),
                                ("qgZ decode and sum", decode_before, decode_after)):
        b, a = _timed(before, reps), _timed(after, reps)
        print(f"    {name:40s} {b:7.2f} -> {a:7.2f}  ({a / b:.2f}x)")
    encode_before()
    encode_after()
    decode_before()
    decode_after()
    flags = wire.flags_at
    print(f"    bitwise: rows {torch.equal(rows_before[:, :flags], rows_after[:, :flags])}, sums "
          f"{torch.equal(out_before[:wire.total], out_after[:wire.total])} (max diff "
          f"{float((out_before[:wire.total] - out_after[:wire.total]).abs().max()):.3g})")

    shards = [g.chunk(k)[0].contiguous() for g in grads]  # one rank's shards
    sends = [[torch.empty(s.numel(), dtype=torch.int8), torch.empty(-(-s.numel() // BLOCK))] for s in shards]
    gathered = [[torch.randint(-127, 128, (k, s.numel()), dtype=torch.int8),
                 torch.rand(k, -(-s.numel() // BLOCK))]
                for s in shards]
    outs = [torch.empty(k, s.numel()) for s in shards]

    def pack_before():  # ShardedParam.pack before: a zeroed copy, the protocol's pack, copies into the send
        for shard, send in zip(shards, sends):
            flat = torch.zeros(shard.numel())
            flat.copy_(shard.view(-1))
            for o, piece in zip(send, quant.BlockQuantizer.pack(q, flat.view(1, -1), BLOCK)):
                o.copy_(piece.reshape(-1))

    def pack_after():
        for shard, send in zip(shards, sends):
            q.pack_into(shard.view(1, -1), BLOCK, send)

    def unpack_before():
        for pieces, out in zip(gathered, outs):
            quant.BlockQuantizer.unpack(q, pieces, BLOCK, out)

    def unpack_after():
        for pieces, out in zip(gathered, outs):
            q.unpack(pieces, BLOCK, out)

    for name, before, after in (("int8 all-gather pack (one rank's shards)", pack_before, pack_after),
                                ("int8 all-gather unpack (K rows)", unpack_before, unpack_after)):
        b, a = _timed(before, reps), _timed(after, reps)
        before()
        was = [t.clone() for t in (*[x for send in sends for x in send], *outs)]
        after()
        same = all(torch.equal(w, t) for w, t in zip(was, (*[x for send in sends for x in send], *outs)))
        print(f"    {name:40s} {b:7.2f} -> {a:7.2f}  ({a / b:.2f}x)  bitwise={same}")


if __name__ == "__main__":
    main()
