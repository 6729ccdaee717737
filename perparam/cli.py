"""The ``perparam`` console script: one subcommand per module, imported only when used.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "finetune": "perparam.finetune.cli",
    "memory": "perparam.memory.cli",
    "plan": "perparam.memory.plan_cli",
}

HELPS = {
    "finetune": "fine-tune a LLaMA-architecture GGUF model on text, sharded over N processes",
    "memory": "per-rank model-state memory and communication of DDP and ZeRO-1/2/3 (the ZeRO tables)",
    "plan": "the sharding layout of a model for K ranks, computed without processes",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="perparam", description="Per-parameter sharded data parallelism.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in HELPS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv:  # a missing subcommand is a usage error, as argparse treats a missing argument
        parser.print_help(sys.stderr)
        return 2
    if argv[0] not in SUBCOMMANDS:
        parser.print_help() if argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name])
    sub_parser = argparse.ArgumentParser(prog=f"perparam {name}", description=HELPS[name])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
