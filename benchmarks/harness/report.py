"""Summarising the ranks' records into the JSON and printing the tables (rich).

Per configuration: median step time (slower rank per round), phases, CPU time, page faults, model state,
bytes per step, memory-run figures; then ratios against ``bound``, ``fsdp2``, ``fsdp2_bf16`` and ``ddp``
(``ratio_vs_X``: median step / X's median step; ``paired_ratio_vs_X``: median over rounds of the ratio
within a round), and the bytes sent per rank per step against the ZeRO-3 model ``3 (K-1)/K x P`` (P: the
fp32 parameter bytes; DDP: ``2 (K-1)/K x P``).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import perparam
from benchmarks.harness.configs import DESCRIPTIONS

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ("bound", "ddp", "fsdp2", "fsdp2_bf16")


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = (lambda f: xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]) if xs else (lambda f: math.nan)
    return {"median": statistics.median(xs) if xs else math.nan, "p10": q(0.1), "p90": q(0.9),
            "min": xs[0] if xs else math.nan, "n": len(xs)}


def summarise(name: str, per_rank: list[dict], rss: list[dict] | None, world: int,
              rss_returning: list[dict] | None = None) -> dict:
    """One configuration's figures from every rank's timing record and memory-run record."""
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
    cpu = [statistics.mean(r["cpu"][i] for r in recs) for i in range(n)]
    out["cpu_time_s"] = statistics.median(cpu)
    out["cpu_times_s"] = cpu
    out["page_faults_per_step"] = statistics.median(statistics.mean(r["faults"][i] for r in recs)
                                                    for i in range(n))
    out["final_loss"] = statistics.mean(r["losses"][-1] for r in recs)
    out["model_state_bytes"] = rec0["model_state_bytes"]
    out["model_state_bytes_per_rank"] = [r["model_state_bytes"]["total"] for r in recs]
    last = rec0["comm"][-1]
    if name == "bound":
        comm, calls, source = {}, {}, "none: no collectives"
    elif name == "ddp":
        comm, calls = {"all_reduce": rec0["param_bytes_unsharded"]}, None
        source = "computed: gradient bytes (DDP all-reduces its buckets in C++, not visible to Python)"
    elif name.startswith("fsdp2"):
        comm, calls = last["dist_bytes"], last["dist_calls"]
        source = "torch.distributed wrappers (all_gather_single, reduce_scatter_single, ...)"
    else:
        comm, calls = last["perparam_counter"], last["perparam_counter_calls"]
        source = "perparam.CommCounter"
        # cross-check at the torch.distributed level (all-gathers and reduce-scatters are all-to-alls on gloo)
        out["comm_bytes_per_step_dist_wrappers"] = last["dist_bytes"]
        out["comm_sent_bytes_per_rank_dist_wrappers"] = last["dist_sent"]
    out["comm_bytes_per_step"] = {**comm, "total": sum(comm.values())}
    # bytes sent by each rank: (K-1)/K of the recorded bytes for an all-gather or reduce-scatter (ring or
    # all-to-all), 2 (K-1)/K for a ring all-reduce (a reduce-scatter then an all-gather)
    out["comm_sent_bytes_per_rank"] = sum(v * (2 if k == "all_reduce" else 1)
                                          for k, v in comm.items()) * (world - 1) / world
    out["collectives_per_step"] = calls
    out["comm_source"] = source
    out["comm_constant_over_steps"] = all(c == last for c in rec0["comm"])
    if rss:
        ok = [r for r in rss if r.get("status") == "ok"]
        if ok:
            out["peak_rss_bytes"] = max(max(r["build_peak"], r["training_peak"]) for r in ok)
            out["training_peak_rss_bytes"] = [r["training_peak"] for r in ok]  # per rank
            out["rss_baseline_bytes_per_rank"] = [r["baseline"] for r in ok]
            out["rss_after_build_bytes_per_rank"] = [r["built"] for r in ok]
            out["build_peak_rss_bytes_per_rank"] = [r["build_peak"] for r in ok]
            out["training_peak_over_baseline_bytes"] = max(r["training_peak"] - r["baseline"] for r in ok)
            out["rss_profile_rank0"] = ok[0]["profile"]
            if "pool_idle_bytes" in ok[0]:
                out["pool_idle_bytes_per_rank"] = [r["pool_idle_bytes"] for r in ok]
                out["group_unsharded_bytes"] = ok[0]["group_unsharded_bytes"]
    ok = [r for r in rss_returning or [] if r.get("status") == "ok"]
    if ok:  # the same memory run under a returning allocator (step_time.py --mmap-threshold)
        out["training_peak_rss_bytes_returning"] = [r["training_peak"] for r in ok]
        out["training_peak_over_baseline_bytes_returning"] = max(r["training_peak"] - r["baseline"]
                                                                 for r in ok)
    return out


def add_ratios(configs: dict, param_bytes: int, world: int) -> None:
    """``ratio_vs_X``, ``paired_ratio_vs_X``, ``cpu_ratio_vs_X`` for X in ``BASELINES``; memory ratios; the
    communication model. ``None`` where X did not run."""
    for c in configs.values():
        if c["status"] != "ok":
            continue
        for base_name in BASELINES:
            base = configs.get(base_name, {})
            ok = base.get("status") == "ok"
            tag = base_name
            c[f"ratio_vs_{tag}"] = c["step_time_s"]["median"] / base["step_time_s"]["median"] if ok else None
            # the same ratio within each round (both steps ran seconds apart), then the median
            c[f"paired_ratio_vs_{tag}"] = (
                statistics.median(a / b for a, b in zip(c["step_times_s"], base["step_times_s"]))
                if ok else None)
            c[f"cpu_ratio_vs_{tag}"] = (
                statistics.median(a / b for a, b in zip(c["cpu_times_s"], base["cpu_times_s"]))
                if ok else None)
            if base_name in ("ddp", "fsdp2"):
                c[f"memory_ratio_vs_{tag}"] = (c["model_state_bytes"]["total"]
                                               / base["model_state_bytes"]["total"]
                                               if ok else None)
                both = (ok and "training_peak_over_baseline_bytes" in c
                        and "training_peak_over_baseline_bytes" in base)
                c[f"training_peak_ratio_vs_{tag}"] = (c["training_peak_over_baseline_bytes"]
                                                      / base["training_peak_over_baseline_bytes"] if both
                                                      else None)
                key = "training_peak_over_baseline_bytes_returning"
                c[f"training_peak_ratio_vs_{tag}_returning"] = (c[key] / base[key]
                                                                if ok and key in c and key in base
                                                                else None)
        zero3 = 3 * (world - 1) / world * param_bytes
        c["comm_model_bytes_per_rank"] = {"zero3": zero3, "ddp": 2 * (world - 1) / world * param_bytes}
        c["comm_sent_vs_zero3_model"] = c["comm_sent_bytes_per_rank"] / zero3


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
            "git_commit": commit, "perparam_dirty": dirty, **bf16_speed()}


def bf16_speed() -> dict:
    """``bf16_matmul_slowdown``: how many times longer a one-thread ``[128, 128]`` bf16 matmul takes than the
    fp32 one (``perparam.finetune.throughput``, as ``perparam finetune`` measures it); ``bf16_emulated``:
    above its threshold (no AVX-512 BF16/AMX: torch emulates bf16, issue 24 measured 20x)."""
    from perparam.finetune.throughput import BF16_EMULATED_ABOVE, time_matmul

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs
    try:
        cpu = torch.device("cpu")
        slowdown = time_matmul(cpu, torch.bfloat16) / time_matmul(cpu, torch.float32)
    finally:
        torch.set_num_threads(threads)
    return {"bf16_matmul_slowdown": slowdown, "bf16_emulated": slowdown > BF16_EMULATED_ABOVE}


def bf16_note(machine: dict) -> str | None:
    """The line under the table when the bf16 rows ran emulated (``machine``: ``meta["machine"]``), else
    None."""
    if not machine.get("bf16_emulated"):
        return None
    return (f"bf16 rows (marked *) ran emulated: a bf16 matmul took {machine['bf16_matmul_slowdown']:.1f}x "
            "the fp32 time on this CPU (no native bf16: AVX-512 BF16/AMX); they say nothing of bf16 on "
            "hardware that has it")


def row_name(name: str, machine: dict) -> str:
    """``name``, with ``*`` when it computes in bf16 and bf16 ran emulated here (:func:`bf16_note`)."""
    return f"{name} *" if machine.get("bf16_emulated") and "bf16" in name else name


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    meta = result["meta"]
    console = Console() if sys.stdout.isatty() else Console(width=190)
    oversub = (" (oversubscribed: more ranks than cores)" if meta["world_size"] > meta["machine"]["nproc"]
               else "")
    table = Table(title=f"{meta['world_size']} ranks x 1 thread (gloo){oversub}, "
                        f"{meta['model_params'] / 1e6:.1f}M params, batch "
                        f"{meta['batch_per_rank']}x{meta['model']['seq']} per rank, median of "
                        f"{meta['steps']} interleaved steps")
    cols = ("config", "step ms (p10-p90)", "fwd/bwd/opt ms", "vs bound", "vs DDP", "paired vs FSDP2",
            "paired vs FSDP2 bf16", "CPU ms", "faults", "state MiB", "train peak MiB (+base)",
            "sent MiB/rank", "vs ZeRO-3", "loss")
    for col in cols:
        table.add_column(col, justify="left" if col == "config" else "right")
    for name, c in result["configs"].items():
        shown = row_name(name, meta["machine"])
        if c["status"] != "ok":
            table.add_row(shown, c["status"], *[""] * (len(cols) - 2))
            continue
        st, ph = c["step_time_s"], c["phase_time_s"]
        peak = (f"{max(c['training_peak_rss_bytes']) / mib:.0f} "
                f"(+{c['training_peak_over_baseline_bytes'] / mib:.0f})"
                if "training_peak_rss_bytes" in c else "-")
        table.add_row(
            shown, f"{st['median'] * 1e3:.0f} ({st['p10'] * 1e3:.0f}-{st['p90'] * 1e3:.0f})",
            "/".join(f"{ph[p] * 1e3:.0f}" for p in ("forward", "backward", "optimizer")),
            _ratio(c["ratio_vs_bound"]), _ratio(c["ratio_vs_ddp"]), _ratio(c["paired_ratio_vs_fsdp2"]),
            _ratio(c["paired_ratio_vs_fsdp2_bf16"]), f"{c['cpu_time_s'] * 1e3:.0f}",
            f"{c['page_faults_per_step']:.0f}", f"{c['model_state_bytes']['total'] / mib:.1f}", peak,
            f"{c['comm_sent_bytes_per_rank'] / mib:.1f}", _ratio(c["comm_sent_vs_zero3_model"]),
            f"{c['final_loss']:.4f}")
    console.print(table)
    if bf16_note(meta["machine"]):
        console.print(bf16_note(meta["machine"]))
    la = meta["loadavg"]
    console.print(f"load average (1 min) during the timing run: min {la['min']:.2f}, mean {la['mean']:.2f}, "
                  f"max {la['max']:.2f} on {meta['machine']['nproc']} CPUs ({meta['machine']['cpu_model']})")
    _render_profiles(console, result)
    for name, c in result["configs"].items():
        if c["status"] != "ok":
            console.print(f"[yellow]{name}: {c['status']}[/]: "
                          f"{str(c.get('reason', '')).strip().splitlines()[-1]}")


def _render_profiles(console, result: dict) -> None:
    """RSS through one step (rank 0), per phase: peak over the pre-build baseline, MiB; and the training
    peak of the same run under a returning allocator (``--mmap-threshold``), larger rank."""
    from rich.table import Table

    mib = 1 << 20
    rows = {n: c for n, c in result["configs"].items() if "rss_profile_rank0" in c}
    if not rows:
        return
    phases = ("forward", "backward", "optimizer", "end")
    table = Table(title="RSS through one step, rank 0: MiB over the pre-build baseline (phase start -> peak)")
    for col in ("config", "after build", *phases, "training peak", "peak, returning allocator (max rank)"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for name, c in rows.items():
        base = c["rss_baseline_bytes_per_rank"][0]
        by_phase = {p["phase"]: p for p in c["rss_profile_rank0"]}
        cells = [f"{(by_phase[p]['start'] - base) / mib:.0f} -> {(by_phase[p]['peak'] - base) / mib:.0f}"
                 if p in by_phase else "-" for p in phases]
        returning = c.get("training_peak_over_baseline_bytes_returning")
        table.add_row(name, f"{(c['rss_after_build_bytes_per_rank'][0] - base) / mib:.0f}", *cells,
                      f"{(c['training_peak_rss_bytes'][0] - base) / mib:.0f}",
                      "-" if returning is None else f"{returning / mib:.0f}")
    console.print(table)
