"""The ``gpusched`` command line: one sub-command per module under :mod:`gpusched.commands`.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (taking the parsed namespace, returning the exit code). Modules are imported lazily
per command name so ``gpusched inventory`` never pays for pandas or deap.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gpusched.errors import GpuschedError

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, str] = {
    # command name -> module under gpusched.commands (one line each)
    "inventory": "inventory",
    "ledger": "ledger",
    "bench": "bench",
    "simulate": "simulate",
    "agent": "agent",
}


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpusched", description="GPU-aware scheduling for Airflow")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, module in COMMANDS.items():
        if wanted in COMMANDS and name != wanted:
            sub.add_parser(name, help=f"(see gpusched {name} --help)")
            continue
        importlib.import_module(f"gpusched.commands.{module}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code (errors print one clear line)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = _parser(args_list).parse_args(args_list)
    try:
        return int(args.func(args))
    except GpuschedError as exc:
        print(f"gpusched: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
