"""Is a difference from the published openb results more than seed noise?

The FGD paper published ten runs per (pod list, policy) — tuning seeds 42–51 of Go's generator —
and our harness makes ten runs from its own seeds, so no single run can be replayed and the two
medians differ by seed noise even when the procedures agree. This module compares the two sets of
ten values with a rank test instead of a threshold on the medians:

* calibration (Random, BestFit, the ``fgd`` preset against the same published policy): two-sided
  exact Mann–Whitney U test per pod list, then Holm's step-down correction over every comparison
  of the table, so that one outlier among ~40 tests is not read as a harness error;
* "below the published FGD" (``gpusched`` and the ``fgd-*`` presets): one-sided test that our
  values are lower, with the same correction.

Input: ``results/openb/published_per_seed.tsv`` (``scripts/openb_published_seeds.py``) and the
per-seed ``unallocated_gpu_pct`` of our JSON runs. scipy is imported inside :func:`rank_p`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Comparison",
    "compare",
    "comparison_table",
    "holm",
    "ours_per_seed",
    "rank_p",
    "read_published_seeds",
    "report_sections",
]

CALIBRATED = ("random", "best-fit", "fgd")
AGAINST_FGD = ("gpusched", "fgd-full", "fgd-lookahead", "fgd-memory")
ALPHA = 0.05


@dataclass(frozen=True, slots=True)
class Comparison:
    """One pod list × one of our policies against one published policy's ten seeds."""

    workload: str
    ours: str
    published: str
    ours_median: float
    published_median: float
    p: float
    p_holm: float

    @property
    def delta(self) -> float:
        return self.ours_median - self.published_median


def read_published_seeds(tsv: Path) -> dict[tuple[str, str], tuple[float, ...]]:
    """``{(workload, policy): per-seed unallocated GPU %}`` from published_per_seed.tsv."""
    out: dict[tuple[str, str], tuple[float, ...]] = {}
    for line in tsv.read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#") or line.startswith("workload\t"):
            continue
        cells = line.split("\t")
        out[(cells[0], cells[1])] = tuple(float(c) for c in cells[2:])
    return out


Alternative = Literal["two-sided", "less"]


def rank_p(ours: Sequence[float], theirs: Sequence[float], alternative: Alternative) -> float:
    """p-value of the Mann–Whitney U test of ``ours`` against ``theirs`` (exact without ties,
    the normal approximation with ties, as scipy chooses)."""
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(ours, theirs, alternative=alternative).pvalue)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order (monotone, capped at 1)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted = [0.0] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def compare(
    ours: Mapping[tuple[str, str], Sequence[float]],
    published: Mapping[tuple[str, str], Sequence[float]],
    pairs: Sequence[tuple[str, str]],
    alternative: Alternative,
) -> list[Comparison]:
    """Every workload that both sides ran, for each (our policy, published policy) pair; Holm's
    correction runs over the whole returned list."""
    raw: list[tuple[str, str, str, Sequence[float], Sequence[float]]] = []
    for workload in sorted({w for w, _ in ours}):
        for mine, theirs in pairs:
            a, b = ours.get((workload, mine)), published.get((workload, theirs))
            if a and b:
                raw.append((workload, mine, theirs, a, b))
    ps = [rank_p(a, b, alternative) for *_, a, b in raw]
    return [
        Comparison(w, mine, theirs, statistics.median(a), statistics.median(b), p, q)
        for (w, mine, theirs, a, b), p, q in zip(raw, ps, holm(ps), strict=True)
    ]


def ours_per_seed(runs: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], list[float]]:
    """Per-seed values of our JSON runs (``<workload>__<policy>`` → ``unallocated_gpu_pct``), only
    runs of the FGD-procedure harness (those with a ``measure``)."""
    out: dict[tuple[str, str], list[float]] = {}
    for stem, data in runs.items():
        if "__" in stem and "measure" in data and data.get("unallocated_gpu_pct"):
            workload, policy = stem.split("__", 1)
            out[(workload, policy)] = [float(v) for v in data["unallocated_gpu_pct"]]
    return out


def comparison_table(rows: Sequence[Comparison], title: str) -> list[str]:
    """Markdown lines: one row per comparison, the significant ones (Holm p < 0.05) in bold."""
    lines = [
        f"| pod list | ours | published | ours (median) | published (median) | Δ | p | p (Holm, {title}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "**" if r.p_holm < ALPHA else ""
        lines.append(
            f"| {r.workload.replace('openb_pod_list_', '')} | {r.ours} | {r.published} | {r.ours_median:.2f} "
            f"| {r.published_median:.2f} | {r.delta:+.2f} | {r.p:.3f} | {mark}{r.p_holm:.3f}{mark} |"
        )
    return lines


def report_sections(runs: Mapping[str, Mapping[str, Any]], published_tsv: Path, scope: str = "") -> list[str]:
    """The two markdown sections of the openb report: calibration (two-sided) and below the
    published FGD (one-sided), with a one-line count of significant rows each. ``scope`` names
    the pod lists in the heading (e.g. lists that were never used to develop anything); the Holm
    correction runs within the ``runs`` given."""
    published = read_published_seeds(published_tsv)
    ours = ours_per_seed(runs)
    calibration = compare(ours, published, [(p, p) for p in CALIBRATED], "two-sided")
    below = compare(ours, published, [(p, "fgd") for p in AGAINST_FGD], "less")
    heading = "## Is a difference more than seed noise?" + (f" ({scope})" if scope else "")
    lines = [heading, ""]
    lines.append(
        "Our ten seeds against the ten published ones (`published_per_seed.tsv`), Mann–Whitney U "
        "test; Holm's correction over every row of a table; **bold** = significant at 5 %."
    )
    lines.append("")
    lines.append("### Calibration: ours vs the same published policy (two-sided)")
    lines.append("")
    lines.extend(comparison_table(calibration, f"{len(calibration)} tests"))
    off = [r for r in calibration if r.p_holm < ALPHA]
    lines.append("")
    named = ", ".join(f"{r.workload.replace('openb_pod_list_', '')} {r.ours}" for r in off)
    tail = f" ({named})." if off else "."
    lines.append(f"Significant after correction: {len(off)} of {len(calibration)}{tail}")
    lines.append("")
    lines.append("### Below the published FGD (one-sided: ours lower)")
    lines.append("")
    lines.extend(comparison_table(below, f"{len(below)} tests"))
    lines.append("")
    for policy in AGAINST_FGD:
        rows = [r for r in below if r.ours == policy]
        if rows:
            hits = sum(r.p_holm < ALPHA for r in rows)
            lines.append(f"- {policy}: significantly below on {hits} of {len(rows)} lists.")
    lines.append("")
    return lines
