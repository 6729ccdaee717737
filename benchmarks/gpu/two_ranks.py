"""The ``two_ranks`` section of ``benchmarks/gpu/check.py``: two processes on gloo with the tensors on the one
GPU (NCCL refuses two ranks on one GPU), perparam against one process, the collectives counted, each rank's
order of first use of its process groups. ``--device cpu``: the same on CPU tensors (the test suite's run).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from benchmarks.gpu.sections import free_port, shard_perparam, train_step
from benchmarks.harness.configs import seeded_full_init
from benchmarks.harness.model import GPT, GPTConfig, make_batches


def two_rank_worker(rank: int, device: str, port: str, path: str, steps: int = 3) -> None:
    """One of the two ranks of ``two_ranks``: gloo, the tensors on ``device`` (both ranks on GPU 0 for
    ``"cuda"``); writes ``{"max_param_diff", "counts", "first_use"}`` (or ``{"error", "traceback"}``) as JSON
    to ``path``."""
    import gc
    import json
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = _two_rank_steps(rank, device, steps)
    except Exception as e:  # the section reports it (e.g. a gloo collective that takes no CUDA tensors)
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        gc.collect()
        dist.destroy_process_group()
    with open(path, "w") as f:
        json.dump(result, f)


def _two_rank_steps(rank: int, device: str, steps: int) -> dict:
    import copy

    from torch.distributed.device_mesh import DeviceMesh

    from perparam import CommCounter
    from perparam.full_state import load_full_state_dict

    mesh = DeviceMesh(device, torch.arange(2))
    cfg = GPTConfig.quick()
    reference = seeded_full_init(cfg, 0).to(device)
    with torch.device("meta"):
        model = GPT(cfg)
    shard_perparam(model, mesh)
    load_full_state_dict(model, copy.deepcopy(reference).cpu().state_dict())
    # SGD: the bar is on the gradients (AdamW turns fp32 noise in a near-zero gradient into lr-sized steps)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    batches = make_batches(cfg, steps, 4)
    with CommCounter() as comm:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            train_step(model, opts[0], x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    for x, y in batches:
        train_step(reference, opts[1], x.to(device), y.to(device))
    want = dict(reference.named_parameters())
    diff = max(float((p.full_tensor() - want[n]).abs().max()) for n, p in model.named_parameters())
    first_use = list(dict.fromkeys(r.group_name for r in comm.records))
    return {"max_param_diff": diff, "counts": {k: comm.count(k) for k in ("all_gather", "reduce_scatter")},
            "first_use": first_use}


def two_ranks(out: dict, args, timeout_s: float = 120.0) -> None:
    """Two processes on gloo with the model's tensors on ``args.device`` (both on GPU 0 on CUDA: NCCL
    refuses two ranks on one GPU): the toy model, 3 SGD steps fp32, against one process on the whole
    batch (bar 1e-5); the collectives counted; each rank's order of first use of its process groups
    (equal on both ranks). Each rank runs in a subprocess, killed after ``timeout_s``."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        code = ("import sys; from benchmarks.gpu.two_ranks import two_rank_worker; "
                "two_rank_worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])")
        env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("LOCAL_RANK", None)
        port = free_port()  # one for both ranks
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), args.device, port, paths[r]], env=env,
                                  cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        deadline = time.monotonic() + timeout_s
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0])
                out["timed_out"] = True
        out["returncodes"] = [p.returncode for p in procs]
        ranks = [json.loads(Path(path).read_text()) if os.path.exists(path) else None for path in paths]
        out["ranks"] = ranks
        errors = [r["error"] for r in ranks if r and "error" in r]
        if errors:
            raise RuntimeError(f"two_ranks: {errors[0]}")
        if not all(ranks):
            out["log_tail"] = [log[-2000:] for log in logs]
            raise RuntimeError(f"two_ranks: rank(s) {[r for r, v in enumerate(ranks) if v is None]} wrote no "
                               f"result (return codes {out['returncodes']})")
        out["max_param_diff"] = max(r["max_param_diff"] for r in ranks)
        out["within_1e-5"] = out["max_param_diff"] <= 1e-5
        out["same_first_use_order"] = ranks[0]["first_use"] == ranks[1]["first_use"]
