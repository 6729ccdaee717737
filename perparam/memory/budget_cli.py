"""``perparam plan --budget BYTES``: the offload plan of ``perparam.memory.budget`` on the command line."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from perparam.memory.budget import BudgetPlan, largest_first, parse_bytes, plan_budget, write_policy
from perparam.memory.plan import ModelPlan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=_budget_arg, default=None, metavar="BYTES",
                        help="device bytes of model state per rank (e.g. 20e9, 20GB, 16GiB): plan which "
                             "parameters' optimizer state / shard and gradient to offload with the least "
                             "traffic, then which take ZeRO stage 2 in the room left (fewer all-gathers; "
                             "docs/offload.md)")
    parser.add_argument("--tier", choices=["disk", "cpu"], default="disk",
                        help="with --budget: where offloaded state goes (default disk)")
    parser.add_argument("--offload-dir", default=None, metavar="DIR",
                        help="with --budget and --tier disk: the folder written into the policy (default: "
                             "the system's temporary folder)")
    parser.add_argument("--write-policy", default=None, metavar="FILE.json",
                        help="with --budget: write the plan; perparam.memory.budget.load_policy(FILE, model) "
                             "gives fully_shard's param_policy, perparam finetune --memory-budget plans the "
                             "same")


def _budget_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the budget flags, found before any planning (one line), or ``None``."""
    if args.budget is None:
        for flag, value in (("--write-policy", args.write_policy), ("--offload-dir", args.offload_dir)):
            if value is not None:
                return f"{flag} applies to an offload plan: add --budget BYTES (e.g. --budget 20GB)"
        return None
    if args.json:
        return "--budget prints its offload plan as text: drop --json (or --budget)"
    if args.write_policy is None:
        return None
    path = Path(args.write_policy)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        return f"--write-policy {path} is a folder: pass a file path, e.g. {path / 'plan.json'}"
    if not folder.is_dir():
        return f"--write-policy {path}: the folder {folder} does not exist; create it or pass another path"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"--write-policy {path} cannot be written (permission denied); pass a writable path"
    return None


def _line(b: BudgetPlan) -> str:
    return (f"{b.rule:>26}: keeps {b.max_kept / 1e9:9.4f} GB per rank, moves {b.max_moved / 1e9:9.4f} GB per "
            f"step, sends {b.collective_bytes / 1e9:9.4f} GB in all-gathers (device {b.by_place['device']}, "
            f"optimizer state {b.by_place['optimizer']}, all {b.by_place['all']} parameters; zero_stage 2: "
            f"{b.stage2})")


def run(args: argparse.Namespace, plan: ModelPlan, console) -> int:
    ours, baseline = plan_budget(plan, args.budget), largest_first(plan, args.budget)
    console.print(f"\noffload plan for a budget of {args.budget / 1e9:.4f} GB per rank (K = "
                  f"{plan.world_size}; without offload the largest rank keeps "
                  f"{plan.max_rank.total / 1e9:.4f} GB; tier {args.tier}):")
    console.print(_line(ours))
    console.print(_line(baseline))
    console.print(f"{'collectives':>26}: all-gathers sent per rank per step; offload changes no collective, "
                  "zero_stage 2 saves a parameter's backward all-gather for its unsharded copy in memory")
    if baseline.max_moved and ours.fits:
        console.print(f"{'':>26}  least traffic moves {ours.max_moved / baseline.max_moved:.3f} x the bytes "
                      "of largest parameters first")
    rows = [(name, place, ours.stages.get(name, 3)) for name, place in ours.places.items()
            if place != "device" or ours.stages.get(name, 3) != 3]
    if args.params_table and rows:
        console.print("\nparameter, place, zero_stage:")
        for name, place, stage in rows:
            console.print(f"  {name}  {place}  {stage}")
    if not ours.fits:
        print(f"perparam plan: {ours.message}", file=sys.stderr)
        return 1
    if args.write_policy:
        offload_dir = args.offload_dir or (tempfile.gettempdir() if args.tier == "disk" else None)
        write_policy(args.write_policy, ours, args.tier, offload_dir)
        console.print(f"\nwrote {args.write_policy}: fully_shard(..., param_policy=perparam.memory.budget."
                      f"load_policy({args.write_policy!r}, model)) applies it (offload folder {offload_dir})")
    return 0
