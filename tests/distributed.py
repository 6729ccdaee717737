"""Multi-process test harness: run a function on N ranks over gloo on loopback and collect the results.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (forked from a forkserver that
has torch, perparam and the test modules loaded so far imported already, so a start costs milliseconds, not
seconds: each rank unpickles ``fn`` by name, and importing its test module there, with pytest and
hypothesis, cost more than the rest of a small test), initialises a gloo
process group in each over a ``FileStore`` (no ports to race for), sets one thread per rank, calls
``fn(rank, world_size, *args)`` and returns the per-rank return values as a list. A rank that raises
fails the test with every failing rank's traceback; a hang fails it after ``timeout`` seconds, naming the
ranks still running, and kills them. ``fn`` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

_CTX = None
#: what the forkserver imports once, so no rank imports it again. ``torch._dynamo``: torch imports it at the
#: first ``DTensor.from_local`` of a process (its ``_disable_dynamo`` wrapper), which cost every rank of every
#: test 1-6 s (profiled: 98% of a 2-parameter test's rank); DCP: the checkpoint tests' ranks import it inside
#: functions. ``tests.distributed`` imports the test modules (``_preload``).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "perparam",
           "tests.distributed"]
#: the modules the forkserver imports at its start (``_preload``), comma-separated; set only while it starts
PRELOAD_ENV = "PERPARAM_TESTS_PRELOAD"


def _context():
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # what this process has loaded of pytest, hypothesis and the test modules (collection imports them
        # all): the ranks import their test module to unpickle ``fn``; the forkserver does it once instead
        names = [n for n in sorted(sys.modules) if n in ("pytest", "hypothesis") or n.startswith("tests.")]
        os.environ[PRELOAD_ENV] = ",".join(names)
        try:
            forkserver.ensure_running()
        finally:
            del os.environ[PRELOAD_ENV]
        _CTX = ctx
    return _CTX


def _preload(names: str) -> None:
    """In the forkserver (importing this module with ``PRELOAD_ENV`` set): import ``names``, each in a
    ``try`` (one that fails here is imported, and fails, in the rank as before), then put back the random
    generators' states, which a test module may have seeded at import, so every rank starts from the states
    it started from before."""
    import importlib
    import random

    import torch

    states = torch.random.get_rng_state(), random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    for name in names.split(","):
        try:
            importlib.import_module(name)
        except BaseException:  # pytest.importorskip raises Skipped, not ImportError
            pass
    torch.random.set_rng_state(states[0])
    random.setstate(states[1])
    if numpy_state is not None:
        numpy.random.set_state(numpy_state)


def _worker(fn, rank: int, world_size: int, store_path: str, timeout: float, conn, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        # nobody tears down (closing sockets and the store) while a peer may still use them
        if dist.is_initialized():
            dist.barrier()
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
    except BaseException:  # report everything, including assertion failures, to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        import gc

        gc.collect()  # free sharded models (reference cycles) before their process groups go
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def one_process(fn, *args):
    """The single-process reference of a parity test: ``fn(0, 0, *args)`` in this process, with no process
    group. By the convention of these tests ``world_size == 0`` means "do not shard": ``fn`` builds, trains
    and returns the plain model that a sharded run (``run_distributed(fn, world_size, *args)``) must match."""
    return fn(0, 0, *args)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0,
                    grace: float = 2.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result. Once a
    rank fails, the others have ``grace`` seconds to report before they are killed (a test that checks what a
    survivor does after a peer died gives it longer)."""
    import torch

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="perparam-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(fn, rank, world_size, store_path, timeout, child, args),
                            daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        results: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise AssertionError(f"distributed test timed out after {timeout:.0f}s; ranks still "
                                         f"running: {missing}" + _errors(results))
                for rank, conn in enumerate(conns):
                    if rank in results:
                        continue
                    if conn.poll(0.01):
                        try:
                            results[rank] = conn.recv()
                        except EOFError:
                            results[rank] = ("error", f"rank {rank} exited with code {procs[rank].exitcode} "
                                                      "without reporting")
                    elif not procs[rank].is_alive() and not conn.poll(0.05):
                        results[rank] = ("error", f"rank {rank} died with exit code {procs[rank].exitcode}")
                if any(status == "error" for status, _ in results.values()):
                    # give the peers a moment to report their own errors, then stop waiting for them
                    until = time.monotonic() + grace
                    while time.monotonic() < until and len(results) < world_size:
                        for rank, conn in enumerate(conns):
                            if rank not in results and conn.poll(0.01):
                                try:
                                    results[rank] = conn.recv()
                                except EOFError:
                                    pass
                    raise AssertionError("distributed test failed" + _errors(results))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]


def _errors(results: dict) -> str:
    return "".join(f"\n--- rank {rank} ---\n{payload}" for rank, (status, payload) in sorted(results.items())
                   if status == "error")


# all_to_all_single: perparam's reduce-scatter on gloo (an all-to-all, then a local sum:
# perparam.comm.collectives)
C10D_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce")
# ProcessGroup.send / recv: the zero-copy all-gather on gloo (perparam.comm.collectives.all_gather_in_place)
C10D_POINT_TO_POINT = ("send", "recv")


class c10d_calls:  # noqa: N801 (used as a context manager, like a function)
    """Count calls of torch.distributed's collective functions, and of ``ProcessGroup.send``/``recv``
    (keys ``"send"``, ``"recv"``), while active, so a test can check that ``perparam.CommCounter`` hides
    none: ``with c10d_calls() as raw: ...; raw["all_reduce"]``."""

    def __enter__(self) -> dict[str, int]:
        import torch.distributed as dist

        self.counts = dict.fromkeys(C10D_COLLECTIVES + C10D_POINT_TO_POINT, 0)
        self.originals = {name: getattr(dist, name) for name in C10D_COLLECTIVES}
        # the class's own attribute (a pybind method): what ``getattr`` gives no longer binds once set back
        self.methods = {name: vars(dist.ProcessGroup)[name] for name in C10D_POINT_TO_POINT}

        def counting(name, fn):
            def call(*args, **kwargs):
                self.counts[name] += 1
                return fn(*args, **kwargs)
            return call

        for name in C10D_COLLECTIVES:
            setattr(dist, name, counting(name, self.originals[name]))
        for name in C10D_POINT_TO_POINT:
            setattr(dist.ProcessGroup, name, counting(name, getattr(dist.ProcessGroup, name)))
        return self.counts

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self.originals.items():
            setattr(dist, name, fn)
        for name, fn in self.methods.items():
            setattr(dist.ProcessGroup, name, fn)


if os.environ.get(PRELOAD_ENV):  # the forkserver, starting (``_context``); its ranks do not import this again
    _preload(os.environ.pop(PRELOAD_ENV))


class CountingAllGather:
    """FSDP2's ``AllGather`` interface (``set_custom_all_gather``) over ``dist.all_gather_into_tensor``,
    counting its calls in ``calls``."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
