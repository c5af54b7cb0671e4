"""Loaders for the public GPU-cluster traces the simulator replays.

Three sources (see ``shared/traces/README.md`` beside the checkout):

* **openb** (Alibaba 2023, FGD paper): a node list and pod lists with fractional GPUs, CPU and
  memory, and GPU-model constraints.
* **Gavel** (OSDI '20): job streams whose run time depends on the GPU type
  (``duration_s_v100/p100/k80``) plus the measured throughput table.
* **Philly** (Microsoft 2017, flattened by the Sia artifact): arrival, duration and GPU count.

Every loader returns plain frozen records in trace order; nothing here knows about policies.
Only the standard library is used (``csv``/``json``), so loading stays cheap in tests.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpusched.errors import ConfigurationError

__all__ = [
    "GAVEL_MODELS",
    "OpenbNode",
    "OpenbPod",
    "TraceJob",
    "default_trace_dir",
    "load_gavel_jobs",
    "load_gavel_throughputs",
    "load_openb_nodes",
    "load_openb_pods",
    "load_philly_jobs",
]

GAVEL_MODELS: Mapping[str, str] = {"v100": "V100-SXM2-16GB", "p100": "P100-PCIE-16GB", "k80": "K80"}
"""Gavel GPU-type keys → canonical catalog model names."""


def default_trace_dir() -> Path:
    """``$GPUSCHED_TRACES`` or ``../shared/traces`` relative to the repository root."""
    env = os.environ.get("GPUSCHED_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@dataclass(frozen=True, slots=True)
class OpenbNode:
    """One node of the openb node list (``sn,cpu_milli,memory_mib,gpu,model``)."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class OpenbPod:
    """One task of an openb pod list.

    ``gpu_milli`` is the share of one GPU when ``num_gpu == 1`` (1–1000); multi-GPU pods take
    whole GPUs. ``gpu_spec`` lists the allowed trace model names (empty = any).
    """

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()

    @property
    def total_gpu_milli(self) -> int:
        """Milli-GPU requested in all (0 for a CPU-only pod)."""
        if self.num_gpu == 0:
            return 0
        if self.num_gpu == 1:
            return self.gpu_milli
        return self.num_gpu * 1000


@dataclass(frozen=True, slots=True)
class TraceJob:
    """A job of a time-based trace (Gavel, Philly).

    Attributes:
        key: unique id (the trace's job id or row number as a string).
        arrival_s: submission time in seconds from the trace start.
        num_gpus: whole GPUs the job asks for.
        duration_s: run time when the job runs alone; ``durations`` overrides it per catalog
            model name (Gavel: the time on V100 / P100 / K80).
        job_type: the trace's job type, if any.
        group: virtual cluster / tenant, if any.
    """

    key: str
    arrival_s: float
    num_gpus: int
    duration_s: float
    durations: Mapping[str, float] = field(default_factory=dict)
    job_type: str = ""
    group: str = ""

    def duration_on(self, model: str) -> float:
        """Run time on devices of ``model`` (the plain duration if the trace has no figure)."""
        return self.durations.get(model, self.duration_s)


def _open_csv(path: Path) -> Iterator[dict[str, str]]:
    if not path.is_file():
        raise ConfigurationError(
            f"trace file {path} does not exist; pass the right path or set GPUSCHED_TRACES "
            "to the folder holding openb/, gavel/ and philly/"
        )
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(row for row in handle if not row.startswith("#"))
        yield from reader


def _int(row: Mapping[str, str], key: str, path: Path, default: int | None = None) -> int:
    value = row.get(key)
    if value is None or value == "":
        if default is not None:
            return default
        raise ConfigurationError(f"{path}: column {key!r} missing or empty; is this the right trace file?")
    try:
        return int(float(value))
    except ValueError:
        raise ConfigurationError(f"{path}: column {key!r} has non-numeric value {value!r}") from None


def load_openb_nodes(path: Path | str) -> list[OpenbNode]:
    """Nodes of an openb node list, in file order (CPU-only rows with 0 GPUs included)."""
    p = Path(path)
    return [
        OpenbNode(
            name=row["sn"],
            cpu_milli=_int(row, "cpu_milli", p),
            memory_mib=_int(row, "memory_mib", p),
            gpus=_int(row, "gpu", p, 0),
            model=(row.get("model") or "").strip(),
        )
        for row in _open_csv(p)
    ]


def load_openb_pods(path: Path | str) -> list[OpenbPod]:
    """Pods of an openb pod list, in file order (the ``multigpu*`` files lack ``gpu_spec``)."""
    p = Path(path)
    pods = []
    for row in _open_csv(p):
        num_gpu = _int(row, "num_gpu", p)
        spec = tuple(s.strip() for s in (row.get("gpu_spec") or "").split("|") if s.strip())
        pods.append(
            OpenbPod(
                name=row["name"],
                cpu_milli=_int(row, "cpu_milli", p),
                memory_mib=_int(row, "memory_mib", p),
                num_gpu=num_gpu,
                gpu_milli=_int(row, "gpu_milli", p, 0) if num_gpu else 0,
                gpu_spec=spec,
            )
        )
    return pods


def _float_or_none(value: str | None) -> float | None:
    if value is None or value.strip() == "":
        return None
    return float(value)


def load_gavel_jobs(path: Path | str, *, limit: int | None = None) -> list[TraceJob]:
    """Jobs of a Gavel job list, in arrival order.

    Reads both layouts: the continuous-single streams
    (``job_id,arrival_time_s,job_type,scale_factor,total_steps,duration_s_v100,…``) and
    ``msr_seed0_jobs_with_isolated_durations.csv`` (``vc,job_type,num_gpus(scale_factor),…,dur_s_v100``).
    Per-type durations are keyed by catalog model name (see :data:`GAVEL_MODELS`); a job with no
    duration on a type cannot finish there and gets ``inf`` for it.
    """
    p = Path(path)
    jobs = []
    for number, row in enumerate(_open_csv(p)):
        if limit is not None and number >= limit:
            break
        durations: dict[str, float] = {}
        for short, model in GAVEL_MODELS.items():
            value = _float_or_none(row.get(f"duration_s_{short}", row.get(f"dur_s_{short}")))
            durations[model] = float("inf") if value is None else value
        finite = [d for d in durations.values() if d != float("inf")]
        if not finite:
            continue
        gpus = row.get("scale_factor", row.get("num_gpus(scale_factor)", "1")) or "1"
        jobs.append(
            TraceJob(
                key=row.get("job_id") or str(number),
                arrival_s=float(row.get("arrival_time_s") or 0.0),
                num_gpus=int(float(gpus)),
                duration_s=min(finite),
                durations=durations,
                job_type=row.get("job_type", ""),
                group=row.get("vc", ""),
            )
        )
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


def load_gavel_throughputs(path: Path | str) -> dict[str, dict[str, float]]:
    """Isolated throughput (steps/s) per GPU type and job type: ``{"v100": {"('A3C', 1)": 32.3}}``.

    Only the ``"null"`` entry (the job running alone) is kept; space-sharing pairs are dropped.
    """
    p = Path(path)
    try:
        raw: dict[str, Any] = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read Gavel throughputs {p}: {exc}; check the path") from exc
    table: dict[str, dict[str, float]] = {}
    for gpu_type, jobs in raw.items():
        if not isinstance(jobs, dict):
            continue
        table[gpu_type] = {
            job: float(entry["null"])
            for job, entry in jobs.items()
            if isinstance(entry, dict) and isinstance(entry.get("null"), int | float)
        }
    return table


def _parse_ts(text: str) -> float:
    return datetime.strptime(text.strip(), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()


def load_philly_jobs(
    path: Path | str,
    *,
    start: str | None = None,
    end: str | None = None,
    clusters: frozenset[str] | None = None,
    max_gpus: int | None = None,
) -> list[TraceJob]:
    """Philly jobs (``timestamp,duration,num_gpus,gpu_time,cluster``) sorted by submission.

    ``start``/``end`` (``YYYY-MM-DD[ HH:MM:SS]``, UTC, end exclusive) select a window;
    ``clusters`` keeps only those virtual clusters; ``max_gpus`` drops larger jobs. Arrival times
    are seconds from the first kept job. Jobs with zero duration or zero GPUs are skipped.
    """
    p = Path(path)
    lo = _parse_ts(start if " " in start else start + " 00:00:00") if start else None
    hi = _parse_ts(end if " " in end else end + " 00:00:00") if end else None
    kept: list[tuple[float, int, float, str]] = []
    for row in _open_csv(p):
        try:
            ts = _parse_ts(row["timestamp"])
            duration = float(row["duration"])
            gpus = int(float(row["num_gpus"]))
        except (KeyError, ValueError) as exc:
            raise ConfigurationError(
                f"{p}: bad Philly row {row!r} ({exc}); is this philly_jobs.csv?"
            ) from exc
        if (lo is not None and ts < lo) or (hi is not None and ts >= hi):
            continue
        if duration <= 0 or gpus <= 0 or (max_gpus is not None and gpus > max_gpus):
            continue
        cluster = row.get("cluster", "")
        if clusters is not None and cluster not in clusters:
            continue
        kept.append((ts, gpus, duration, cluster))
    kept.sort(key=lambda item: item[0])
    origin = kept[0][0] if kept else 0.0
    return [
        TraceJob(key=str(i), arrival_s=ts - origin, num_gpus=g, duration_s=d, group=c)
        for i, (ts, g, d, c) in enumerate(kept)
    ]
