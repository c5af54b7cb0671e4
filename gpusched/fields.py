"""Field parsers shared by every input gpusched reads: requests, fleet files, traces, the CLI.

One source of truth for the bounds of bad input (documented in ``docs/reliability.md``):

* :data:`MAX_DEVICES` — at most 4096 devices in one request or one trace job (the largest
  training gangs of public traces use 2048); :data:`MAX_DEVICES_PER_NODE` — 128 per node.
* :data:`MAX_SIZE_BYTES` — 1 PiB for any memory size (device or host).
* :data:`MAX_DURATION_S` — 366 days for an expected duration; positive sub-second durations
  round *up* to 1 s (a duration is never silently 0).
* :data:`MAX_TEXT` — 63 characters for names, tenants and label keys/values (Kubernetes' rule).
* :data:`MAX_YAML_CHARS` — 1 MiB of YAML text; duplicated mapping keys are rejected.

Every function raises a plain :class:`ValueError` subclass, :class:`FieldProblem`, carrying a
one-line ``problem`` and what is ``accepted``; each caller turns it into its own
:class:`~gpusched.errors.GpuschedError` that names the file/row/field. Numbers are checked to be
finite before any conversion, so ``nan``/``inf`` never reach ``int()``.
"""

from __future__ import annotations

import contextlib
import math
import re
from functools import cache
from typing import Any

__all__ = [
    "MAX_DEVICES",
    "MAX_DEVICES_PER_NODE",
    "MAX_DURATION_S",
    "MAX_SIZE_BYTES",
    "MAX_TEXT",
    "MAX_YAML_CHARS",
    "FieldProblem",
    "duration_seconds",
    "finite_number",
    "safe_repr",
    "size_bytes",
    "strict_yaml",
]

MAX_DEVICES = 4096
MAX_DEVICES_PER_NODE = 128
MAX_SIZE_BYTES = 2**50
MAX_DURATION_S = 366 * 86400
MAX_TEXT = 63
MAX_YAML_CHARS = 2**20

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([a-zA-Z]{0,3})\s*")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*(d|h|min|m|s)?", re.IGNORECASE)


class FieldProblem(ValueError):
    """One bad value: ``problem`` says what is wrong, ``accepted`` what would be right."""

    def __init__(self, problem: str, accepted: str) -> None:
        self.problem = problem
        self.accepted = accepted
        super().__init__(f"{problem}; accepted: {accepted}")


def safe_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters; never raises (huge ints, broken ``__repr__``)."""
    try:
        text = repr(value)
    except Exception:  # any object may be handed in; the message must still form
        text = f"<{type(value).__name__}>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def finite_number(value: object, accepted: str) -> float:
    """``value`` as a float when it is a real, finite number (not a bool); else :class:`FieldProblem`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldProblem(f"{safe_repr(value)} is not a number", accepted)
    if isinstance(value, int) and abs(value) > 2**63:
        raise FieldProblem(f"{safe_repr(value)} is out of range", accepted)
    if not math.isfinite(value):
        raise FieldProblem(f"{safe_repr(value)} is not a finite number", accepted)
    return float(value)


def size_bytes(value: object) -> int:
    """Bytes from an int or a string such as ``"40GiB"``, ``"16GB"`` or ``"512M"`` (1 B … 1 PiB)."""
    accepted = "a positive number of bytes up to 1 PiB, or a string like '40GiB', '16GB', '512MiB'"
    size: float
    if isinstance(value, bool):
        raise FieldProblem(f"{safe_repr(value)} is not a size", accepted)
    if isinstance(value, int):
        size = value if abs(value) <= 2 * MAX_SIZE_BYTES else 2 * MAX_SIZE_BYTES
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise FieldProblem(f"{safe_repr(value)} is not a size", accepted)
        size = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    else:
        raise FieldProblem(f"{safe_repr(value)} is not a size", accepted)
    if size < 1:
        raise FieldProblem(f"{safe_repr(value)} must be at least 1 byte", accepted)
    if size > MAX_SIZE_BYTES:
        raise FieldProblem(f"{safe_repr(value)} is larger than 1 PiB", accepted)
    return int(size)


def duration_seconds(value: object) -> int:
    """Whole seconds (rounded up, ≥ 1) from a number or a string like ``"90s"``, ``"2h"``, ``"1h30m"``."""
    accepted = "a positive number of seconds up to 366 days, or a string like '90s', '30m', '2h', '1h30m'"
    total: float
    if isinstance(value, bool):
        raise FieldProblem(f"{safe_repr(value)} is not a duration", accepted)
    if isinstance(value, int | float):
        total = finite_number(value, accepted)
    elif isinstance(value, str) and value.strip() and len(value) <= 200:
        text = value.strip()
        total = 0.0
        pos = 0
        for match in _DURATION_RE.finditer(text):
            if text[pos:match.start()].strip():
                raise FieldProblem(f"{safe_repr(value)} is not a duration", accepted)
            total += float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "").lower()]
            pos = match.end()
        if pos != len(text):
            raise FieldProblem(f"{safe_repr(value)} is not a duration", accepted)
    else:
        raise FieldProblem(f"{safe_repr(value)} is not a duration", accepted)
    if total <= 0:
        raise FieldProblem(f"{safe_repr(value)} is not positive", accepted)
    if total > MAX_DURATION_S:
        raise FieldProblem(f"{safe_repr(value)} is longer than 366 days", accepted)
    return max(1, math.ceil(total))


def strict_yaml(text: object) -> Any:
    """Parse YAML with the safe loader, rejecting duplicated keys; :class:`FieldProblem` on any error.

    The message is one line: the YAML problem and where it is (line and column).
    """
    import yaml

    accepted = "a YAML document without duplicated keys"
    if not isinstance(text, str):
        raise FieldProblem(f"{safe_repr(text)} is not text", accepted)
    if len(text) > MAX_YAML_CHARS:
        raise FieldProblem(f"the YAML text has {len(text)} characters (limit {MAX_YAML_CHARS})", accepted)
    try:
        return yaml.load(text, Loader=_strict_loader())  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
        raise FieldProblem(f"not valid YAML{where}: {problem}", accepted) from None
    except (yaml.YAMLError, RecursionError, ValueError, TypeError) as exc:
        raise FieldProblem(f"not valid YAML: {' '.join(str(exc).split())[:200]}", accepted) from None


@cache
def _strict_loader() -> type:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """The safe loader; a mapping that repeats a key is an error, not a silent overwrite."""

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[object] = set()
            for key_node, _value in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:
                    repeated = False  # unhashable: the base class reports it
                if repeated:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicated key {safe_repr(key)}", key_node.start_mark,
                    )
                with contextlib.suppress(TypeError):
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader
