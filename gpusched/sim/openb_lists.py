"""openb pod lists built the way the family is built: seeded re-weightings of the ``default`` list.

The openb family (FGD, Weng et al. ATC '23) has a ``default`` pod list and lists that re-weight
it. Measured over the shared traces' CSVs (not taken from the paper):

* ``cpuNNN``: only the CPU-only tasks change (drawn from default's CPU-only tasks); the GPU
  tasks are default's. The knob is the **CPU ratio** = CPU of the CPU-only tasks / CPU of the
  GPU tasks: default 0.290, cpu050 0.098, cpu100 0.212, cpu200 0.468.
* ``gpushareNN``: the GPU tasks are redrawn from default's (same task count, 8,152; CPU-only
  tasks kept) so that **sharing** tasks (one GPU, ``gpu_milli`` < 1000) make up NN % of the
  total GPU request (default 28.5 %).
* ``gpuspecNN``: the same tasks; NN % of the GPU request is pinned to GPU models through
  ``gpu_spec``. The spec depends on the task's shape (sharing tasks get ``T4``/``P100``, 8-GPU
  tasks ``G2``/``G3``…): :func:`spec_distribution` reads it off the family's gpuspec lists.
* ``multigpuNN``: default's tasks plus tasks drawn from default's multi-GPU tasks until those
  make up NN % of the GPU request.

:func:`build` applies a :class:`Recipe` (any mix of the four knobs) to default's rows. Every
step draws from one seeded :class:`random.Random` of its own, as a *prefix* of a fixed
sequence (a random order of the originals, then draws with replacement), so the step can pick
the length whose ratio is closest to the target and a recipe that asks for default's own mix
gives default back. Rows are dicts of the CSV's text columns, copied whole (times, qos…);
output names are ``openb-pod-NNNN`` in output order. Pure: no file is read or written here.
"""

from __future__ import annotations

import csv
import hashlib
import io
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "Recipe",
    "Row",
    "SpecDistribution",
    "build",
    "cpu_ratio_for",
    "kind",
    "measure",
    "parse_csv",
    "render_csv",
    "sha256_text",
    "spec_distribution",
]

Row = dict[str, str]
"""One task of a pod list: column → text, as the CSV has it."""

SpecDistribution = Mapping[str, Sequence[tuple[str, int]]]
"""Task shape (:func:`kind`) → ``(gpu_spec, count)`` pairs, most frequent first."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """How to re-weight default: each knob left ``None`` keeps default's value.

    Attributes:
        name: the list's name (``openb_pod_list_<name>.csv``).
        seed: seeds every draw.
        cpu_ratio: target CPU of the CPU-only tasks / CPU of the GPU tasks.
        gpushare: target share (0–1) of the GPU request made by sharing tasks.
        gpuspec: target share (0–1) of the GPU request pinned to GPU models.
        multigpu: target share (0–1) of the GPU request made by multi-GPU tasks (tasks added).
    """

    name: str
    seed: int = 0
    cpu_ratio: float | None = None
    gpushare: float | None = None
    gpuspec: float | None = None
    multigpu: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The recipe as plain JSON data."""
        return asdict(self)


def _num_gpu(row: Row) -> int:
    return int(row.get("num_gpu") or 0)


def gpu_request(row: Row) -> int:
    """Milli-GPU the task asks for (a fraction of one GPU, or whole GPUs)."""
    n = _num_gpu(row)
    if n == 0:
        return 0
    if n == 1:
        return int(row.get("gpu_milli") or 1000)
    return 1000 * n


def _cpu(row: Row) -> int:
    return int(row.get("cpu_milli") or 0)


def _sharing(row: Row) -> bool:
    return _num_gpu(row) == 1 and gpu_request(row) < 1000


def kind(row: Row) -> str:
    """The task's shape: ``cpu``, ``share`` (part of one GPU) or ``gpuN`` (N whole GPUs)."""
    n = _num_gpu(row)
    if n == 0:
        return "cpu"
    return "share" if _sharing(row) else f"gpu{n}"


def measure(rows: Sequence[Row]) -> dict[str, Any]:
    """The family's ratios of a pod list (see the module doc), and its counts."""
    gpu_rows = [r for r in rows if _num_gpu(r) > 0]
    total = sum(gpu_request(r) for r in gpu_rows)
    gpu_cpu = sum(_cpu(r) for r in gpu_rows)
    cpu_only = sum(_cpu(r) for r in rows if _num_gpu(r) == 0)

    def share(pick: Callable[[Row], bool]) -> float:
        return round(sum(gpu_request(r) for r in gpu_rows if pick(r)) / total, 4) if total else 0.0

    return {
        "tasks": len(rows),
        "cpu_only_tasks": len(rows) - len(gpu_rows),
        "gpu_tasks": len(gpu_rows),
        "gpu_request_milli": total,
        "cpu_ratio": round(cpu_only / gpu_cpu, 4) if gpu_cpu else 0.0,
        "gpushare": share(_sharing),
        "gpuspec": share(lambda r: bool(r.get("gpu_spec", "").strip())),
        "multigpu": share(lambda r: _num_gpu(r) > 1),
    }


def cpu_ratio_for(nnn: float, anchors: Mapping[float, float]) -> float:
    """The CPU ratio a ``cpuNNN`` list would have, from the family's measured (NNN → ratio) points.

    Piecewise linear between the anchors; beyond them the nearest segment's slope is extended.
    """
    points = sorted(anchors.items())
    if len(points) < 2:
        raise ValueError("give at least two measured (NNN, ratio) points")
    segment = 0
    while segment < len(points) - 2 and nnn > points[segment + 1][0]:
        segment += 1
    (x0, y0), (x1, y1) = points[segment], points[segment + 1]
    return round(y0 + (y1 - y0) * (nnn - x0) / (x1 - x0), 4)


def spec_distribution(lists: Iterable[Sequence[Row]]) -> dict[str, list[tuple[str, int]]]:
    """How often each ``gpu_spec`` pins a task of each shape, pooled over the given lists."""
    counts: dict[str, Counter[str]] = {}
    for rows in lists:
        for row in rows:
            spec = row.get("gpu_spec", "").strip()
            if spec and _num_gpu(row) > 0:
                counts.setdefault(kind(row), Counter())[spec] += 1
    return {k: sorted(c.items(), key=lambda kv: (-kv[1], kv[0])) for k, c in sorted(counts.items())}


def _sequence(rng: random.Random, originals: Sequence[Row], length: int) -> list[Row]:
    """The first ``length`` items of: a random order of ``originals``, then draws with replacement."""
    order = list(originals)
    rng.shuffle(order)
    if length <= len(order):
        return order[:length]
    return order + [rng.choice(originals) for _ in range(length - len(order))] if originals else order


def _closest(lengths: range, ratio_of: Callable[[int], float], target: float) -> int:
    """The length in ``lengths`` whose ratio is closest to ``target`` (ratio grows with length)."""
    lo, hi = lengths.start, lengths.stop - 1
    while lo < hi:  # first length whose ratio reaches the target
        mid = (lo + hi) // 2
        if ratio_of(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    best = lo
    if lo > lengths.start and abs(ratio_of(lo - 1) - target) <= abs(ratio_of(lo) - target):
        best = lo - 1
    return best


def _keep_order(rows: Sequence[Row], chosen: Sequence[Row]) -> list[Row]:
    """``chosen`` with the originals among them in ``rows``' order, extra draws after them."""
    picked: Counter[int] = Counter(id(r) for r in chosen)
    kept = []
    for r in rows:
        if picked[id(r)]:
            picked[id(r)] -= 1
            kept.append(r)
    extra = []
    seen: Counter[int] = Counter()
    originals: Counter[int] = Counter(id(r) for r in kept)
    for r in chosen:
        seen[id(r)] += 1
        if seen[id(r)] > originals[id(r)]:
            extra.append(dict(r))  # a copy: a drawn twin is its own task
    return kept + extra


def _gpushare(rows: list[Row], target: float, rng: random.Random) -> list[Row]:
    cpu_rows = [r for r in rows if _num_gpu(r) == 0]
    gpu_rows = [r for r in rows if _num_gpu(r) > 0]
    share = [r for r in gpu_rows if _sharing(r)]
    whole = [r for r in gpu_rows if not _sharing(r)]
    if not share or not whole:
        raise ValueError("a gpushare recipe needs both sharing and whole-GPU tasks in the base list")
    n = len(gpu_rows)
    share_seq = _sequence(rng, share, n)
    whole_seq = _sequence(rng, whole, n)
    share_sum = [0]
    for r in share_seq:
        share_sum.append(share_sum[-1] + gpu_request(r))
    whole_sum = [0]
    for r in whole_seq:
        whole_sum.append(whole_sum[-1] + gpu_request(r))

    def ratio(k: int) -> float:  # k sharing tasks, n - k whole ones
        total = share_sum[k] + whole_sum[n - k]
        return share_sum[k] / total if total else 0.0

    k = _closest(range(1, n), ratio, target)
    return _keep_order(rows, cpu_rows + share_seq[:k] + whole_seq[: n - k])


def _multigpu(rows: list[Row], target: float, rng: random.Random) -> list[Row]:
    multi = [r for r in rows if _num_gpu(r) > 1]
    if not multi:
        raise ValueError("a multigpu recipe needs multi-GPU tasks in the base list")
    other = sum(gpu_request(r) for r in rows if _num_gpu(r) in (0, 1))
    if target >= 1.0:
        raise ValueError("multigpu must be below 1")
    base = sum(gpu_request(r) for r in multi)
    need = max(0, int(target * other / (1 - target)) - base)
    extra_max = 2 * (need // min(gpu_request(r) for r in multi) + 1)
    draws = [rng.choice(multi) for _ in range(extra_max)]
    sums = [base]
    for r in draws:
        sums.append(sums[-1] + gpu_request(r))
    k = _closest(range(0, extra_max + 1), lambda j: sums[j] / (sums[j] + other), target)
    return rows + [dict(r) for r in draws[:k]]


def _gpuspec(rows: list[Row], target: float, rng: random.Random, specs: SpecDistribution) -> list[Row]:
    out = [dict(r) for r in rows]
    total = sum(gpu_request(r) for r in out)
    free = [r for r in out if _num_gpu(r) > 0 and not r.get("gpu_spec", "").strip()]
    pinned0 = sum(gpu_request(r) for r in out if r.get("gpu_spec", "").strip())
    rng.shuffle(free)
    sums = [pinned0]
    for r in free:
        sums.append(sums[-1] + gpu_request(r))
    k = _closest(range(0, len(free) + 1), lambda j: sums[j] / total, target)
    for r in free[:k]:
        r["gpu_spec"] = _draw_spec(rng, kind(r), specs)
    return out


def _draw_spec(rng: random.Random, shape: str, specs: SpecDistribution) -> str:
    """A spec for a task of ``shape``; an N-GPU shape never seen pinned borrows the next larger one."""
    table = specs.get(shape)
    if not table and shape.startswith("gpu"):
        n = int(shape[3:])
        larger = sorted((int(k[3:]), k) for k in specs if k.startswith("gpu") and int(k[3:]) >= n)
        table = specs[larger[0][1]] if larger else None
    if not table:
        raise ValueError(f"the spec distribution has no entry for {shape!r} tasks")
    names = [s for s, _ in table]
    return rng.choices(names, weights=[c for _, c in table])[0]


def _cpu_only(rows: list[Row], target: float, rng: random.Random) -> list[Row]:
    cpu_rows = [r for r in rows if _num_gpu(r) == 0]
    gpu_rows = [r for r in rows if _num_gpu(r) > 0]
    if not cpu_rows:
        raise ValueError("a cpu recipe needs CPU-only tasks in the base list")
    gpu_cpu = sum(_cpu(r) for r in gpu_rows)
    mean = sum(_cpu(r) for r in cpu_rows) / len(cpu_rows)
    longest = max(len(cpu_rows), 2 * int(target * gpu_cpu / max(mean, 1.0)) + 1)
    seq = _sequence(rng, cpu_rows, longest)
    sums = [0]
    for r in seq:
        sums.append(sums[-1] + _cpu(r))
    k = _closest(range(0, longest + 1), lambda j: sums[j] / gpu_cpu, target)
    return _keep_order(rows, gpu_rows + seq[:k])


def build(default: Sequence[Row], recipe: Recipe, *, specs: SpecDistribution | None = None) -> list[Row]:
    """Default's rows re-weighted by ``recipe``, renamed ``openb-pod-NNNN`` (same for the same seed).

    Steps, each with its own seeded generator: sharing share (GPU tasks redrawn, count kept),
    multi-GPU share (tasks added), pinned share (specs from ``specs``), CPU ratio (CPU-only tasks
    redrawn). A step whose knob is ``None`` leaves the rows as they are.

    Raises:
        ValueError: a target outside 0–1 (ratios ≥ 0), a base list lacking the tasks a step
            draws from, or a ``gpuspec`` recipe without ``specs``.
    """
    for label, value in (("gpushare", recipe.gpushare), ("gpuspec", recipe.gpuspec),
                         ("multigpu", recipe.multigpu)):
        if value is not None and not 0.0 <= value < 1.0:
            raise ValueError(f"{label} must be a share from 0 to below 1, not {value}")
    if recipe.cpu_ratio is not None and recipe.cpu_ratio < 0:
        raise ValueError(f"cpu_ratio must be ≥ 0, not {recipe.cpu_ratio}")

    def rng(step: str) -> random.Random:
        return random.Random(f"openb-lists:{recipe.seed}:{step}")

    rows = [dict(r) for r in default]
    if recipe.gpushare is not None:
        rows = _gpushare(rows, recipe.gpushare, rng("gpushare"))
    if recipe.multigpu is not None:
        rows = _multigpu(rows, recipe.multigpu, rng("multigpu"))
    if recipe.gpuspec is not None:
        if specs is None:
            raise ValueError("a gpuspec recipe needs the spec distribution (spec_distribution)")
        rows = _gpuspec(rows, recipe.gpuspec, rng("gpuspec"), specs)
    if recipe.cpu_ratio is not None:
        rows = _cpu_only(rows, recipe.cpu_ratio, rng("cpu"))
    width = max(4, len(str(len(rows) - 1)))
    for i, r in enumerate(rows):
        r["name"] = f"openb-pod-{i:0{width}d}"
    return rows


def parse_csv(text: str) -> tuple[list[str], list[Row]]:
    """The columns and rows of a pod-list CSV's text."""
    reader = csv.DictReader(io.StringIO(text))
    return list(reader.fieldnames or []), [dict(r) for r in reader]


def render_csv(columns: Sequence[str], rows: Iterable[Row]) -> str:
    """The pod list as CSV text with exactly ``columns`` (a missing value is empty)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({c: r.get(c, "") for c in columns})
    return out.getvalue()


def sha256_text(text: str) -> str:
    """Hex SHA-256 of the UTF-8 text (what the manifest records for a list)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
