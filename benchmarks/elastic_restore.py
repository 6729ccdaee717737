"""How long ``perparam.elastic.State.restore()`` takes for SmolLM2-135M's state (the main job's model, fp32,
AdamW), onto the number of ranks that took the snapshot and onto one fewer, split into its parts.

    python -m benchmarks.elastic_restore [--nproc 4] [--assets .cache/assets] [--json out.json]

First ``--nproc`` gloo ranks (processes) load the GGUF from ``--assets`` (``perparam.finetune``'s loader),
``fully_shard`` each layer and the root, make AdamW's state (one step on zero gradients) and commit one
snapshot into a temporary folder in ``/dev/shm``; then a fresh, randomly initialised model restores it on
``--nproc`` ranks, and again on ``--nproc - 1``. Reported per rank: ``find_s`` (the listing gathered, the
chosen copies checked against their checksums, the payloads mapped: read and verify), ``reshard_s`` (DCP's
plan and the copies out of the snapshots into the load's targets), ``copy_s`` (the rest of ``load_from``: the
targets into the model and the optimizer) and ``restore_s`` (the whole call), each also as process CPU time
(``*_cpu_s``), and whether every parameter's
global values equal the snapshotted model's (bitwise: an fp32 copy, resliced).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def _rank(rank: int, world: int, store_path: str, root: str, gguf: str, phase: str, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        conn.send(_commit(root, gguf) if phase == "commit" else _restore(root, gguf))
    finally:
        dist.destroy_process_group()


def _sharded(gguf: str, pretrained: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import perparam
    from perparam.finetune.gguf_loader import load_llama, open_gguf, read_config
    from perparam.finetune.model import Llama

    if pretrained:
        model, _ = load_llama(gguf)
    else:
        torch.manual_seed(1)
        model = Llama(read_config(open_gguf(gguf), gguf))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        perparam.fully_shard(layer, mesh=mesh)
    perparam.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's state made (exp_avg, exp_avg_sq, step)
    opt.zero_grad()
    return model, opt


def _fingerprint(model) -> dict[str, float]:
    from torch.distributed.tensor import DTensor

    return {n: float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().sum())
            for n, p in model.named_parameters()}


def _commit(root: str, gguf: str) -> dict:
    import torch.distributed as dist

    from perparam.elastic import State

    model, opt = _sharded(gguf, pretrained=True)
    state = State(model, opt, root=root, job="bench")
    state.commit()
    state.finish()
    out = {"rank": dist.get_rank(), "slot_bytes": state.store.own(1).capacity,
           "fingerprint": _fingerprint(model)}
    state.close(remove_snapshots=False)
    return out


def _restore(root: str, gguf: str) -> dict:
    import importlib

    import torch.distributed as dist

    from perparam.elastic import State
    from perparam.elastic import state as state_module

    load_module = importlib.import_module("perparam.checkpoint.load")
    model, opt = _sharded(gguf, pretrained=False)
    state = State(model, opt, root=root, job="bench")
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
                spent[name + "_cpu"] = spent.get(name + "_cpu", 0.0) + time.process_time() - cpu
        return wrapper

    find, dcp_load, load_from = state_module.find, load_module.dcp.load, state_module.checkpoint.load_from
    state_module.find = timed("find_s", find)
    load_module.dcp.load = timed("reshard_s", dcp_load)
    state_module.checkpoint.load_from = timed("load_from_s", load_from)
    dist.barrier()
    t, cpu = time.perf_counter(), time.process_time()
    try:
        step = state.restore()
    finally:
        state_module.find, load_module.dcp.load, state_module.checkpoint.load_from = find, dcp_load, load_from
    total, cpu = time.perf_counter() - t, time.process_time() - cpu
    out = {"rank": dist.get_rank(), "restored_step": step, "restore_s": total, "restore_cpu_s": cpu,
           "find_s": spent["find_s"],
           "reshard_s": spent["reshard_s"], "copy_s": spent["load_from_s"] - spent["reshard_s"],
           "find_cpu_s": spent["find_s_cpu"], "reshard_cpu_s": spent["reshard_s_cpu"],
           "copy_cpu_s": spent["load_from_s_cpu"] - spent["reshard_s_cpu"],
           "fingerprint": _fingerprint(model)}
    state.close(remove_snapshots=False)
    return out


def _launch(world: int, root: str, gguf: str, phase: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        pipes, procs = [], []
        for r in range(world):
            here, there = ctx.Pipe()
            args = (r, world, os.path.join(tmp, "store"), root, gguf, phase, there)
            p = ctx.Process(target=_rank, args=args)
            p.start()
            pipes.append(here)
            procs.append(p)
        results = [c.recv() for c in pipes]
        for p in procs:
            p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--assets", default=".cache/assets")
    parser.add_argument("--json", default=None)
    parser.add_argument("--root", default=None, help="keep the snapshots in this folder (default: a "
                        "temporary one in /dev/shm); when it holds them already, only the restores run")
    args = parser.parse_args()
    from perparam.finetune.gguf_loader import find_gguf

    gguf = str(find_gguf(args.assets))
    out: dict = {"nproc": args.nproc}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        shm = args.root or tmp
        done = Path(shm, "committed.json")
        if not done.exists():
            committed = _launch(args.nproc, shm, gguf, "commit")
            done.write_text(json.dumps(committed))
        committed = json.loads(done.read_text())
        want = committed[0]["fingerprint"]
        out["committed"] = [{k: v for k, v in r.items() if k != "fingerprint"} for r in committed]
        for world in (args.nproc, args.nproc - 1):
            got = _launch(world, shm, gguf, "restore")
            for r in got:
                print_ = r.pop("fingerprint")
                r["equal_to_snapshot"] = print_ == want
            out[f"restore_onto_{world}"] = got
            out["load_average"] = os.getloadavg()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
