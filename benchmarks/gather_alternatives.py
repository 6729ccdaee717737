"""The all-gather alternatives on one block of the benchmark model (12 parameters, 12.6 MB fp32 gathered,
K = 2, gloo on loopback): CPU per all-gather (process time, all threads) of each way to land the pieces in
the parameters' buffers, and whether each is bitwise the row all-gather's result.

    python -m benchmarks.gather_alternatives --reps 7 [--methods rows,p2p,...]

* ``rows``: perparam's row all-gather (``all_to_all`` before issue 24): copy-in of the local shards into a
  send row, one ``all_to_all_single``, copy-out of both rows into the parameters (``split_with_sizes_copy``);
* ``p2p``: the zero-copy all-gather as perparam runs it: copy-in into this rank's rows of each parameter's
  buffer, then per parameter ``ProcessGroup.send`` of those rows and ``recv`` of the peer's, in place;
* ``p2p_dist``: the same through ``dist.isend``/``dist.irecv``; ``p2p_batch``: through ``batch_isend_irecv``;
* ``coalesced``: per parameter ``all_gather_into_tensor`` into its buffer, coalesced (gloo's
  ``allgather_into_tensor_coalesced``: one collective, copied out by gloo);
* ``alltoall_list``: per parameter ``dist.all_to_all`` with the K rank views of its buffer as outputs.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import warnings

from benchmarks.harness.ports import free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")

W = 512  # the benchmark's width: one block's parameters
SHAPES = [(3 * W, W), (3 * W,), (W, W), (W,), (4 * W, W), (4 * W,), (W, 4 * W), (W,), (W,), (W,), (W,), (W,)]
METHODS = ("rows", "p2p", "p2p_dist", "p2p_batch", "coalesced", "alltoall_list")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _run(rank: int, world: int, port: int, reps: int, methods: list[str]) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pg, k, peer = dist.group.WORLD, world, 1 - rank
    chunks = [-(-s[0] // k) for s in SHAPES]
    numels = [c * (s[1] if len(s) > 1 else 1) for c, s in zip(chunks, SHAPES)]
    shards = [torch.randn(c, *s[1:]) + rank for c, s in zip(chunks, SHAPES)]
    bufs = [torch.empty(k * n) for n in numels]
    slot = sum(numels) * 4
    send, others = torch.empty(slot, dtype=torch.uint8), torch.empty(slot, dtype=torch.uint8)

    def own_rows():
        torch._foreach_copy_([b.view(k, -1)[rank] for b in bufs], [s.reshape(-1) for s in shards])

    def rows():
        torch._foreach_copy_(list(send.view(torch.float32).split(numels)), [s.reshape(-1) for s in shards])
        splits = [0 if r == rank else slot for r in range(k)]
        dist.all_to_all_single(others, send, splits, splits, group=pg, async_op=True).wait()
        for first, seg in ((rank, send.view(1, slot)), (peer, others.view(1, slot))):
            torch.split_with_sizes_copy(seg, [n * 4 for n in numels], dim=1,
                                        out=[b.view(torch.uint8).view(k, -1).narrow(0, first, 1)
                                             for b in bufs])

    def p2p():
        own_rows()
        works = []
        for i, b in enumerate(bufs):
            works += [pg.send([b.view(k, -1)[rank]], peer, i), pg.recv([b.view(k, -1)[peer]], peer, i)]
        for w in works:
            w.wait()

    def p2p_dist():
        own_rows()
        works = []
        for i, b in enumerate(bufs):
            works += [dist.isend(b.view(k, -1)[rank], group=pg, tag=i, group_dst=peer),
                      dist.irecv(b.view(k, -1)[peer], group=pg, tag=i, group_src=peer)]
        for w in works:
            w.wait()

    def p2p_batch():
        own_rows()
        ops = []
        for i, b in enumerate(bufs):
            ops += [dist.P2POp(dist.isend, b.view(k, -1)[rank], peer, pg, tag=i),
                    dist.P2POp(dist.irecv, b.view(k, -1)[peer], peer, pg, tag=i)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def coalesced():
        with dist._coalescing_manager(group=pg, async_ops=True) as cm:
            for b, s in zip(bufs, shards):
                dist.all_gather_into_tensor(b, s.reshape(-1), group=pg)
        cm.wait()

    def alltoall_list():
        works = [dist.all_to_all([b.view(k, -1)[r] for r in range(k)], [s.reshape(-1)] * k, group=pg,
                                 async_op=True)
                 for b, s in zip(bufs, shards)]
        for w in works:
            w.wait()

    fns = {name: fn for name, fn in locals().items() if name in METHODS}
    rows()
    reference = [b.clone() for b in bufs]
    res = collections.defaultdict(list)
    for name in methods:
        for b in bufs:
            b.zero_()
        fns[name]()
        exact = all(torch.equal(a, b) for a, b in zip(reference, bufs))
        per = []
        for _ in range(reps):
            dist.barrier()
            c0 = _cpu()
            for _ in range(10):
                fns[name]()
            per.append((_cpu() - c0) / 10 * 1e3)
        per.sort()
        res[name].append(f"{per[len(per) // 2]:.2f} (min {per[0]:.2f})" + ("" if exact else " NOT EXACT"))
    if rank == 0:
        print(f"CPU ms per all-gather of one block (median of {reps} x 10), load {os.getloadavg()[0]:.2f}:")
        for name, figures in res.items():
            print(f"  {name:14s} " + ", ".join(figures))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--methods", default=",".join(METHODS * 2), help="comma-separated, repeats allowed")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    bad = sorted(set(methods) - set(METHODS))
    if bad:
        sys.exit(f"--methods: unknown {bad}; choose from {list(METHODS)}")
    mp.spawn(_run, args=(2, free_port(), args.reps, methods), nprocs=2)


if __name__ == "__main__":
    main()
