"""Throughput tables: how fast each job type runs on each GPU model (``Policy.throughput``).

One reader for the executor's ``[gpusched] throughput_file`` and the Gavel benchmark's
``--throughputs``, so both place and migrate with the same numbers. Two JSON shapes are read:

* **simple** (write this one by hand): job type → model → speed (any unit, the same within a
  job type; steps/s is usual)::

      {"ResNet-50 (batch size 64)": {"V100": 9.3, "A100-SXM-80GB": 21.0, "K80": 1.9}}

* **Gavel** (``simulation_throughputs.json`` of the Gavel artifact): GPU type →
  ``"(job type, scale factor)"`` → ``{"null": steps/s, …}``; only single-GPU runs alone
  (scale factor 1, the ``"null"`` entry) are kept, of the GPU types the catalog knows (Gavel's
  ``*_unconsolidated`` variants are skipped).

Model names are resolved by the accelerator catalog (canonical names or aliases, any case:
Gavel's ``v100`` / ``p100`` / ``k80`` are aliases), so the table's keys are canonical models.
A model the catalog does not know, a non-finite or negative speed, or a file that is not such
an object is a one-line :class:`~gpusched.errors.ConfigurationError` naming the file and the fix.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpusched.catalog import Catalog, default_catalog
from gpusched.errors import ConfigurationError

__all__ = ["ThroughputTable", "load_throughputs", "parse_throughputs"]

ThroughputTable = Mapping[str, Mapping[str, float]]
"""job type → canonical model → speed."""

_FIX = ('write {"<job type>": {"<GPU model>": <steps/s>, …}, …} or pass Gavel\'s '
        "simulation_throughputs.json")


def load_throughputs(path: Path | str, *, catalog: Catalog | None = None) -> dict[str, dict[str, float]]:
    """The table in JSON file ``path`` (either shape; see the module docstring)."""
    p = Path(path)
    try:
        raw: Any = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"throughput file {p} cannot be read ({exc.strerror or exc}); "
                                 f"fix the path or {_FIX}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigurationError(f"throughput file {p} is not JSON ({' '.join(str(exc).split())[:120]}); "
                                 f"{_FIX}") from None
    return parse_throughputs(raw, source=str(p), catalog=catalog)


def parse_throughputs(
    data: object, *, source: str = "throughput table", catalog: Catalog | None = None
) -> dict[str, dict[str, float]]:
    """``data`` (a decoded JSON object of either shape) as job type → canonical model → speed."""
    cat = catalog or default_catalog()
    where = source if source == "throughput table" else f"throughput file {source}"
    if not isinstance(data, dict) or not data:
        raise ConfigurationError(f"{where} is not a non-empty JSON object; {_FIX}")
    gavel = all(isinstance(v, dict) and all(isinstance(e, dict) for e in v.values()) for v in data.values()) \
        and any(v for v in data.values())
    table: dict[str, dict[str, float]] = {}
    for outer, row in data.items():
        if not isinstance(row, dict):
            raise ConfigurationError(f"{where}: entry {str(outer)[:60]!r} is not an object; {_FIX}")
        if gavel:
            known = cat.find(str(outer))
            if known is None:  # Gavel's variants (``v100_unconsolidated`` …) are not GPU models
                continue
            model = known.name
            for job, entry in row.items():
                job_type = _gavel_job(job, where)
                speed = entry.get("null")
                if job_type is None or speed is None:
                    continue
                table.setdefault(job_type, {})[model] = _speed(speed, f"{outer}/{job[:60]}", where)
        else:
            table[str(outer)] = {_model(cat, name, where): _speed(v, f"{outer[:60]}/{name}", where)
                                 for name, v in row.items()}
    return table


def _model(cat: Catalog, name: object, where: str) -> str:
    known = cat.find(str(name))
    if known is None:
        raise ConfigurationError(f"{where}: GPU model {str(name)[:60]!r} is not in the accelerator catalog; "
                                 "use a catalog model name or alias (e.g. A100-SXM-80GB, V100, K80)")
    return known.name


def _gavel_job(key: object, where: str) -> str | None:
    """The job type of a single-GPU Gavel key ``"('ResNet-18 (batch size 16)', 1)"`` (None: other scale)."""
    try:
        job_type, scale = ast.literal_eval(str(key))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ConfigurationError(f"{where}: job key {str(key)[:60]!r} is not a (job type, scale) pair; "
                                 "use Gavel's simulation_throughputs.json as published") from None
    return str(job_type) if scale == 1 else None


def _speed(value: object, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{where}: the speed of {what} is {value!r}; give a finite number >= 0")
    return float(value)
