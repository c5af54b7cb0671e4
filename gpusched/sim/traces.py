"""Loaders for the public GPU-cluster traces the simulator replays.

Three sources (see ``shared/traces/README.md`` beside the checkout):

* **openb** (Alibaba 2023, FGD paper): a node list and pod lists with fractional GPUs, CPU and
  memory, and GPU-model constraints.
* **Gavel** (OSDI '20): job streams whose run time depends on the GPU type
  (``duration_s_v100/p100/k80``) plus the measured throughput table.
* **Philly** (Microsoft 2017, flattened by the Sia artifact): arrival, duration and GPU count.

Every loader returns plain frozen records in trace order; nothing here knows about policies.
Only the standard library is used (``csv``/``json``), so loading stays cheap in tests. Every bad
file or row raises :class:`~gpusched.errors.TraceError` naming the file, the line and the field
(rows are read through :mod:`gpusched.sim.tracefile`); counts are bounded by
:data:`~gpusched.fields.MAX_DEVICES` (4096 per job) and :data:`~gpusched.fields.MAX_DEVICES_PER_NODE`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpusched.catalog import default_catalog
from gpusched.errors import ConfigurationError, TraceError
from gpusched.fields import MAX_DEVICES, MAX_DEVICES_PER_NODE
from gpusched.request_parse import ISOLATION_VALUES
from gpusched.sim.tracefile import rows

__all__ = [
    "GAVEL_MODELS",
    "OpenbNode",
    "OpenbPod",
    "TraceJob",
    "default_trace_dir",
    "load_gavel_jobs",
    "load_gavel_throughputs",
    "load_openb_lifetimes",
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
    whole GPUs. ``gpu_spec`` lists the allowed trace model names (empty = any). ``isolation``
    (an optional column, gpusched's own extension) is ``any``, ``hard`` (a MIG instance / AMD
    partition) or ``soft`` for a fractional pod.
    """

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()
    isolation: str = "any"

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


_MAX_TIME_S = 1e12  # about 31,700 years: any real trace time or duration is far below
_MAX_CPU_MILLI = 10**9
_MAX_MEMORY_MIB = 2**30  # 1 PiB


def load_openb_nodes(path: Path | str) -> list[OpenbNode]:
    """Nodes of an openb node list, in file order (CPU-only rows with 0 GPUs included).

    Raises:
        TraceError: naming file, line and field for a missing column, a non-numeric, non-finite
            or out-of-range value (at most 128 GPUs per node), or a duplicated ``sn``.
    """
    p = Path(path)
    nodes = []
    seen: set[str] = set()
    for row in rows(p, "openb node list"):
        name = row.text("sn")
        if name in seen:
            raise row.error("sn", f"node {name!r} appears twice", "give every node a unique sn")
        seen.add(name)
        nodes.append(
            OpenbNode(
                name=name,
                cpu_milli=row.whole("cpu_milli", maximum=_MAX_CPU_MILLI),
                memory_mib=row.whole("memory_mib", maximum=_MAX_MEMORY_MIB),
                gpus=row.whole("gpu", maximum=MAX_DEVICES_PER_NODE, default=0),
                model=row.text("model", default=""),
            )
        )
    return nodes


def load_openb_pods(path: Path | str) -> list[OpenbPod]:
    """Pods of an openb pod list, in file order (the ``multigpu*`` files lack ``gpu_spec``).

    A one-GPU pod needs ``gpu_milli`` 1–1000; ``gpu_spec`` names must be catalog models or aliases.

    Raises:
        TraceError: naming file, line and field for any bad value or a duplicated pod name.
    """
    p = Path(path)
    cat = default_catalog()
    pods = []
    seen: set[str] = set()
    for row in rows(p, "openb pod list"):
        name = row.text("name")
        if name in seen:
            raise row.error("name", f"pod {name!r} appears twice", "give every pod a unique name")
        seen.add(name)
        num_gpu = row.whole("num_gpu", maximum=MAX_DEVICES)
        spec = tuple(s.strip() for s in row.text("gpu_spec", default="").split("|") if s.strip())
        for model in spec:
            if cat.find(model) is None:
                raise row.error("gpu_spec", f"GPU model {model!r} is unknown to the catalog",
                                "use catalog names or aliases (gpusched/include/catalog/accelerators.json)")
        gpu_milli = 0
        if num_gpu:
            gpu_milli = row.whole("gpu_milli", minimum=1 if num_gpu == 1 else 0, maximum=1000,
                                  default=None if num_gpu == 1 else 1000)
        isolation = row.text("isolation", default="any").strip().lower() or "any"
        if isolation not in ISOLATION_VALUES:
            raise row.error("isolation", f"{isolation!r} is not an isolation", "use any, hard or soft")
        if isolation == "hard" and not (num_gpu == 1 and gpu_milli < 1000):
            raise row.error("isolation", "hard isolation is for a fraction of one GPU",
                            "give num_gpu 1 and gpu_milli below 1000, or drop isolation")
        pods.append(
            OpenbPod(
                name=name,
                cpu_milli=row.whole("cpu_milli", maximum=_MAX_CPU_MILLI),
                memory_mib=row.whole("memory_mib", maximum=_MAX_MEMORY_MIB),
                num_gpu=num_gpu,
                gpu_milli=gpu_milli,
                gpu_spec=spec,
                isolation=isolation,
            )
        )
    return pods


def load_openb_lifetimes(path: Path | str) -> dict[str, tuple[float, float]]:
    """Pod name → (``creation_time``, ``deletion_time``) in seconds, from an openb pod list.

    An empty time counts as 0; a deletion before the creation is an error.
    """
    p = Path(path)
    times: dict[str, tuple[float, float]] = {}
    for row in rows(p, "openb pod list"):
        created = row.number("creation_time", maximum=_MAX_TIME_S, default=0.0)
        deleted = row.number("deletion_time", maximum=_MAX_TIME_S, default=0.0)
        if deleted and deleted < created:
            raise row.error("deletion_time", f"{deleted:g} is before creation_time {created:g}",
                            "give a deletion time after the creation time, or leave it empty")
        times[row.text("name")] = (created, deleted)
    return times


def load_gavel_jobs(path: Path | str, *, limit: int | None = None) -> list[TraceJob]:
    """Jobs of a Gavel job list, in arrival order.

    Reads both layouts: the continuous-single streams
    (``job_id,arrival_time_s,job_type,scale_factor,total_steps,duration_s_v100,…``) and
    ``msr_seed0_jobs_with_isolated_durations.csv`` (``vc,job_type,num_gpus(scale_factor),…,dur_s_v100``).
    Per-type durations are keyed by catalog model name (see :data:`GAVEL_MODELS`); a job with no
    duration on a type cannot finish there and gets ``inf`` for it; a job with none is skipped.

    Raises:
        TraceError: naming file, line and field for a negative, non-finite or non-numeric
            arrival, duration or GPU count, or a duplicated ``job_id``.
    """
    p = Path(path)
    jobs = []
    seen: set[str] = set()
    for number, row in enumerate(rows(p, "Gavel job")):
        if limit is not None and number >= limit:
            break
        durations: dict[str, float] = {}
        for short, model in GAVEL_MODELS.items():
            column = f"duration_s_{short}" if f"duration_s_{short}" in row.data else f"dur_s_{short}"
            value = row.number(column, minimum=0.0, maximum=_MAX_TIME_S, default=0.0)
            durations[model] = value if value > 0 else float("inf")
        finite = [d for d in durations.values() if d != float("inf")]
        if not finite:
            continue
        gpus_column = "scale_factor" if "scale_factor" in row.data else "num_gpus(scale_factor)"
        key = row.text("job_id", default=str(number))
        if key in seen:
            raise row.error("job_id", f"job {key!r} appears twice", "give every job a unique job_id")
        seen.add(key)
        jobs.append(
            TraceJob(
                key=key,
                arrival_s=row.number("arrival_time_s", maximum=_MAX_TIME_S, default=0.0),
                num_gpus=row.whole(gpus_column, minimum=1, maximum=MAX_DEVICES, default=1),
                duration_s=min(finite),
                durations=durations,
                job_type=row.text("job_type", default=""),
                group=row.text("vc", default=""),
            )
        )
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


def load_gavel_throughputs(path: Path | str) -> dict[str, dict[str, float]]:
    """Isolated throughput (steps/s) per GPU type and job type: ``{"v100": {"('A3C', 1)": 32.3}}``.

    Only the ``"null"`` entry (the job running alone) is kept; space-sharing pairs are dropped.
    """
    p = Path(path)
    fix = "pass Gavel's simulation_throughputs.json (a JSON object of GPU type → job → {\"null\": steps/s})"
    try:
        raw: Any = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceError(p, f"cannot be read ({exc.strerror or exc})", fix) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TraceError(p, f"is not JSON ({' '.join(str(exc).split())[:120]})", fix) from None
    if not isinstance(raw, dict):
        raise TraceError(p, "is not a JSON object", fix)
    table: dict[str, dict[str, float]] = {}
    for gpu_type, jobs in raw.items():
        if not isinstance(jobs, dict):
            continue
        speeds = {}
        for job, entry in jobs.items():
            speed = entry.get("null") if isinstance(entry, dict) else None
            if isinstance(speed, bool) or not isinstance(speed, int | float):
                continue
            if not math.isfinite(speed) or speed < 0:
                raise TraceError(p, f"throughput of {gpu_type}/{job[:60]} is {speed!r}",
                                 "give finite, non-negative steps/s", field="null")
            speeds[job] = float(speed)
        table[gpu_type] = speeds
    return table


_PADDED_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def _parse_ts(text: str, what: str) -> float:
    stamp = text.strip()
    try:
        if _PADDED_TIMESTAMP.fullmatch(stamp):  # the traces' own form, without strptime's cost
            return datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()
        return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise ConfigurationError(
            f"{what} {text!r} is not a time; write YYYY-MM-DD or 'YYYY-MM-DD HH:MM:SS' (UTC)"
        ) from None


def _window_bound(text: str | None, what: str) -> float | None:
    if text is None:
        return None
    return _parse_ts(text if " " in text.strip() else text.strip() + " 00:00:00", what)


def load_philly_jobs(
    path: Path | str,
    *,
    start: str | None = None,
    end: str | None = None,
    clusters: frozenset[str] | None = None,
    max_gpus: int | None = None,
    origin: str | None = None,
) -> list[TraceJob]:
    """Philly jobs (``timestamp,duration,num_gpus,gpu_time,cluster``) sorted by submission.

    ``start``/``end`` (``YYYY-MM-DD[ HH:MM:SS]``, UTC, end exclusive) select a window;
    ``clusters`` keeps only those virtual clusters; ``max_gpus`` drops larger jobs. Arrival times
    are seconds from the first kept job. Jobs with zero duration or zero GPUs are skipped.

    Raises:
        ConfigurationError: a window bound that is not a date, or an end not after the start.
        TraceError: naming file, line and field for a bad timestamp, a negative, non-finite or
            non-numeric duration, or a GPU count that is not a whole number 0–4096.

    ``origin`` (same format) measures arrival times from that instant instead (a history window
    before a replay then gets negative arrivals).
    """
    p = Path(path)
    lo = _window_bound(start, "window start")
    hi = _window_bound(end, "window end")
    if lo is not None and hi is not None and hi <= lo:
        raise ConfigurationError(f"window end {end!r} is not after its start {start!r}; swap them")
    kept: list[tuple[float, int, float, str]] = []
    for row in rows(p, "Philly (philly_jobs.csv)"):
        stamp = row.text("timestamp")
        try:
            ts = _parse_ts(stamp, "timestamp")
        except ConfigurationError:
            raise row.error("timestamp", f"{stamp[:40]!r} is not a time",
                            "write 'YYYY-MM-DD HH:MM:SS'; is this philly_jobs.csv?") from None
        duration = row.number("duration", maximum=_MAX_TIME_S)
        gpus = row.whole("num_gpus", maximum=MAX_DEVICES)
        if (lo is not None and ts < lo) or (hi is not None and ts >= hi):
            continue
        if duration <= 0 or gpus <= 0 or (max_gpus is not None and gpus > max_gpus):
            continue
        cluster = row.text("cluster", default="")
        if clusters is not None and cluster not in clusters:
            continue
        kept.append((ts, gpus, duration, cluster))
    kept.sort(key=lambda item: item[0])
    zero = _window_bound(origin, "origin")
    origin_s = zero if zero is not None else kept[0][0] if kept else 0.0
    return [
        TraceJob(key=str(i), arrival_s=ts - origin_s, num_gpus=g, duration_s=d, group=c)
        for i, (ts, g, d, c) in enumerate(kept)
    ]
