"""How cost grows with the model: the step-time benchmark at several GPT sizes and world sizes.

    python -m benchmarks.scaling --sizes 27m,110m,350m --worlds 2,4 --json runs/bench/scaling.json
    python -m benchmarks.scaling --table runs/bench/scaling_*.json        # the markdown table again

Per size (``benchmarks/harness/model.py``'s ``SIZES``: 27.4M, 111.9M, 344.4M) and K, the timing job and the
memory jobs of ``benchmarks/harness/runner.py`` (the method of ``benchmarks/README.md``: every configuration
built in each rank, rounds of one step of each with the order rotating, paired ratios, CPU time; then each
configuration alone in fresh processes for the training-phase peak RSS), over ``ddp``, ``fsdp2`` and
``perparam`` by default. Every size runs the same tokens per rank (``--batch-per-rank`` x the context of
128), so compute and bytes both grow with the parameters and the ratios compare like with like; larger
sizes run fewer rounds (``ROUNDS``). A configuration whose memory does not fit next to the others
(``benchmarks/harness/fits.py``: the ZeRO formulas against ``MemAvailable``) is skipped with the bytes it
needs; should ``MemAvailable`` still fall under ``--floor-gb`` while a job runs, its ranks are killed and the
size is reported skipped (``fits.MemoryGuard``), not left to the kernel's OOM killer.

Reported per size and K: perparam's paired step ratio against FSDP2 and DDP (and the CPU-time ratio), CPU
per token, model state per rank against the ZeRO-3 model ``(P + G + O) / K``, bytes sent per rank against
the ZeRO-3 model ``(K - 1) / K x (G + 2P)`` (``perparam/memory/formulas.py``), the training-phase peak RSS
over the pre-build baseline, and the load average during the timing job. The JSON is rewritten after each
(size, K), so a run cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


from benchmarks.harness.configs import CONFIGS
from benchmarks.harness.model import SIZES, count_params, sized

DEFAULT_CONFIGS = ("ddp", "fsdp2", "perparam")
#: (timed rounds, warm-up rounds) per size unless --steps / --warmup say otherwise
ROUNDS = {"quick": (2, 1), "27m": (10, 2), "110m": (6, 1), "350m": (4, 1)}
MIB = 1 << 20


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; bad values exit with a one-line error naming the flag."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="27m,110m,350m",
                    help=f"comma-separated model sizes from {','.join(SIZES)}")
    ap.add_argument("--worlds", "-K", default="2,4", help="comma-separated K (default 2,4)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated subset of {','.join(CONFIGS)} (default "
                         f"{','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--steps", type=int, help="timed rounds for every size (default per size: ROUNDS)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first for every size (default per size)")
    ap.add_argument("--batch-per-rank", type=int, default=1,
                    help="sequences of 128 tokens per rank (default 1)")
    ap.add_argument("--rss-steps", type=int, default=2, help="steps of each memory job (default 2)")
    ap.add_argument("--no-rss", action="store_true", help="skip the memory jobs")
    ap.add_argument("--reserve-gb", type=float, default=2.0,
                    help="GB of MemAvailable left to the machine's other users (default 2)")
    ap.add_argument("--floor-gb", type=float, default=1.0,
                    help="kill the job's ranks when MemAvailable falls below this many GB (default 1)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before a job is killed")
    ap.add_argument("--json", type=Path, help="write the results here (after each size and K)")
    ap.add_argument("--table", type=Path, nargs="+", metavar="JSON",
                    help="print the markdown table of these result files and exit")
    args = ap.parse_args(argv)
    if args.table:
        return args
    try:
        args.sizes = [s.lower() for s in _csv(args.sizes)]
        for s in args.sizes:
            sized(s)
    except ValueError as e:
        ap.error(f"--sizes: {e}")
    try:
        args.worlds = [int(w) for w in _csv(args.worlds)]
    except ValueError:
        ap.error(f"--worlds: expected comma-separated integers such as 2,4, got {args.worlds!r}")
    if not args.sizes or not args.worlds or min(args.worlds) < 2:
        ap.error(f"--sizes and --worlds need at least one value each, every K at least 2 (got {args.worlds})")
    args.configs = _csv(args.configs)
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown or "perparam" not in args.configs:
        ap.error(f"--configs: must include perparam, from {','.join(CONFIGS)} (unknown: {unknown})")
    from benchmarks.harness.launch import check_counts

    check_counts(ap, args, ("steps", "batch_per_rank", "rss_steps"))
    return args


def _models(num_params: int, world: int) -> dict[str, dict[str, float]]:
    """The formulas' state per rank and bytes sent per rank and step, for DDP and ZeRO-3 (fp32 AdamW)."""
    from benchmarks.harness.fits import FP32_ADAMW
    from perparam.memory.formulas import stage_communication, stage_memory

    return {stage: {"state": float(stage_memory(stage, num_params, world, FP32_ADAMW).total),
                    "sent": float(stage_communication(stage, num_params, world, FP32_ADAMW).total)}
            for stage in ("DDP", "ZeRO-3")}


def _extend(name: str, c: dict, models: dict, tokens_per_rank: int) -> None:
    """Adds CPU per token and the figures against the formulas of the configuration's scheme."""
    if c["status"] != "ok":
        return
    model = models["DDP" if name in ("bound", "ddp") else "ZeRO-3"]
    c["cpu_per_token_s"] = c["cpu_time_s"] / tokens_per_rank
    c["state_model"] = "DDP" if name in ("bound", "ddp") else "ZeRO-3"
    c["state_model_bytes_per_rank"] = model["state"]
    c["state_vs_model"] = max(c["model_state_bytes_per_rank"]) / model["state"]
    c["sent_model_bytes_per_rank"] = model["sent"]
    c["sent_vs_model"] = c["comm_sent_bytes_per_rank"] / model["sent"] if model["sent"] else None


def run_one(size: str, world: int, args: argparse.Namespace) -> dict:
    """One size on ``world`` ranks: the configurations that fit, timed side by side, then their memory
    jobs."""
    from benchmarks.harness.fits import MemoryGuard, fitting, job_bytes, mem_available
    from benchmarks.harness.launch import launch
    from benchmarks.harness.report import add_ratios, summarise

    cfg = sized(size)
    params = count_params(cfg)
    steps, warmup = ROUNDS.get(size, ROUNDS["27m"])
    steps = args.steps if args.steps is not None else steps
    warmup = args.warmup if args.warmup is not None else warmup
    available = mem_available() - int(args.reserve_gb * 1e9)
    names, skipped = fitting(args.configs, params, world, available)
    out = {"size": size, "params": params, "world": world, "steps": steps, "warmup": warmup,
           "tokens_per_rank": args.batch_per_rank * cfg.seq, "model": cfg.as_dict(),
           "available_bytes": available, "needed_bytes": job_bytes(names, params, world), "skipped": skipped,
           "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if "perparam" not in names:
        out["status"] = "skipped"
        return out
    opts = {"model": cfg.as_dict(), "configs": names, "steps": steps, "warmup": warmup, "seed": 0,
            "batch_per_rank": args.batch_per_rank, "rss_steps": args.rss_steps, "timeout": args.timeout}
    t0, load_start = time.monotonic(), os.getloadavg()
    guard = MemoryGuard(int(args.floor_gb * 1e9))
    try:
        with guard:
            per_rank = launch("timing", opts, world)
            load_end = os.getloadavg()
            rss = {}
            if not args.no_rss:  # one configuration at a time: the machine's memory is the limit
                for name in names:
                    if per_rank[0]["configs"][name]["status"] == "ok":
                        rss[name] = launch("rss", {**opts, "config": name, "mmap_threshold": None}, world)
    except RuntimeError:
        if guard.tripped is None:
            raise
        out.update(status="skipped", skipped={**skipped, "job": guard.tripped})
        return out
    out["lowest_mem_available_bytes"] = guard.lowest
    configs = {name: summarise(name, per_rank, rss.get(name), world) for name in names}
    add_ratios(configs, 4 * params, world)
    models = _models(params, world)
    for name, c in configs.items():
        _extend(name, c, models, out["tokens_per_rank"])
    loads = [la[0] for la in per_rank[0]["loadavg"]]
    out.update(status="ok", configs=configs, formulas=models, wall_s=time.monotonic() - t0,
               loadavg={"start": list(load_start), "end": list(load_end), "min": min(loads),
                        "max": max(loads), "mean": statistics.mean(loads)})
    return out


def _cell(c: dict | None, fmt) -> str:
    if c is None:
        return "-"
    if c.get("status") != "ok":
        return "skipped"
    return fmt(c)


def _per_config(run: dict, fmt, names=("perparam", "fsdp2", "ddp")) -> str:
    return " / ".join(_cell(run.get("configs", {}).get(n)
                            or ({"status": "skipped"} if n in run["skipped"] else None), fmt) for n in names)


def _r(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(runs: list[dict]) -> str:
    """The table of ``benchmarks/README.md``: one row per size and K (perparam's figures against FSDP2 and
    DDP), then the reasons for what was skipped."""
    head = ("| size | K | rounds | perparam paired vs FSDP2 (CPU) | paired vs DDP (CPU) | step s perparam / "
            "FSDP2 / DDP | CPU us/token perparam / FSDP2 / DDP | state MiB/rank (x ZeRO-3 model) | sent "
            "MiB/rank (x ZeRO-3 model) | train peak over base MiB perparam / FSDP2 / DDP | load mean "
            "(min-max) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    notes = []
    for run in runs:
        label = f"{run['size']} ({run['params'] / 1e6:.1f}M)"
        if run["status"] != "ok":
            lines.append(f"| {label} | {run['world']} | skipped |" + " |" * 9)
        else:
            pp, la = run["configs"]["perparam"], run["loadavg"]
            lines.append(" | ".join([
                f"| {label}", str(run["world"]), f"{run['steps']}+{run['warmup']}",
                f"{_r(pp.get('paired_ratio_vs_fsdp2'))} ({_r(pp.get('cpu_ratio_vs_fsdp2'))})",
                f"{_r(pp.get('paired_ratio_vs_ddp'))} ({_r(pp.get('cpu_ratio_vs_ddp'))})",
                _per_config(run, lambda c: f"{c['step_time_s']['median']:.2f}"),
                _per_config(run, lambda c: f"{c['cpu_per_token_s'] * 1e6:.0f}"),
                f"{max(pp['model_state_bytes_per_rank']) / MIB:,.1f} ({pp['state_vs_model']:.3f})",
                f"{pp['comm_sent_bytes_per_rank'] / MIB:,.1f} ({pp['sent_vs_model']:.3f})",
                _per_config(run, lambda c: f"+{c['training_peak_over_baseline_bytes'] / MIB:,.0f}"
                            if "training_peak_over_baseline_bytes" in c else "-"),
                f"{la['mean']:.2f} ({la['min']:.2f}-{la['max']:.2f}) |"]))
        notes += [f"{run['size']} K={run['world']} {name}: {why}" for name, why in run["skipped"].items()]
        for name, c in run.get("configs", {}).items():
            if c["status"] != "ok":
                notes.append(f"{run['size']} K={run['world']} {name}: {c['status']}: "
                             f"{str(c.get('reason', '')).strip().splitlines()[-1:]}")
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> dict | None:
    from benchmarks.harness.launch import write_json
    from benchmarks.harness.report import machine_info

    args = parse_args(argv)
    if args.table:
        runs = [r for path in args.table for r in json.loads(path.read_text())["runs"]]
        print(markdown(runs))
        return None
    result = {"meta": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       "command": " ".join(["python -m benchmarks.scaling",
                                            *(sys.argv[1:] if argv is None else argv)]),
                       "machine": machine_info(), "configs": args.configs,
                       "batch_per_rank": args.batch_per_rank, "rss_steps": args.rss_steps,
                       "reserve_gb": args.reserve_gb},
              "runs": []}
    for size in args.sizes:
        for world in args.worlds:
            result["runs"].append(run_one(size, world, args))
            write_json(args.json, result, indent=1)
            print(markdown(result["runs"][-1:]), flush=True)
    print(markdown(result["runs"]))
    return result


if __name__ == "__main__":
    main()
