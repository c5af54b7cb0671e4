"""How much room the openb lists leave below the published FGD, for any placement.

Each openb run records, per seed, the lowest unallocated GPU % any placement of the same arrivals
could read (``unallocated_gpu_pct_bound``, :mod:`gpusched.sim.packing_bound`: GPU capacity only,
nodes, CPU, memory, models and arrival order relaxed). This module sets its median beside the
published FGD and our presets: the *room* is published FGD − bound, and a preset's share is how
much of that room it takes. A list where the room is small cannot be beaten by much by any rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["bound_medians", "headroom_section"]

SHOWN = ("fgd", "gpusched", "fgd-full", "fgd-lookahead", "fgd-memory")


def bound_medians(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``{workload: median over seeds of the bound}``; the bound depends on the seed's arrivals
    only, so any policy's run of a list gives it (the run with the most seeds is used)."""
    best: dict[str, list[float]] = {}
    for stem, data in runs.items():
        values = data.get("unallocated_gpu_pct_bound")
        if "__" in stem and values:
            workload = stem.split("__", 1)[0]
            if len(values) > len(best.get(workload, [])):
                best[workload] = [float(v) for v in values]
    return {w: statistics.median(v) for w, v in best.items()}


def headroom_section(
    runs: Mapping[str, Mapping[str, Any]],
    published: Mapping[tuple[str, str], Sequence[float]],
    scope: str = "",
) -> list[str]:
    """Markdown lines: per pod list the bound, the published FGD (median of its seeds), the room
    between them, and each shown preset's value with the share of the room it takes."""
    bounds = bound_medians(runs)
    if not bounds:
        return []
    medians = {
        (stem.split("__", 1)[0], stem.split("__", 1)[1]): data.get("unallocated_gpu_pct_median")
        for stem, data in runs.items()
        if "__" in stem
    }
    heading = "## Room below the published FGD for any placement" + (f" ({scope})" if scope else "")
    lines = [
        heading,
        "",
        "Bound = the lowest unallocated GPU % any placement of the same arrivals can read (GPU "
        "capacity only; median of seeds); room = published FGD − bound; in brackets the share of "
        "the room a preset takes (negative: above the published FGD).",
        "",
        "| pod list | bound | FGD (pub.) | room | " + " | ".join(SHOWN) + " |",
        "|---|---|---|---|" + "---|" * len(SHOWN),
    ]
    for workload in sorted(bounds):
        fgd = published.get((workload, "fgd"))
        if not fgd:
            continue
        pub = statistics.median(fgd)
        room = pub - bounds[workload]
        cells = []
        for policy in SHOWN:
            value = medians.get((workload, policy))
            share = f" ({(pub - value) / room:+.0%})" if value is not None and room > 0 else ""
            cells.append("—" if value is None else f"{value:.2f}{share}")
        name = workload.replace("openb_pod_list_", "")
        row = [name, f"{bounds[workload]:.2f}", f"{pub:.2f}", f"{room:.2f}", *cells]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines
