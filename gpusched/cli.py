"""The ``gpusched`` command line: one sub-command per module under :mod:`gpusched.commands`.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (taking the parsed namespace, returning the exit code). Modules are imported lazily
per command name so ``gpusched inventory`` never pays for pandas or deap.

Errors have one central handler (:func:`main`): a bad argument, any
:class:`~gpusched.errors.GpuschedError` and an operating-system error on a file the user named
print ONE line ``gpusched <command>: error: <problem>; <fix>`` on stderr and exit with code 2 —
no usage dump, no traceback. A traceback means a bug in gpusched, not bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from gpusched import __version__
from gpusched.errors import GpuschedError

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, str] = {
    # command name -> module under gpusched.commands (one line each)
    "inventory": "inventory",
    "ledger": "ledger",
    "bench": "bench",
    "simulate": "simulate",
    "agent": "agent",
    "check": "check",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the problem and where to look."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message; see `prog --help``` and exit 2 (instead of the usage block)."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see `{self.prog} --help`\n")


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="gpusched", description="GPU-aware scheduling for Airflow")
    parser.add_argument("--version", action="version", version=f"gpusched {__version__}")
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
    try:
        args = _parser(args_list).parse_args(args_list)
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else 2
    where = " ".join(["gpusched", args.command, *([args.bench] if getattr(args, "bench", None) else [])])
    try:
        return int(args.func(args))
    except GpuschedError as exc:
        _fail(where, str(exc))
    except OSError as exc:  # a file or folder the user named (--out, --results …)
        name = f" {exc.filename}" if exc.filename else ""
        _fail(where, f"cannot use{name}: {exc.strerror or exc}; check the path and its permissions")
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    return 2


def _fail(where: str, message: str) -> None:
    line = f"{where}: error: {' '.join(message.split())}"
    # A path the user typed may hold bytes no encoding can print (a lone surrogate from the
    # file system); show them escaped rather than fail while reporting the error.
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    print(line.encode(encoding, "backslashreplace").decode(encoding), file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
