"""``perparam plan``: the command line of ``perparam.memory.plan`` (tables or JSON of a model's layout)."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

from perparam.memory import budget_cli, formulas
from perparam.memory.formulas import GB
from perparam.memory.plan import DTYPES, PRESETS, plan_model, plan_to_json, resolve_factory
from perparam.memory.policy_args import policy_from_args

HELP = "the sharding layout of a model for K ranks, computed without processes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, choices=sorted(PRESETS),
                     help="a built-in model (default: gpt2-xl)")
    src.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                     help="an importable factory returning an nn.Module, called with no arguments on meta")
    parser.add_argument("--world", "-K", type=int, default=64,
                        help="ranks in all: --dp-replicate x shard axis x --tp (default 64)")
    parser.add_argument("--dtype", default="float16", choices=[*DTYPES, "model"],
                        help="stored parameter dtype (default float16, the tables' 2 bytes; 'model': as "
                             "built)")
    parser.add_argument("--grad-bytes", type=formulas.exact, default=None,
                        help="gradient bytes per element (default: the parameter dtype's itemsize)")
    parser.add_argument("--optim-bytes", type=formulas.exact, default=Fraction(12),
                        help="optimizer-state bytes per trainable element (default 12: fp32 master + 2 "
                             "moments)")
    parser.add_argument("--nominal-params", type=formulas.parse_count, default=None,
                        help="also compare with the formula for this parameter count (gpt2-xl: 1.5e9)")
    parser.add_argument("--placement", choices=["shard0", "auto"], default="shard0",
                        help="shard0: Shard(0) everywhere (default); auto: ParamPolicy(placement='auto') for "
                             "all")
    parser.add_argument("--param-policy", action="append", default=[], metavar="PATTERN=TOKENS",
                        help="a per-parameter policy, repeatable, e.g. '*.mlp.*.weight=frozen,nf4,stored' "
                             "(tokens: see perparam/memory/policy_args.py)")
    parser.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=None, metavar="N",
                        help="ZeRO stage of every parameter whose --param-policy names none "
                             "(ParamPolicy.zero_stage): 1 keeps the parameter and gradient whole, 2 the "
                             "parameter, 3 nothing (default 3)")
    parser.add_argument("--dp-replicate", type=int, default=1, metavar="R",
                        help="HSDP: R replicas of a shard axis of --world/R ranks (a rank's bytes depend on "
                             "the shard axis only; default 1)")
    parser.add_argument("--param-policy-factory", default=None, metavar="PKG.MODULE:FUNCTION",
                        help="an importable function returning fully_shard's param_policy (a dict of "
                             "patterns to ParamPolicy, a ParamPolicy or a callable); --param-policy flags "
                             "are added after it")
    parser.add_argument("--tp", type=int, default=1, metavar="T",
                        help="tensor parallelism: T ranks per tp group, the innermost axis; parameters the "
                             "tensor-parallel plan splits are sharded over dp as their tp-local tensor "
                             "(default 1)")
    parser.add_argument("--tp-plan", default=None, metavar="PKG.MODULE:FACTORY",
                        help="with --tp: a factory returning parallelize_module's plan (module patterns -> "
                             "ColwiseParallel()/RowwiseParallel()); presets default to the Megatron GPT-2 "
                             "plan")
    parser.add_argument("--rank", type=int, default=0, help="rank shown in the tables (default 0)")
    parser.add_argument("--params-table", action="store_true", help="print a per-parameter table")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    budget_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.world < 1:
        print(f"perparam plan: --world must be >= 1, got {args.world}", file=sys.stderr)
        return 2
    if not 0 <= args.rank < args.world:
        print(f"perparam plan: --rank must be in [0, {args.world}), got {args.rank}", file=sys.stderr)
        return 2
    if args.tp < 1 or args.world % args.tp:
        print(f"perparam plan: --tp must be a positive divisor of --world {args.world}, got {args.tp}",
              file=sys.stderr)
        return 2
    if args.dp_replicate < 1 or (args.world // args.tp) % args.dp_replicate:
        print("perparam plan: --dp-replicate must be a positive divisor of --world / --tp = "
              f"{args.world // args.tp}, got {args.dp_replicate}", file=sys.stderr)
        return 2
    shards = args.world // (args.dp_replicate * args.tp)
    if args.rank >= shards:
        print(f"perparam plan: --rank is a rank of the shard axis, in [0, {shards}), got {args.rank}",
              file=sys.stderr)
        return 2
    problem = budget_cli.check(args)
    if problem is not None:
        print(f"perparam plan: {problem}", file=sys.stderr)
        return 2
    spec = args.model or args.preset or "gpt2-xl"
    try:
        plan = plan_model(
            spec, shards, dtype=None if args.dtype == "model" else DTYPES[args.dtype],
            grad_bytes=args.grad_bytes, optim_bytes=args.optim_bytes, nominal_params=args.nominal_params,
            param_policy=policy_from_args(args.param_policy, args.placement, args.param_policy_factory,
                                          args.zero_stage),
            tp=args.tp, tp_plan=args.tp_plan,
        )
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        print(f"perparam plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(json.dumps(plan_to_json(plan, args.rank, args.params_table), indent=2) + "\n")
        return 0
    mean = Fraction(plan.sum_over_ranks().total) / plan.world_size
    from perparam.memory import render

    console = render.console()
    _, description, _ = resolve_factory(spec)
    render.print_plan(console, plan, description, args.rank, args.params_table)
    console.print(f"imbalance: the largest rank (rank {plan.max_rank.rank}) holds "
                  f"{plan.max_rank.total / GB:.6f} GB, "
                  f"{float(plan.max_rank.total / mean - 1) * 100 if mean else 0:.2f}% above the mean "
                  f"{float(mean) / GB:.6f} GB")
    if plan.owner_params:
        owners = plan.owners()
        console.print(f"owners: {len(plan.owner_params)} update='owner' parameters; the busiest rank's "
                      f"Newton-Schulz work is {owners.balance:.3f}x the mean (per rank: {list(owners.loads)} "
                      "multiply-adds)")
    if args.budget is not None:
        return budget_cli.run(args, plan, console)
    return 0
