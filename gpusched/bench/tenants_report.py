"""Table and PNG of one ``gpusched bench tenants`` result (:mod:`gpusched.bench.tenants`).

matplotlib is imported inside :func:`tenants_png` (Agg backend, :func:`gpusched.extras.pyplot`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpusched.bench.report import _fmt
from gpusched.extras import pyplot

__all__ = ["tenants_png", "tenants_table"]


def tenants_table(result: dict[str, Any]) -> str:
    """Markdown tables of one ``gpusched bench tenants`` result: tenants, then partitions."""
    quota, base = result["quota"], result["baseline"]
    lines = [
        "| tenant (VC) | partition | demand A100-h | budget | used, quota | used, no quota "
        "| largest task | overshoot (tasks), quota | overshoot (tasks), no quota |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in quota["tenants"].items():
        b = base["tenants"][name]
        lines.append(
            f"| {name} | {row['partition']} | {_fmt(row['demand_gpu_hours'], 1)} | "
            f"{row['budget_gpu_hours']} | "
            f"{_fmt(row['worst_period_gpu_hours'], 1)} | {_fmt(b['worst_period_gpu_hours'], 1)} | "
            f"{_fmt(row['largest_task_gpu_hours'], 1)} | {_fmt(row['overshoot_tasks'])} | "
            f"{_fmt(b['overshoot_tasks'])} |"
        )
    lines += ["", "| partition | target % | share of fleet %, quota (no quota) | share of used %, quota "
              "(no quota) | shortfall pts, quota (no quota) | borrowed GPU-h, quota (no quota) |",
              "|---|---|---|---|---|---|"]
    for name, row in quota["partitions"].items():
        b = base["partitions"][name]
        keys = (("share_of_fleet_pct", 2), ("share_of_used_pct", 2), ("shortfall_pts", 2),
                ("borrowed_gpu_hours", 1))
        cells = [f"{_fmt(row[k], d)} ({_fmt(b[k], d)})" for k, d in keys]
        lines.append(f"| {name} | {row['target_pct']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tenants_png(result: dict[str, Any], path: Path) -> Path:
    """Per-partition daily share of the fleet vs target, and per-tenant use vs budget (quota and not)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, row) in enumerate(result["quota"]["partitions"].items()):
        colour = f"C{i}"
        days = range(1, len(row["daily_share_of_fleet_pct"]) + 1)
        left.plot(days, row["daily_share_of_fleet_pct"], "-o", color=colour, label=f"{name}, quota")
        left.plot(days, result["baseline"]["partitions"][name]["daily_share_of_fleet_pct"], ":",
                  color=colour, label=f"{name}, no quota")
        left.axhline(row["target_pct"], color=colour, lw=0.8, ls="--")
    left.set_xlabel("day of the week")
    left.set_ylabel("GPU-hours, % of the fleet (dashed: share)")
    left.legend(fontsize=7)
    names = list(result["quota"]["tenants"])
    x = range(len(names))
    budget = [result["quota"]["tenants"][n]["budget_gpu_hours"] or 0 for n in names]
    for shift, run, label in ((-0.2, "quota", "used, quota"), (0.2, "baseline", "used, no quota")):
        used = [result[run]["tenants"][n]["worst_period_gpu_hours"] for n in names]
        right.bar([i + shift for i in x], used, 0.4, label=label, alpha=1.0 if run == "quota" else 0.6)
    right.scatter(list(x), budget, marker="_", s=400, color="k", label="budget", zorder=3)
    right.set_xticks(list(x), names, rotation=30, fontsize=8)
    right.set_ylabel("A100-h in the worst weekly period")
    right.legend(fontsize=7)
    fig.suptitle(f"Philly {result['window'][0]}, {result['nodes']}x{result['gpus_per_node']} "
                 f"{result['model']}, durations {result['durations']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
