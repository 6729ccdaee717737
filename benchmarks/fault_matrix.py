"""The fault matrix of the main job: ``perparam finetune --invariant-units 8`` (tiny config, 4 ranks on this
node, 12 steps, ``--save`` every 4) with one worker SIGKILLed or SIGSTOPped from outside, rank 0, a middle
rank or the last, in forward, backward, the optimizer step, the snapshot commit or the disk checkpoint's
write; each fault recovered from the in-memory snapshots (``--max-restarts 1``: respawned, same K) and,
beside it, by running the command again with ``--resume`` from the last disk checkpoint.

    python -m benchmarks.fault_matrix [--quick] [--signals SIGKILL,SIGSTOP] [--victims first,middle,last]
        [--phases forward,backward,step,commit,save] [--step 7] [--bound 5] [--no-disk] [--json out.json]

Per case: the final bits against the uninterrupted run (every parameter and AdamW tensor of the final
checkpoint, the GGUF, the reported losses, by sha256), the completed (committed) steps lost, the steps
recomputed, and the seconds from the signal to the first completed step after it, split into detection (the
survivors learn of the fault: at once for a dead rank, within ``--bound``, the step watchdog's, for a stopped
one), restart (the new workers start), restore (imports, process group, model, ``State.restore()`` or the
checkpoint's load) and the first step. The compute phases and the commit are those of step ``--step``; the
save is the write of the next ``--save`` checkpoint after it. ``--quick``: 4 cases (rank 0 SIGKILLed in the
commit, the last rank SIGSTOPped in the save, a middle rank SIGKILLed in forward and SIGSTOPped in the
optimizer step). The JSON is rewritten after each case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness.fault_traps import PHASES
from benchmarks.harness.finetune_faults import (
    REPO,
    SIGNALS,
    Case,
    Job,
    clean,
    from_disk,
    from_snapshot,
    uninterrupted,
    write_text,
)

QUICK = (
    ("SIGKILL", "first", "commit"),
    ("SIGSTOP", "last", "save"),
    ("SIGKILL", "middle", "forward"),
    ("SIGSTOP", "middle", "step"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 4 cases of the module docstring")
    ap.add_argument("--signals", default="SIGKILL,SIGSTOP")
    ap.add_argument("--victims", default="first,middle,last", help="first, middle, last, or rank numbers")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument(
        "--step", type=int, default=7, help="the 1-based step of the compute phases and the commit"
    )
    ap.add_argument("--bound", type=float, default=5.0, help="--step-timeout: the watchdog's bound (s)")
    ap.add_argument("--no-disk", action="store_true", help="leave out the recovery from the disk checkpoint")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    args = ap.parse_args(argv)
    job = Job(bound=args.bound)
    if not 1 < args.step < job.steps:
        ap.error(f"--step {args.step}: between 2 and {job.steps - 1}")
    bad = [s for s in args.signals.split(",") if s not in SIGNALS] + [
        p for p in args.phases.split(",") if p not in PHASES
    ]
    if bad:
        ap.error(f"unknown signal or phase: {bad}")
    return args


def rank_of(victim: str, nproc: int) -> int:
    return (
        {"first": 0, "middle": nproc // 2, "last": nproc - 1}.get(victim)
        if not victim.isdigit()
        else int(victim)
    )


def cases(args: argparse.Namespace, job: Job) -> list[Case]:
    save_step = (args.step // job.save_every + 1) * job.save_every  # the next checkpoint's write
    chosen = (
        QUICK
        if args.quick
        else [
            (s, v, p)
            for s in args.signals.split(",")
            for v in args.victims.split(",")
            for p in args.phases.split(",")
        ]
    )
    return [Case(s, rank_of(v, job.nproc), p, save_step if p == "save" else args.step) for s, v, p in chosen]


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _git() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def _yes(bits: dict | None) -> str:
    if not bits:
        return "-"
    return "equal" if all(bits[k] for k in ("params", "optimizer", "gguf", "reported")) else "DIFFER"


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"fault matrix: {result['job']['nproc']} ranks, {result['job']['steps']} steps, snapshot "
        f"recovery (--max-restarts 1) | disk (--resume); seconds from the signal"
    )
    for col in (
        "signal",
        "rank",
        "phase",
        "bits",
        "lost",
        "recomp.",
        "detect",
        "restart",
        "restore",
        "1st step",
        "total",
        "disk bits",
        "disk recomp.",
        "disk detect",
        "disk restart",
        "disk restore",
        "disk 1st step",
        "disk total",
    ):
        table.add_column(col, justify="left" if col in ("signal", "phase") else "right")
    for entry in result["cases"]:
        c, snap, disk = entry["case"], entry["snapshot"], entry.get("disk") or {}
        s, d = snap.get("seconds") or {}, disk.get("seconds") or {}
        row = [
            c["signal"],
            str(c["victim"]),
            c["phase"] + ("" if c["phase"] != "save" else f" ({c['step']})"),
            _yes(snap.get("bits")) if "error" not in snap else f"exit {snap['exit']}",
            str(snap.get("lost", "-")),
            str(snap.get("recomputed", "-")),
            *(_s(s.get(k)) for k in ("detection", "restart", "restore", "first_step", "total")),
            (_yes(disk.get("bits")) if "error" not in disk else f"exit {disk.get('resumed_exit')}")
            if disk
            else "-",
            str(disk.get("recomputed", "-")),
            *(_s(d.get(k)) for k in ("detection", "restart", "restore", "first_step", "total")),
        ]
        table.add_row(*row)
    Console(width=200).print(table)


def markdown(result: dict) -> str:
    """The table of ``benchmarks/README.md``: one row per case, seconds from the signal."""
    head = (
        "| signal | rank | phase | bits | lost | recomputed | detection | restart | restore (`restore()`) "
        "| first step | total | disk: bits | recomputed | detection | restart | restore | first step "
        "| total |"
    )
    disk_run = any("disk" in entry for entry in result["cases"])
    if not disk_run:  # --no-disk
        head = head.split(" disk: bits |")[0]
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for entry in result["cases"]:
        c, snap, disk = entry["case"], entry["snapshot"], entry.get("disk") or {}
        s, d = snap.get("seconds") or {}, disk.get("seconds") or {}
        restore = f"{_s(s.get('restore'))} ({_s(snap.get('restore_call_s'))})"
        rows.append(
            "| "
            + " | ".join(
                [
                    c["signal"],
                    str(c["victim"]),
                    c["phase"] + (f" (step {c['step']})" if c["phase"] == "save" else ""),
                    _yes(snap.get("bits")) if "error" not in snap else "failed",
                    str(snap.get("lost", "-")),
                    str(snap.get("recomputed", "-")),
                    _s(s.get("detection")),
                    _s(s.get("restart")),
                    restore,
                    _s(s.get("first_step")),
                    f"**{_s(s.get('total'))}**",
                    (_yes(disk.get("bits")) if "error" not in disk else "failed") if disk else "-",
                    str(disk.get("recomputed", "-")),
                    *(_s(d.get(k)) for k in ("detection", "restart", "restore", "first_step")),
                    f"**{_s(d.get('total'))}**",
                ][: None if disk_run else 11]
            )
            + " |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    job = Job(bound=args.bound)
    todo = cases(args, job)
    out = Path(tempfile.mkdtemp(prefix="perparam-fault-matrix-"))
    result = {
        "command": "python -m benchmarks.fault_matrix " + " ".join(sys.argv[1:] if argv is None else argv),
        "git": _git(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_start": _load(),
        "job": asdict(job),
        "cases": [],
    }
    try:
        text = write_text(out / "text")
        straight = uninterrupted(job, text, out)
        result["uninterrupted_wall_s"] = round(straight["wall_s"], 1)
        print(f"uninterrupted run: {straight['wall_s']:.1f} s (load {_load()})", flush=True)
        for case in todo:
            began = time.time()
            entry = {"case": asdict(case), "load": _load()}
            try:
                entry["snapshot"] = from_snapshot(case, job, text, out, straight["fingerprint"])
            except RuntimeError as exc:
                entry["snapshot"] = {"exit": None, "error": str(exc)[-2000:]}
            if not args.no_disk:
                try:
                    entry["disk"] = from_disk(case, job, text, out, straight["fingerprint"])
                except RuntimeError as exc:
                    entry["disk"] = {"exit": None, "error": str(exc)[-2000:]}
            entry["wall_s"] = round(time.time() - began, 1)
            result["cases"].append(entry)
            snap = entry["snapshot"]
            print(
                f"{case.name} step {case.step}: snapshot {_yes(snap.get('bits'))}, lost {snap.get('lost')}, "
                f"recomputed {snap.get('recomputed')}, seconds {snap.get('seconds')}"
                + (
                    f"; disk {_yes(entry['disk'].get('bits'))}, "
                    f"recomputed {entry['disk'].get('recomputed')}, "
                    f"seconds {entry['disk'].get('seconds')}"
                    if "disk" in entry
                    else ""
                )
                + (f"\n  error: {snap['error'][-600:]}" if "error" in snap else "")
                + (
                    f"\n  disk error: {entry['disk']['error'][-600:]}"
                    if "error" in entry.get("disk", {})
                    else ""
                )
                + f" ({entry['wall_s']} s, load {entry['load']})",
                flush=True,
            )
            result["load_end"] = _load()
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        clean(out)
    render(result)
    if args.markdown:
        print(markdown(result))
    return result


if __name__ == "__main__":
    main()
