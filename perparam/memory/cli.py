"""``perparam memory``: per-rank model-state memory and communication of DDP and ZeRO-1/2/3.

Prints the ZeRO tables for a parameter count and K ranks: the unsharded components (params, grads,
optimizer state), the per-rank bytes of each stage with how many times less than DDP it is, and the bytes
each rank sends per step. Formulas and sources: ``perparam.memory.formulas``. Units: GB = 10**9 bytes.

``perparam memory --params 1.5e9 --world 64`` reproduces the textbook's 24.000000 / 6.281250 / 3.328125 /
0.375000 GB per rank. ``--budget 8GB`` adds which stage fits 8 GB per rank with the fewest bytes sent
(``perparam.memory.stage_budget``).
"""

from __future__ import annotations

import argparse
import json
import sys

from perparam.memory import formulas
from perparam.memory.formulas import BytesPerParam

HELP = "per-rank model-state memory and communication of DDP and ZeRO-1/2/3 (the ZeRO tables)"


def _bytes_arg(text: str):
    value = formulas.exact(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"bytes per parameter must be >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", "-N", type=positive_count, default=formulas.parse_count("1.5e9"),
                        help="parameter count: 1.5e9, 1.5B, 124M, 1_557_611_200 (default 1.5e9)")
    parser.add_argument("--world", "-K", type=int, default=64, help="K, data-parallel ranks (default 64)")
    parser.add_argument("--param-bytes", type=_bytes_arg, default=2,
                        help="bytes per parameter of the weights (default 2: fp16)")
    parser.add_argument("--grad-bytes", type=_bytes_arg, default=2,
                        help="bytes per parameter of the gradients (default 2: fp16)")
    parser.add_argument("--optim-bytes", type=_bytes_arg, default=12,
                        help="bytes per parameter of the optimizer state (default 12: fp32 master + Adam m, "
                             "v)")
    parser.add_argument("--budget", type=_budget_arg, default=None, metavar="BYTES",
                        help="bytes of model state per rank (8GB, 8e9, 7.5GiB): which stages fit, and the "
                             "one that fits with the fewest bytes sent per step")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _budget_arg(text: str) -> int:
    from perparam.memory.budget import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_count(text: str) -> int:
    """``--params``: a positive parameter count; argparse prints the message as the one-line error."""
    try:
        value = formulas.parse_count(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count: pass a positive number such as "
                                         "1.5e9, 1.5B, 124M or 1_557_611_200")
    return value


def budget_report(num_params: int, world_size: int, bpp: BytesPerParam, budget: int) -> dict:
    """``--budget``'s part of the JSON: per stage bytes, traffic and fit; the stage chosen (``None``: none
    fits) and the smallest K at which ZeRO-3 fits."""
    from perparam.memory import stage_budget

    fits = stage_budget.stage_fits(num_params, world_size, budget, bpp)
    chosen = stage_budget.choose(fits)
    return {"budget_bytes": budget, "stages": [f.as_dict() for f in fits],
            "chosen": chosen.stage if chosen else None,
            "min_world_for_zero3": stage_budget.min_world_for_zero3(num_params, budget, bpp)}


def report(num_params: int, world_size: int, bpp: BytesPerParam, budget: int | None = None) -> dict:
    """Everything ``perparam memory`` shows, as JSON-ready data (bytes, GB = 1e9 bytes, ratios); with
    ``budget`` (bytes per rank) a ``"budget"`` entry (``budget_report``)."""
    state = formulas.model_state(num_params, bpp)
    out = {
        "num_params": num_params,
        "world_size": world_size,
        "gb": formulas.GB,
        "bytes_per_param": {k: formulas.as_json_number(getattr(bpp, k))
                            for k in ("params", "grads", "optimizer", "total")},
        "components": {
            name: {"bytes": formulas.as_json_number(v), "gb": float(v / formulas.GB)}
            for name, v in (("params", state.params), ("grads", state.grads),
                            ("optimizer", state.optimizer), ("total", state.total))
        },
        "stages": [s.as_dict() for s in formulas.memory_table(num_params, world_size, bpp)],
        "communication": [c.as_dict() for c in formulas.communication_table(num_params, world_size, bpp)],
    }
    if budget is not None:
        out["budget"] = budget_report(num_params, world_size, bpp, budget)
    return out


def run(args: argparse.Namespace) -> int:
    if args.world < 1:
        print(f"perparam memory: --world must be >= 1, got {args.world}", file=sys.stderr)
        return 2
    bpp = BytesPerParam(args.param_bytes, args.grad_bytes, args.optim_bytes)
    if args.json:
        sys.stdout.write(json.dumps(report(args.params, args.world, bpp, args.budget), indent=2) + "\n")
        return 0
    from perparam.memory import render

    render.print_memory(
        render.console(),
        formulas.model_state(args.params, bpp),
        bpp,
        formulas.memory_table(args.params, args.world, bpp),
        formulas.communication_table(args.params, args.world, bpp),
    )
    if args.budget is not None:
        from perparam.memory import stage_budget

        fits = stage_budget.stage_fits(args.params, args.world, args.budget, bpp)
        render.show(render.console(), *render.budget_table(
            fits, stage_budget.choose(fits), stage_budget.min_world_for_zero3(args.params, args.budget, bpp)))
    return 0
