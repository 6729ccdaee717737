"""ZeRO stages per parameter measured against the chapter's formulas and timed against DDP and FSDP2.

    python -m benchmarks.zero_stages --quick [--worlds 2,4] [--json runs/bench/zero_stages.json]

Configurations (``benchmarks/harness/configs.py``), all trained from the same seeded weights on the same
batches, AdamW, fp32, wrapped as torchtitan wraps (embeddings, each block, ``[ln_f, head]`` kept from forward
to backward, root): ``ddp``; ``perparam_stage1``, ``perparam_stage2``, ``perparam`` (all stage 3) and
``perparam_mix`` (embeddings and norms stage 1, attention stage 2, MLP and head stage 3); ``fsdp2`` and
``fsdp2_keep`` (FSDP2 with ``reshard_after_forward=False``, its nearest to ZeRO-2).

Per K: the timing job of ``benchmarks/harness/runner.py`` (every configuration built in each rank, rounds of
one step of each, the order rotating; step time is the slower rank's; ``paired`` ratios are the median over
rounds of the ratio within a round), then one memory job per configuration in fresh processes (the
training-phase peak RSS over the pre-build baseline, the larger rank). Model state: rank 0's live bytes
after the last step (``perparam.memory.measure.model_state_bytes``; rank 0 holds ``torch.chunk``'s remainder
rows). Bytes sent per rank and step: ``CommCounter`` (perparam), the ``torch.distributed`` wrappers
(FSDP2), the gradient bytes (DDP, whose all-reduce runs in C++), converted as ``benchmarks/harness/report.py``
does. Formulas: ``benchmarks/harness/zero_formulas.py``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


CONFIGS = ("ddp", "perparam_stage1", "perparam_stage2", "perparam", "perparam_mix", "fsdp2", "fsdp2_keep")
LABELS = {"ddp": "DDP", "perparam_stage1": "stage 1", "perparam_stage2": "stage 2", "perparam": "stage 3",
          "perparam_mix": "mix 1/2/3", "fsdp2": "FSDP2", "fsdp2_keep": "FSDP2 raf=False"}
PAIRED = ("ddp", "fsdp2", "fsdp2_keep")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated K (default 2,4)")
    ap.add_argument("--quick", action="store_true", help="the quick model (seconds per K)")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--rss-steps", type=int, default=3, help="steps of each memory job (default 3)")
    ap.add_argument("--no-rss", action="store_true", help="skip the memory jobs")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown or not args.configs:
        ap.error(f"--configs: unknown configurations {unknown}; choose from {','.join(CONFIGS)}")
    try:
        args.worlds = [int(w) for w in args.worlds.split(",") if w]
    except ValueError:
        ap.error(f"--worlds: expected comma-separated integers such as 2,4, got {args.worlds!r}")
    if not args.worlds or min(args.worlds) < 2:
        ap.error(f"--worlds: each K must be at least 2, got {args.worlds}")
    if args.steps < 1 or args.warmup < 0 or args.rss_steps < 1:
        ap.error("--steps and --rss-steps must be at least 1, --warmup at least 0")
    return args


def _paired(c: dict, base: dict | None) -> float | None:
    if base is None or base.get("status") != "ok":
        return None
    return statistics.median(a / b for a, b in zip(c["step_times_s"], base["step_times_s"]))


def run_world(world: int, cfg, args: argparse.Namespace) -> dict:
    """Every configuration on ``world`` ranks: the summary of ``benchmarks/harness/report.py`` plus the
    formulas."""
    from benchmarks.harness.configs import seeded_full_init
    from benchmarks.harness.launch import launch
    from benchmarks.harness.model import num_params
    from benchmarks.harness.report import add_ratios, summarise
    from benchmarks.harness.zero_formulas import formulas

    opts = {"model": cfg.as_dict(), "configs": args.configs, "steps": args.steps, "warmup": args.warmup,
            "seed": 0, "batch_per_rank": 2, "rss_steps": args.rss_steps, "timeout": 900}
    load_start = os.getloadavg()
    per_rank = launch("timing", opts, world)
    rss = {}
    if not args.no_rss:
        for name in args.configs:
            if per_rank[0]["configs"][name]["status"] == "ok":
                rss[name] = launch("rss", {**opts, "config": name, "mmap_threshold": None}, world)
    model = seeded_full_init(cfg, 0)
    configs = {name: summarise(name, per_rank, rss.get(name), world) for name in args.configs}
    add_ratios(configs, 4 * num_params(model), world)
    for name, c in configs.items():
        if c["status"] == "ok":
            c["formula"] = formulas(name, model, world)
            c.update({f"paired_vs_{b}": _paired(c, configs.get(b)) for b in PAIRED})
    loads = [la[0] for la in per_rank[0]["loadavg"]]
    return {"world": world, "configs": configs,
            "loadavg": {"start": list(load_start), "end": list(os.getloadavg()),
                         "mean_during_timing": statistics.mean(loads)}}


def render(result: dict) -> None:
    """One table per K: state, bytes sent, training-phase peak RSS, step time and the paired ratios."""
    from rich.console import Console
    from rich.table import Table

    kib = 1024
    console = Console() if sys.stdout.isatty() else Console(width=200)
    cols = ("config", "state KiB", "Table 7-2 KiB", "x", "sent KiB", "paper KiB", "as run KiB", "x as run",
            "train peak MiB", "step ms", "paired vs DDP", "vs FSDP2", "vs FSDP2 raf=False")
    for w in result["worlds"]:
        la = w["loadavg"]
        table = Table(title=f"K = {w['world']} (load average {la['start'][0]:.1f} at start, "
                            f"{la['mean_during_timing']:.1f} mean during the timing run, {la['end'][0]:.1f} "
                            "at end)")
        for col in cols:
            table.add_column(col, justify="left" if col == "config" else "right")
        for name, c in w["configs"].items():
            if c["status"] != "ok":
                table.add_row(LABELS[name], c["status"], *[""] * (len(cols) - 2))
                continue
            f, state, sent = c["formula"], c["model_state_bytes"]["total"], c["comm_sent_bytes_per_rank"]
            peak = c.get("training_peak_over_baseline_bytes")
            table.add_row(
                LABELS[name], f"{state / kib:,.1f}", f"{f['state'] / kib:,.1f}", f"{state / f['state']:.3f}",
                f"{sent / kib:,.1f}", f"{f['sent_paper'] / kib:,.1f}", f"{f['sent_as_run'] / kib:,.1f}",
                f"{sent / f['sent_as_run']:.4f}", "-" if peak is None else f"{peak / 2 ** 20:.1f}",
                f"{c['step_time_s']['median'] * 1e3:.1f}",
                *("-" if c[f"paired_vs_{b}"] is None else f"{c[f'paired_vs_{b}']:.3f}" for b in PAIRED))
        console.print(table)
    for w in result["worlds"]:
        for name, c in w["configs"].items():
            if c["status"] != "ok":
                console.print(f"K = {w['world']} {name}: {c['status']}: "
                              f"{str(c.get('reason', '')).strip()[-400:]}")


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.harness.launch import write_json
    from benchmarks.harness.model import GPT, GPTConfig, num_params
    from benchmarks.harness.report import machine_info

    args = parse_args(argv)
    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    started = _dt.datetime.now(_dt.timezone.utc)
    result = {"meta": {"date": started.isoformat(timespec="seconds"),
                       "command": " ".join(["python -m benchmarks.zero_stages", *(argv or sys.argv[1:])]),
                       "machine": machine_info(), "model": cfg.as_dict(),
                       "model_params": num_params(GPT(cfg)), "steps": args.steps, "warmup": args.warmup,
                       "rss_steps": args.rss_steps},
              "worlds": [run_world(w, cfg, args) for w in args.worlds]}
    write_json(args.json, result, indent=1)
    render(result)
    return result


if __name__ == "__main__":
    main()
