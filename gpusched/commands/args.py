"""Argument types for every ``gpusched`` command: bounded numbers, policy names, lists.

Each is an ``argparse`` ``type=`` callable that raises :class:`argparse.ArgumentTypeError` with
what is accepted, so a bad value ends as the CLI's one-line error with exit code 2 (see
:mod:`gpusched.cli`). Numbers are checked to be finite: ``--round nan`` is refused, not replayed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["comma_list", "finite_float", "int_range", "policy_help", "policy_name", "port"]


def int_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number ≥ ``minimum`` (and ≤ ``maximum`` when given)."""
    accepted = f"a whole number ≥ {minimum}"
    if maximum is not None:
        accepted = f"a whole number from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip()) if len(text) <= 20 else None
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {accepted}")
        return value

    parse.__name__ = "whole number"
    return parse


def finite_float(
    minimum: float, maximum: float = math.inf, *, strict_min: bool = False
) -> Callable[[str], float]:
    """A finite number within ``minimum`` … ``maximum`` (``> minimum`` with ``strict_min``)."""
    low = f"> {minimum:g}" if strict_min else f"≥ {minimum:g}"
    accepted = f"a finite number {low}" + (f" and ≤ {maximum:g}" if math.isfinite(maximum) else "")

    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 40 else math.nan
        except ValueError:
            value = math.nan
        if (not math.isfinite(value) or value < minimum or (strict_min and value == minimum)
                or value > maximum):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {accepted}")
        return value

    parse.__name__ = "number"
    return parse


def port(text: str) -> int:
    """A TCP port 0–65535 (0 = any free port)."""
    return int_range(0, 65535)(text)


def comma_list(text: str) -> frozenset[str]:
    """A non-empty comma-separated list of names (``a,b,c``)."""
    items = frozenset(part.strip() for part in text.split(",") if part.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} names nothing; write NAME[,NAME...]")
    return items


def _preset_names() -> tuple[str, ...]:
    # local: the placement package loads numpy; `gpusched ledger|agent|inventory` parse without it
    from gpusched.placement import Policy

    return Policy.names()


def policy_name(text: str) -> str:
    """A placement policy preset (see :meth:`gpusched.placement.Policy.names`)."""
    name = text.strip().lower()
    if name not in _preset_names():
        names = ", ".join(_preset_names())
        raise argparse.ArgumentTypeError(f"unknown policy {text[:40]!r}; use one of: {names}")
    return name


POLICY_PARTS_HELP = ("change the policy's parts as [gpusched] policy_parts does, e.g. "
                     "'score.locality=0.5, tiebreak=earliest' (default: none)")
"""Help text of a ``--policy-parts`` option."""


def policy_help(what: str = "placement policy") -> str:
    """Help text for a ``--policy`` option that lists the preset names."""
    names = _preset_names()
    return f"{what}: {', '.join(names)} (default {names[0]})"
