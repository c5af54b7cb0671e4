"""Reading trace files safely: every bad file or row becomes one :class:`~gpusched.errors.TraceError`.

:func:`rows` yields :class:`Row` objects with the physical line number, and the ``Row`` getters
check each field (present, numeric, finite, within bounds) before any conversion, so a trace with
``nan``, ``inf``, a negative count or a non-UTF-8 byte stops with a one-line error naming the
file, the line and the field — never a traceback, never a hang in the simulator.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpusched.errors import TraceError
from gpusched.fields import safe_repr

__all__ = ["Row", "header", "rows"]

_FIX_FILE = "pass an existing trace file, or set GPUSCHED_TRACES to the folder with openb/, gavel/, philly/"


class _Lines:
    """The file's lines without ``#`` comments, remembering the physical number of the last one read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.line = 0

    def __iter__(self) -> Iterator[str]:
        try:
            with self.path.open(newline="", encoding="utf-8") as handle:
                for self.line, text in enumerate(handle, start=1):
                    if not text.startswith("#"):
                        yield text
        except UnicodeDecodeError as exc:
            raise TraceError(
                self.path, f"is not UTF-8 text (byte {exc.start} after line {self.line})",
                "give a CSV file in UTF-8", line=self.line + 1,
            ) from None
        except OSError as exc:
            raise TraceError(self.path, f"cannot be read ({exc.strerror or exc})", _FIX_FILE) from None


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise TraceError(path, "does not exist or is not a file", _FIX_FILE)


def header(path: Path) -> list[str]:
    """The column names of the first non-comment line (empty for an empty file)."""
    _check_file(path)
    lines = _Lines(path)
    try:
        return next(csv.reader(lines), [])
    except csv.Error as exc:
        raise TraceError(path, f"is not a CSV file ({exc})", "give a comma-separated file",
                         line=lines.line) from None


def rows(path: Path, kind: str) -> Iterator[Row]:
    """The data rows of the CSV trace at ``path`` (``kind`` names the trace in errors, e.g. ``"Philly"``)."""
    _check_file(path)
    lines = _Lines(path)
    reader = csv.DictReader(lines)
    try:
        for data in reader:
            yield Row(path, lines.line, data, kind)
    except csv.Error as exc:
        raise TraceError(path, f"is not a valid CSV file ({exc})", "fix the quoting or the line",
                         line=lines.line) from None


@dataclass(frozen=True, slots=True)
class Row:
    """One data row of a trace; the getters raise :class:`TraceError` naming file, line and field."""

    path: Path
    line: int
    data: dict[str | None, str | list[str] | None]
    kind: str

    def error(self, field: str, problem: str, fix: str) -> TraceError:
        """A :class:`TraceError` at this row and ``field``."""
        return TraceError(self.path, problem, fix, line=self.line, field=field)

    def text(self, field: str, *, default: str | None = None, limit: int = 200) -> str:
        """The field's text, stripped (``default`` when missing or empty; required when ``None``)."""
        value = self.data.get(field)
        if not isinstance(value, str) or not value.strip():
            if default is not None:
                return default
            raise self.error(field, "is missing or empty", f"is this the right {self.kind} file?")
        if len(value) > limit:
            raise self.error(field, f"is longer than {limit} characters", "shorten it")
        return value.strip()

    def number(self, field: str, *, minimum: float = 0.0, maximum: float = math.inf,
               default: float | None = None) -> float:
        """A finite number within ``minimum`` … ``maximum`` (``default`` when missing or empty)."""
        raw = self.text(field, default="" if default is not None else None, limit=40)
        if raw == "" and default is not None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise self.error(field, f"{safe_repr(raw)} is not a number", "write a plain number") from None
        if not math.isfinite(value):
            raise self.error(field, f"{safe_repr(raw)} is not a finite number", "write a finite number")
        if not minimum <= value <= maximum:
            bound = f"from {minimum:g} to {maximum:g}" if math.isfinite(maximum) else f"≥ {minimum:g}"
            raise self.error(field, f"{safe_repr(raw)} is out of range", f"write a number {bound}")
        return value

    def whole(self, field: str, *, minimum: int = 0, maximum: int, default: int | None = None) -> int:
        """A whole number within ``minimum`` … ``maximum`` (``"4.0"`` is accepted, ``"4.5"`` is not)."""
        value = self.number(field, minimum=minimum, maximum=maximum,
                            default=None if default is None else float(default))
        if value != int(value):
            raise self.error(field, f"{value!r} is not a whole number", "write a whole number")
        return int(value)
