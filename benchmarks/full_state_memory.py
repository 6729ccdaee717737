"""Rank 0's peak memory during ``perparam.checkpoint.full_state_dict``, against the largest parameter.

    python -m benchmarks.full_state_memory [--nproc 2] [--json runs/bench/full_state.json]

SmolLM2-135M's shapes (``LlamaConfig.smollm2_135m()``: 134.5M fp32 parameters, the largest the 49152 x 576
embedding) built on the meta device, sharded as the main job shards it over ``--nproc`` gloo ranks on this
machine, and materialised in place (``to_empty``, then random shards): no full-size tensor was ever
allocated before the measurement, so the resident set holds only the shards. On rank 0: resident memory before
(``VmRSS``, its shards), the peak resident memory during the gather (``VmHWM`` after resetting it through
``/proc/self/clear_refs``; Linux only) and the bytes of the CPU dict returned; and per tensor gathered, the
peak above the resident memory before it minus the copy it leaves in the dict (``VmHWM`` reset before each
``full_tensor``). ``transient``: the largest of those, what the gather needs beyond the shards and the result
so far; the figure reported is ``transient / largest parameter``. glibc's mmap threshold is
fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave the resident set at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import tempfile
from datetime import timedelta
from pathlib import Path


def _status(key: str) -> int:
    """``/proc/self/status`` field ``key`` (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _with_marks(full_state_dict, model, marks: list):
    """``full_state_dict(model)``, resetting the peak before each tensor's gather and recording after it:
    appends ``(peak, RSS at its start)`` per tensor, in gathering order, to ``marks``."""
    from perparam import full_state

    real, start = full_state.full_tensor, []

    def reset_then_gather(value):
        if start:  # the previous tensor is gathered and copied into the dict: its peak
            marks.append((_status("VmHWM"), start[-1]))
        start.append(_status("VmRSS"))
        Path("/proc/self/clear_refs").write_text("5")
        return real(value)

    full_state.full_tensor = reset_then_gather
    try:
        state = full_state_dict(model)
    finally:
        full_state.full_tensor = real
    marks.append((_status("VmHWM"), start[-1]))
    assert len(marks) == len(model.state_dict())  # every entry of this model is a DTensor
    return state


def _rank(rank: int, world: int, store_path: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from perparam.checkpoint import full_state_dict
    from perparam.finetune.model import Llama, LlamaConfig
    from perparam.finetune.train import build_meshes, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    model = shard_model(Llama(LlamaConfig.smollm2_135m(), device="meta"), build_meshes(world, 1, 1, "cpu"))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-1, 1)  # touch every page of the shards
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    dist.barrier()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    marks: list[tuple[int, int]] = []  # (peak of the last tensor, RSS when it started)
    state = _with_marks(full_state_dict, model, marks)
    peak = max(_status("VmHWM"), *(m[0] for m in marks))
    if rank == 0:
        returned = sum(t.numel() * t.element_size() for t in state.values())
        sizes = [t.numel() * t.element_size() for t in state.values()]  # in gathering order
        transient = max(hwm - start - size for (hwm, start), size in zip(marks, sizes))
        queue.put({"world_size": world, "rss_before_bytes": before, "peak_bytes": peak,
                   "returned_bytes": returned, "largest_param_bytes": largest, "transient_bytes": transient,
                   "transient_over_largest_param": transient / largest})
    del state, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.update({"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": "1",
                       "GLOO_SOCKET_IFNAME": "lo"})
    ctx = mp.get_context("spawn")  # fresh interpreters: the malloc setting applies
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.nproc, os.path.join(tmp, "store"), queue))
                 for r in range(args.nproc)]
        for p in procs:
            p.start()
        result = queue.get(timeout=900)
        for p in procs:
            p.join()
    mib = 1024 ** 2
    print(f"full_state_dict on rank 0 of {result['world_size']}: RSS before "
          f"{result['rss_before_bytes'] / mib:.1f} MiB, peak {result['peak_bytes'] / mib:.1f} MiB, returned "
          f"dict {result['returned_bytes'] / mib:.1f} MiB; transient {result['transient_bytes'] / mib:.1f} "
          f"MiB = {result['transient_over_largest_param']:.2f} x the largest parameter "
          f"({result['largest_param_bytes'] / mib:.1f} MiB)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
