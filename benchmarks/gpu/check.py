"""A prepared check of perparam on one CUDA GPU, under 5 minutes, that measures on its first run: each
section runs on its own (one that fails leaves its error and what it measured, and the next one starts) and
the JSON is rewritten after each section.

    python -m benchmarks.gpu.check --json runs/bench/gpu_check.json [--sections parity,step_time] [--quick]

Sections (``sections.py``; ``simulated`` in ``simulated.py``, ``two_ranks`` in ``two_ranks.py``; a section is
``section(out: dict, args)``), in order, with their budget on an H200 (the 27M benchmark model, 20 timed
steps):

``environment`` (1 s)
    torch, CUDA, NCCL versions; the c10d names chosen (``perparam/comm/c10d.py``); the private or recent torch
    APIs perparam uses that this torch lacks (``missing_apis``); ``not_checked``: what one GPU cannot show.
``simulated`` (20 s)
    Memory against the planner: rank ``--sim-rank`` of a fake ``--sim-world``-rank mesh (torch's fake process
    group: collectives move no data, allocations are real), bf16 compute, ``--sim-steps`` AdamW steps:
    model-state bytes measured (``perparam.memory.measure``) vs predicted (``perparam.memory.plan``), the two
    largest adjacent groups unsharded, on CUDA the peak allocated bytes of the last step and its transient
    part.
``parity`` (20 s)
    perparam vs torch FSDP2, fp32, the same weights and batch, 3 AdamW steps, world of one: the largest
    parameter and loss differences (``within_1e-5``).
``step_time`` (60 s)
    perparam and FSDP2 (bf16 params, fp32 reduce) and DDP (bf16 autocast), interleaved steps: medians,
    ratios, the CUDA streams of one step (torch.profiler).
``host_syncs`` (15 s)
    One step of perparam and of FSDP2, forward + backward, ``clip_grad_norm_`` (the norm unread) and the
    optimizer step apart: the host reads and host-data uploads by site (``benchmarks/harness/host_syncs.py``)
    and ``torch.cuda.set_sync_debug_mode("warn")``'s warnings.
``two_ranks`` (60 s)
    Two processes on gloo with the tensors on GPU 0 (NCCL refuses two ranks on one GPU): the toy model against
    one process (``within_1e-5``), collective counts, the order of first use of the process groups on each
    rank (``same_first_use_order``).
``cpu_tier`` (60 s)
    ``OffloadPolicy("cpu", "optimizer")`` against no offload: step times, CUDA memory between steps, bitwise
    parameters, the host's copy waits, whether the offloaded state reads its values between steps (as
    ``optimizer.state[p][key]`` and through ``state_dict()``).

Then the sections of ``benchmarks/gpu/accelerate.py`` when that file exists (its ``SECTIONS``, a list of
``(name, section)``, or its ``run(out, args)`` as ``accelerate``, 40 s), and any given to ``main(extra=)``.
Every section's dict gets ``ok``, ``seconds``, ``budget_s`` and ``over_budget`` (``BUDGET_S``) and, on
failure, ``error`` and ``traceback``; the top level ``wall_s``, ``budget_s`` (the sum, 276 s for all) and
``over_total_budget`` (past 5 minutes). With ``--device cpu`` every section runs on a gloo world of one on
CPU (what ``tests/test_gpu_check.py`` runs: the plumbing, not the figures).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu import sections, simulated, two_ranks
from benchmarks.harness.model import GPTConfig

Section = Callable[[dict, argparse.Namespace], None]

#: each section's time budget on an H200 (seconds; the docstring's figures): written with its result as
#: ``budget_s``, and ``over_budget`` when it took longer; the whole check's ``budget_s`` is their sum
BUDGET_S = {"environment": 1, "simulated": 20, "parity": 20, "step_time": 60, "host_syncs": 15,
            "two_ranks": 60, "cpu_tier": 60, "accelerate": 40}
TOTAL_BUDGET_S = 300  # five minutes, NCCL start-up and the interpreter included

SECTIONS: list[tuple[str, Section]] = [
    ("environment", sections.environment),
    ("simulated", simulated.simulated),
    ("parity", sections.parity),
    ("step_time", sections.step_time),
    ("host_syncs", sections.host_syncs),
    ("two_ranks", two_ranks.two_ranks),
    ("cpu_tier", sections.cpu_tier),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad value exits with a one-line error naming the flag."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--sim-world", type=int, default=8, help="ranks of the simulated mesh (default 8)")
    ap.add_argument("--sim-rank", type=int, default=0,
                    help="the simulated rank measured (default 0: the most bytes)")
    ap.add_argument("--sim-steps", type=int, default=2,
                    help="training steps on the simulated mesh (default 2)")
    ap.add_argument("--steps", type=int, default=20, help="timed NCCL steps per configuration (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed NCCL steps first (default 3)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default); cpu runs every section on a gloo world of one on CPU")
    ap.add_argument("--quick", action="store_true", help="the toy model (GPTConfig.quick())")
    ap.add_argument("--sections", help="comma-separated section names to run (default: all)")
    args = ap.parse_args(argv)
    for flag in ("sim_world", "sim_steps", "steps", "batch"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    if not 0 <= args.sim_rank < args.sim_world:
        ap.error(f"--sim-rank must be in [0, --sim-world) = [0, {args.sim_world}) (got {args.sim_rank})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu to run the sections on CPU")
    return args


def extra_sections() -> list[tuple[str, Section]]:
    """The sections of ``benchmarks/gpu/accelerate.py`` if it exists: its ``SECTIONS`` or its ``run`` as
    ``accelerate``; none otherwise. An import error becomes a section that raises it (reported, not fatal)."""
    if not (Path(__file__).parent / "accelerate.py").exists():
        return []
    try:
        module = importlib.import_module("benchmarks.gpu.accelerate")
    except Exception as e:  # reported as that section's error
        def failed(out, args, e=e):
            raise e
        return [("accelerate", failed)]
    if hasattr(module, "SECTIONS"):
        return list(module.SECTIONS)
    return [("accelerate", module.run)]


def _call(section: Section, out: dict, args: argparse.Namespace) -> None:
    params = inspect.signature(section).parameters
    section(out, args) if len(params) > 1 else section(out)


def _clean_up() -> None:
    """What a failed section may leave: its process group, CUDA memory, a sync debug mode."""
    gc.collect()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.empty_cache()


def _write(result: dict, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def run_sections(sections: list[tuple[str, Section]], args: argparse.Namespace, result: dict,
                 path: Path | None = None) -> dict:
    """Run each ``(name, section)`` on its own into ``result[name]`` (``ok``, ``seconds``; on failure
    ``error`` and ``traceback``), rewriting ``path`` after each; one line per section on stdout."""
    for name, section in sections:
        out = result.setdefault(name, {})
        t0 = time.perf_counter()
        try:
            _call(section, out, args)
            out["ok"] = True
        except BaseException as e:  # noqa: BLE001 (a section's failure, even SystemExit, is its own)
            if isinstance(e, KeyboardInterrupt):
                raise
            out["ok"] = False
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc()[-4000:]
        finally:
            out["seconds"] = round(time.perf_counter() - t0, 2)
            if name in BUDGET_S:
                out["budget_s"] = BUDGET_S[name]
                out["over_budget"] = out["seconds"] > BUDGET_S[name]
            _clean_up()
            result["wall_s"] = round(time.perf_counter() - result["_t0"], 2)
            result["over_total_budget"] = result["wall_s"] > TOTAL_BUDGET_S
            _write({k: v for k, v in result.items() if k != "_t0"}, path)
        print(f"gpu_check: {name}: {'ok' if out['ok'] else 'FAILED ' + out['error']} ({out['seconds']} s)",
              flush=True)
    return result


def main(argv: list[str] | None = None, extra: list[tuple[str, Section]] | None = None) -> dict:
    """Run the sections (``--sections`` picks some), then ``extra_sections()`` and ``extra``; returns the
    result dict (also written to ``--json``)."""
    args = parse_args(argv)
    sections = SECTIONS + extra_sections() + list(extra or [])
    if args.sections:
        wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {n for n, _ in sections})
        if unknown:
            raise SystemExit(f"gpu_check: --sections: unknown {unknown}; the sections are "
                             f"{[n for n, _ in sections]}")
        sections = [(n, s) for n, s in sections if n in wanted]
    cfg = GPTConfig.quick() if args.quick else GPTConfig()
    result = {"_t0": time.perf_counter(), "model": cfg.as_dict(), "device_arg": args.device,
              "budget_s": sum(BUDGET_S.get(n, 0) for n, _ in sections)}
    run_sections(sections, args, result, args.json)
    result.pop("_t0")
    try:
        _render(result)
    except Exception as e:  # the JSON is what counts
        print(f"gpu_check: the summary table failed ({type(e).__name__}: {e})")
    return result


def _render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    table = Table(title=f"gpu_check on {result.get('environment', {}).get('device', result['device_arg'])}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    sim = result.get("simulated", {})
    if "model_state_bytes_measured" in sim:
        meas, pred = sim["model_state_bytes_measured"], sim["model_state_bytes_predicted"]
        for key in ("params", "grads", "optimizer", "total"):
            table.add_row(f"simulated rank {sim['rank']}/{sim['world']} model state {key}: measured / "
                          "planned MiB",
                          f"{meas[key] / mib:.2f} / {pred[key] / mib:.2f}")
        if "peak_allocated_bytes" in sim:
            table.add_row("peak allocated in a step / transient MiB",
                          f"{sim['peak_allocated_bytes'] / mib:.1f} / {sim['transient_bytes'] / mib:.1f}")
    for name, key in (("parity", "max_param_diff"), ("two_ranks", "max_param_diff")):
        if key in result.get(name, {}):
            table.add_row(f"{name}: largest parameter difference (fp32)", f"{result[name][key]:.3g}")
    st = result.get("step_time", {})
    for name in ("perparam_bf16", "fsdp2_bf16", "ddp_autocast_bf16"):
        if name in st:
            table.add_row(f"{name} step ms", f"{st[name]['step_time_s'] * 1e3:.2f}")
    for key in ("ratio_perparam_vs_fsdp2", "ratio_perparam_vs_ddp"):
        if key in st:
            table.add_row(key, f"{st[key]:.2f}")
    for name, row in result.get("host_syncs", {}).items():
        if isinstance(row, dict) and "forward_backward" in row:
            fb = row["forward_backward"]
            table.add_row(f"{name} host syncs in forward+backward (counted / sync-debug warnings)",
                          f"{fb['counted']} / {fb['sync_debug_warnings']}")
    c = result.get("cpu_tier", {})
    if "ratio_cpu_vs_device" in c:
        table.add_row("cpu tier / device step time", f"{c['ratio_cpu_vs_device']:.2f}")
        table.add_row("cpu tier: allocated fall / offloaded MiB",
                      f"{c['allocated_fall_bytes'] / mib:.1f} / {c['offloaded_bytes'] / mib:.1f}")
    for name, row in result.items():
        if isinstance(row, dict) and row.get("over_budget"):
            table.add_row(f"{name} over its budget (s)", f"{row['seconds']:.0f} > {row['budget_s']}")
        if isinstance(row, dict) and row.get("ok") is False:
            table.add_row(f"{name} FAILED", row["error"][:80])
    Console().print(table)
    print(f"gpu_check took {result['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
