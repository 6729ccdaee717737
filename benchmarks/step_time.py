"""Step time, model-state bytes, peak RSS and bytes communicated: DDP vs torch FSDP2 vs perparam.

    python benchmarks/step_time.py --json runs/bench/step_time.json

Every configuration trains the same model (``benchmarks/model.py``, same initial weights) on the same data
over the same mesh: gloo, 2 ranks on 127.0.0.1, one thread per rank. The script starts its own ranks.

* Timing run: one process pair builds every configuration's model and AdamW once, then runs rounds of
  one step of each configuration (the order rotates every round); the first ``--warmup`` rounds are
  dropped. A step (zero_grad, forward, backward, optimizer step) starts after a barrier; its time is the
  slower rank's. Reported: the median over ``--steps`` rounds.
* Memory runs: peak RSS cannot be attributed to one configuration inside the interleaved run, so each
  configuration also runs alone in a fresh process pair for a few steps, and each rank reads its
  ``ru_maxrss`` before building the model (baseline), after building it, and after the steps (peak).
* Model-state bytes: ``perparam.memory.measure.model_state_bytes`` (storages of parameters, gradients and
  optimizer state on this rank) after the last timed step, before the next ``zero_grad``.
* Bytes communicated per step, per rank, in ``perparam.CommCounter``'s convention (all-gather: gathered
  output; reduce-scatter: its input; all-reduce: the tensor): perparam from ``CommCounter``; FSDP2 by
  wrapping the ``torch.distributed`` functions it calls; DDP all-reduces its gradient buckets in C++,
  so its figure is computed as the bytes of the gradients.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import perparam  # noqa: E402
from benchmarks.model import GPT, GPTConfig, make_batches, num_params  # noqa: E402
from perparam.memory.measure import model_state_bytes  # noqa: E402

WORLD_SIZE = 2
CONFIGS = ("ddp", "fsdp2", "perparam", "perparam_bf16", "perparam_int8")
DESCRIPTIONS = {
    "ddp": "torch DistributedDataParallel",
    "fsdp2": "torch fully_shard, per block then root",
    "perparam": "perparam.fully_shard, per block then root",
    "perparam_bf16": "perparam, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "perparam_int8": "perparam, int8-quantized all-gather of the Linear weights",
}
LR = 1e-3


class Unsupported(Exception):
    """The configuration cannot be built with this version of perparam."""


# -- counting torch.distributed collectives (FSDP2; a cross-check for perparam) ------------------------------
class DistCounter:
    """Wraps the ``torch.distributed`` collective functions; counts calls while ``active``."""

    _OUTPUT_BYTES = ("all_gather_single", "all_gather_into_tensor")  # gathered output: first argument
    _INPUT_BYTES = ("reduce_scatter_single", "reduce_scatter_tensor")  # reduce-scatter input: second
    _TENSOR_BYTES = ("all_reduce", "broadcast")

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        for name in self._OUTPUT_BYTES + self._INPUT_BYTES + self._TENSOR_BYTES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn):
        kind = ("all_gather" if name in self._OUTPUT_BYTES else
                "reduce_scatter" if name in self._INPUT_BYTES else name)

        def wrapper(*args, **kwargs):
            if self.active:
                if name in self._INPUT_BYTES:
                    t = kwargs.get("input", args[1] if len(args) > 1 else None)
                else:
                    t = kwargs.get("output_tensor", kwargs.get("output", kwargs.get("tensor", args[0])))
                self.calls[kind] += 1
                self.bytes[kind] += t.numel() * t.element_size()
            return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn
        return wrapper

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        calls, nbytes = dict(self.calls), dict(self.bytes)
        self.calls.clear()
        self.bytes.clear()
        return calls, nbytes


# -- building the configurations ----------------------------------------------------------------------------
def _linear_weight_names(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the Linear weights a ``fully_shard(module)`` call would manage."""
    names, stack = [], [("", module)]
    while stack:
        prefix, m = stack.pop()
        if m is not module and (isinstance(m, perparam.ShardedModule) or m is None):
            continue
        if isinstance(m, nn.Linear):
            names.append(prefix + "weight")
        stack.extend((f"{prefix}{n}.", c) for n, c in m.named_children())
    return sorted(names)


def _perparam_kwargs(name: str, module: nn.Module) -> dict:
    if name == "perparam":
        return {}
    if name == "perparam_bf16":
        return {"mp_policy": perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if name == "perparam_int8":
        quant = perparam.ParamPolicy(quant=perparam.QuantPolicy(torch.int8))
        return {"param_policy": {n: quant for n in _linear_weight_names(module)}}
    raise ValueError(name)


def build(name: str, cfg: GPTConfig, mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (same initial weights for every configuration) wrapped for ``name``, and its AdamW."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    if name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name.startswith("perparam"):
        try:
            for block in model.blocks:
                perparam.fully_shard(block, mesh=mesh, **_perparam_kwargs(name, block))
            perparam.fully_shard(model, mesh=mesh, **_perparam_kwargs(name, model))
        except (NotImplementedError, TypeError, AttributeError) as e:
            raise Unsupported(f"{type(e).__name__}: {e}") from e
    else:
        raise ValueError(f"unknown configuration {name!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# -- what one rank runs ---------------------------------------------------------------------------------------
class Runner:
    """One configuration on this rank: model, optimizer, and its per-step records."""

    def __init__(self, name: str, cfg: GPTConfig, mesh, seed: int, counter: DistCounter) -> None:
        self.name = name
        self.model, self.opt = build(name, cfg, mesh, seed)
        self.counter = counter
        self.times: list[tuple[float, float, float]] = []  # forward, backward, optimizer (s)
        self.cpu: list[float] = []  # CPU seconds of this process (all threads) per step
        self.faults: list[int] = []  # minor page faults per step (fresh pages mapped by allocations)
        self.losses: list[float] = []
        self.comm: list[dict] = []  # per step: CommCounter and dist-wrapper figures
        self.error: str | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> None:
        comm = perparam.CommCounter()
        dist.barrier()
        self.counter.active = True
        with comm:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0 = time.process_time()
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = self.model(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.opt.step()
            t3 = time.perf_counter()
            c1 = time.process_time()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.counter.active = False
        calls, nbytes = self.counter.take()
        if record:
            self.times.append((t1 - t0, t2 - t1, t3 - t2))
            self.cpu.append(c1 - c0)
            self.faults.append(f1 - f0)
            self.losses.append(loss.item())
            self.comm.append({"perparam_counter": {k: comm.bytes(k) for k in comm.by_kind()},
                              "perparam_counter_calls": comm.by_kind(),
                              "dist_bytes": nbytes, "dist_calls": calls})


def _local_batch(batch, rank: int, world: int):
    x, y = batch
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def timing_job(rank: int, world: int, opts: dict) -> dict:
    """Every configuration interleaved: one step of each per round, rotating the order."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = GPTConfig(**opts["model"])
    mesh = init_device_mesh("cpu", (world,))
    counter = DistCounter()
    runners, statuses = [], {}
    for name in opts["configs"]:
        try:
            runners.append(Runner(name, cfg, mesh, opts["seed"], counter))
            statuses[name] = {"status": "ok"}
        except Unsupported as e:
            statuses[name] = {"status": "unsupported", "reason": str(e)}
    batches = make_batches(cfg, 4, opts["batch_per_rank"] * world, seed=opts["seed"])
    rounds = opts["warmup"] + opts["steps"]
    loads = []
    for r in range(rounds):
        batch = _local_batch(batches[r % len(batches)], rank, world)
        k = r % max(len(runners), 1)
        for runner in runners[k:] + runners[:k]:
            if runner.error is None:
                try:
                    runner.step(*batch, record=r >= opts["warmup"])
                except Exception:
                    runner.error = traceback.format_exc()
        loads.append(os.getloadavg())
    out = {"configs": {}, "loadavg": loads}
    for name in opts["configs"]:
        out["configs"][name] = dict(statuses[name])
    for runner in runners:
        rec = out["configs"][runner.name]
        if runner.error is not None:
            rec.update(status="error", reason=runner.error)
            continue
        module = runner.model.module if isinstance(runner.model, nn.parallel.DistributedDataParallel) else runner.model
        rec.update(times=runner.times, cpu=runner.cpu, faults=runner.faults, losses=runner.losses, comm=runner.comm,
                   model_state_bytes=model_state_bytes(module, runner.opt).as_dict(),
                   grad_bytes_unsharded=grad_bytes(module) if runner.name == "ddp" else None)
    return out


def rss_job(rank: int, world: int, opts: dict) -> dict:
    """One configuration alone: ``ru_maxrss`` before building, after building, after the steps."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = GPTConfig(**opts["model"])
    mesh = init_device_mesh("cpu", (world,))
    counter = DistCounter()
    batches = make_batches(cfg, 4, opts["batch_per_rank"] * world, seed=opts["seed"])
    baseline = rss_bytes()
    try:
        runner = Runner(opts["config"], cfg, mesh, opts["seed"], counter)
    except Unsupported as e:
        return {"status": "unsupported", "reason": str(e)}
    built = rss_bytes()
    for r in range(opts["rss_steps"]):
        runner.step(*_local_batch(batches[r % len(batches)], rank, world), record=True)
    return {"status": "ok", "baseline": baseline, "built": built, "peak": rss_bytes()}


JOBS = {"timing": timing_job, "rss": rss_job}


def _worker(job: str, rank: int, world: int, port: int, opts: dict, conn) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=opts["timeout"]))
        result = JOBS[job](rank, world, opts)
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


# -- the launcher ---------------------------------------------------------------------------------------------
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp",
                                     "torch.distributed.tensor", "perparam", "benchmarks.model"])
    return _CTX


def launch(job: str, opts: dict, world: int = WORLD_SIZE) -> list:
    """Run ``JOBS[job]`` on ``world`` fresh gloo ranks; return each rank's result (raises on failure)."""
    return launch_many([(job, opts)], world)[0]


def launch_many(jobs: list[tuple[str, dict]], world: int = WORLD_SIZE) -> list[list]:
    """Run several jobs at once, each on its own ``world`` fresh ranks; per job, each rank's result."""
    ctx = _context()
    procs, conns, stores = [], [], []
    for job, opts in jobs:
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        stores.append(store)
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(job, rank, world, store.port, opts, child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + max(opts["timeout"] for _, opts in jobs)
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            for i, conn in enumerate(conns):
                if i in results:
                    continue
                if conn.poll(0.02):
                    try:
                        results[i] = conn.recv()
                    except EOFError:
                        results[i] = ("error", f"exited ({procs[i].exitcode}) without a result")
                elif not procs[i].is_alive() and not conn.poll(0.05):
                    results[i] = ("error", f"died with exit code {procs[i].exitcode}")
            if any(s == "error" for s, _ in results.values()):
                time.sleep(1.0)  # let the peers report their own errors
                for i, conn in enumerate(conns):
                    if i not in results and conn.poll(0):
                        results[i] = conn.recv()
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    failed = []
    for i in range(len(procs)):
        (job, opts), rank = jobs[i // world], i % world
        what = f"{job}{' ' + opts['config'] if 'config' in opts else ''} rank {rank}"
        if i not in results:
            failed.append(f"--- {what}: timed out ---")
        elif results[i][0] == "error":
            failed.append(f"--- {what} ---\n{results[i][1]}")
    if failed:
        raise RuntimeError("benchmark job failed\n" + "\n".join(failed))
    loaded = [torch.load(io.BytesIO(results[i][1]), weights_only=False) for i in range(len(procs))]
    return [loaded[j * world:(j + 1) * world] for j in range(len(jobs))]


# -- summarising ----------------------------------------------------------------------------------------------
def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = (lambda f: xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]) if xs else (lambda f: math.nan)
    return {"median": statistics.median(xs) if xs else math.nan, "p10": q(0.1), "p90": q(0.9),
            "min": xs[0] if xs else math.nan, "n": len(xs)}


def summarise(name: str, per_rank: list[dict], rss: list[dict] | None) -> dict:
    recs = [r["configs"][name] for r in per_rank]
    rec0 = recs[0]
    out = {"description": DESCRIPTIONS[name], "status": rec0["status"]}
    if rec0["status"] != "ok":
        out["reason"] = rec0.get("reason")
        return out
    n = len(rec0["times"])
    step = [max(sum(r["times"][i]) for r in recs) for i in range(n)]  # slower rank per round
    phase = {p: [max(r["times"][i][j] for r in recs) for i in range(n)]
             for j, p in enumerate(("forward", "backward", "optimizer"))}
    out["step_time_s"] = _quantiles(step)
    out["step_times_s"] = step  # per timed round, in round order (for paired comparisons)
    out["phase_time_s"] = {p: statistics.median(v) for p, v in phase.items()}
    # CPU seconds per step (process time, all threads, mean over ranks): less sensitive to other load
    out["cpu_time_s"] = statistics.median(statistics.mean(r["cpu"][i] for r in recs) for i in range(n))
    out["page_faults_per_step"] = statistics.median(statistics.mean(r["faults"][i] for r in recs) for i in range(n))
    out["final_loss"] = statistics.mean(r["losses"][-1] for r in recs)
    out["model_state_bytes"] = rec0["model_state_bytes"]
    out["model_state_bytes_per_rank"] = [r["model_state_bytes"]["total"] for r in recs]
    last = rec0["comm"][-1]
    if name == "ddp":
        gb = rec0["grad_bytes_unsharded"]
        comm, calls = {"all_reduce": gb}, None
        source = "computed: gradient bytes (DDP all-reduces its buckets in C++, not visible to Python)"
    elif name == "fsdp2":
        comm, calls = last["dist_bytes"], last["dist_calls"]
        source = "torch.distributed wrappers (all_gather_single, reduce_scatter_single, ...)"
    else:
        comm, calls = last["perparam_counter"], last["perparam_counter_calls"]
        source = "perparam.CommCounter"
        out["comm_bytes_per_step_dist_wrappers"] = last["dist_bytes"]  # cross-check
    out["comm_bytes_per_step"] = {**comm, "total": sum(comm.values())}
    out["collectives_per_step"] = calls
    out["comm_source"] = source
    out["comm_constant_over_steps"] = all(c == last for c in rec0["comm"])
    if rss is not None:
        ok = [r for r in rss if r.get("status") == "ok"]
        if ok:
            out["peak_rss_bytes"] = max(r["peak"] for r in ok)
            out["peak_rss_bytes_per_rank"] = [r["peak"] for r in ok]
            out["rss_baseline_bytes_per_rank"] = [r["baseline"] for r in ok]
            out["rss_after_build_bytes_per_rank"] = [r["built"] for r in ok]
            out["peak_rss_over_baseline_bytes"] = max(r["peak"] - r["baseline"] for r in ok)
    return out


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "perparam"],
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "perparam": perparam.__version__,
            "git_commit": commit, "perparam_dirty": dirty}


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    meta = result["meta"]
    table = Table(title=f"{meta['world_size']} ranks x 1 thread (gloo), {meta['model_params'] / 1e6:.1f}M params, "
                        f"batch {meta['batch_per_rank']}x{meta['model']['seq']} per rank, median of {meta['steps']} "
                        "interleaved steps")
    cols = ("config", "step ms (p10-p90)", "fwd/bwd/opt ms", "vs FSDP2", "paired", "CPU ms", "faults",
            "state MiB", "mem vs FSDP2", "peak RSS MiB", "comm MiB/step", "loss")
    for col in cols:
        table.add_column(col, justify="left" if col == "config" else "right")

    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    abbrev = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    for name, c in result["configs"].items():
        if c["status"] != "ok":
            table.add_row(name, c["status"], *[""] * (len(cols) - 2))
            continue
        st, ph = c["step_time_s"], c["phase_time_s"]
        comm = " ".join(f"{abbrev.get(k, k)} {v / mib:.1f}" for k, v in c["comm_bytes_per_step"].items() if k != "total")
        table.add_row(
            name, f"{st['median'] * 1e3:.0f} ({st['p10'] * 1e3:.0f}-{st['p90'] * 1e3:.0f})",
            "/".join(f"{ph[p] * 1e3:.0f}" for p in ("forward", "backward", "optimizer")),
            ratio(c["ratio_vs_fsdp2"]), ratio(c["paired_ratio_vs_fsdp2"]),
            f"{c['cpu_time_s'] * 1e3:.0f}", f"{c['page_faults_per_step']:.0f}",
            f"{c['model_state_bytes']['total'] / mib:.1f}", ratio(c["memory_ratio_vs_fsdp2"]),
            f"{c['peak_rss_bytes'] / mib:.0f}" if "peak_rss_bytes" in c else "-", comm, f"{c['final_loss']:.4f}")
    console = Console() if sys.stdout.isatty() else Console(width=170)
    console.print(table)
    la = meta["loadavg"]
    console.print(f"load average (1 min) during the timing run: min {la['min']:.2f}, mean {la['mean']:.2f}, "
                  f"max {la['max']:.2f} on {meta['machine']['nproc']} CPUs ({meta['machine']['cpu_model']})")
    for name, c in result["configs"].items():
        if c["status"] != "ok":
            console.print(f"[yellow]{name}: {c['status']}[/]: {str(c.get('reason', '')).strip().splitlines()[-1]}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--steps", type=int, help="timed rounds (default 20; --quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first (default 3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="toy model and few steps (smoke test)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank per step (default 2)")
    ap.add_argument("--rss-steps", type=int, help="steps of each memory run (default 4; --quick 2)")
    ap.add_argument("--no-rss", action="store_true", help="skip the per-configuration peak-RSS runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before a job is killed")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    rss_steps = args.rss_steps if args.rss_steps is not None else (2 if args.quick else 4)
    opts = {"model": cfg.as_dict(), "configs": configs, "steps": steps, "warmup": warmup, "seed": args.seed,
            "batch_per_rank": args.batch_per_rank, "rss_steps": rss_steps, "timeout": args.timeout}

    started = _dt.datetime.now(_dt.timezone.utc)
    load_start = os.getloadavg()
    per_rank = launch("timing", opts)
    load_end = os.getloadavg()
    rss = {}
    if not args.no_rss:
        names = [n for n in configs if per_rank[0]["configs"][n]["status"] == "ok"]
        if args.quick:  # toy model: run the memory jobs side by side (their RSS does not depend on timing)
            rss = dict(zip(names, launch_many([("rss", {**opts, "config": n}) for n in names])))
        else:  # one at a time, so the machine's memory is not the limit
            rss = {n: launch("rss", {**opts, "config": n}) for n in names}
    loads = [la[0] for la in per_rank[0]["loadavg"]]
    result = {
        "meta": {
            "date": started.isoformat(timespec="seconds"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": machine_info(), "world_size": WORLD_SIZE, "threads_per_rank": 1, "backend": "gloo",
            "model": cfg.as_dict(), "model_params": num_params(GPT(cfg)), "batch_per_rank": args.batch_per_rank,
            "steps": steps, "warmup": warmup, "rss_steps": rss_steps, "quick": args.quick,
            "loadavg": {"start": list(load_start), "end": list(load_end), "min": min(loads), "max": max(loads),
                        "mean": statistics.mean(loads)},
        },
        "configs": {name: summarise(name, per_rank, rss.get(name)) for name in configs},
    }
    base = result["configs"].get("fsdp2", {})
    for c in result["configs"].values():
        if c["status"] == "ok" and base.get("status") == "ok":
            c["ratio_vs_fsdp2"] = c["step_time_s"]["median"] / base["step_time_s"]["median"]
            # the same ratio taken within each round (both steps ran seconds apart), then the median:
            # less sensitive to load that changes over the run
            c["paired_ratio_vs_fsdp2"] = statistics.median(a / b for a, b in zip(c["step_times_s"], base["step_times_s"]))
            c["cpu_ratio_vs_fsdp2"] = c["cpu_time_s"] / base["cpu_time_s"]
            c["memory_ratio_vs_fsdp2"] = c["model_state_bytes"]["total"] / base["model_state_bytes"]["total"]
        else:
            c["ratio_vs_fsdp2"] = c["memory_ratio_vs_fsdp2"] = None
            c["paired_ratio_vs_fsdp2"] = c["cpu_ratio_vs_fsdp2"] = None
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    render(result)
    return result


if __name__ == "__main__":
    main()
