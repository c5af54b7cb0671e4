"""Build the openb test lists of :mod:`gpusched.sim.openb_lists` from the traces and record them.

The lists are derived data and are not committed: :func:`build_lists` writes them as CSV and
returns a manifest (each list's recipe, seed, row count, achieved ratios and SHA-256, and what
they were derived from) so anyone can rebuild them with ``gpusched bench openb-lists`` and check.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpusched.errors import ConfigurationError
from gpusched.sim.openb_lists import (
    Recipe,
    build,
    cpu_ratio_for,
    measure,
    parse_csv,
    render_csv,
    sha256_text,
    spec_distribution,
)

__all__ = ["CPU_ANCHORS", "SPEC_SOURCES", "build_lists", "built_recipes", "lists_report"]

CPU_ANCHORS = (50, 100, 200)
"""The family's ``cpuNNN`` lists whose measured CPU ratios place a new NNN (with default's)."""

SPEC_SOURCES = (10, 20, 25)
"""The family's ``gpuspecNN`` lists the pinned specs are drawn like."""


def built_recipes(cpu_anchors: dict[float, float]) -> list[Recipe]:
    """The held-out lists: none of them is a list of the family (develop on them, tune on none)."""
    return [
        Recipe("cpu150", seed=1, cpu_ratio=cpu_ratio_for(150, cpu_anchors)),
        Recipe("cpu300", seed=2, cpu_ratio=cpu_ratio_for(300, cpu_anchors)),
        Recipe("gpushare50", seed=3, gpushare=0.50),
        Recipe("gpushare90", seed=4, gpushare=0.90),
        Recipe("gpuspec30", seed=5, gpuspec=0.30),
        Recipe("multigpu35", seed=6, multigpu=0.35),
        Recipe("cpu200-gpushare60", seed=7, cpu_ratio=cpu_ratio_for(200, cpu_anchors), gpushare=0.60),
    ]


def _read(path: Path) -> tuple[list[str], list[dict[str, str]], str]:
    if not path.is_file():
        raise ConfigurationError(
            f"{path} is not there; pass --traces with the folder holding openb/ (or set GPUSCHED_TRACES)"
        )
    text = path.read_text(encoding="utf-8")
    columns, rows = parse_csv(text)
    return columns, rows, text


def build_lists(traces: Path, out: Path, *, only: Sequence[str] = ()) -> dict[str, Any]:
    """Write each built list as ``out/openb_pod_list_<name>.csv``; returns the manifest."""
    folder = traces / "openb"
    columns, default, default_text = _read(folder / "openb_pod_list_default.csv")
    sources: dict[str, str] = {"openb_pod_list_default.csv": sha256_text(default_text)}
    anchors: dict[float, float] = {}
    for nnn in CPU_ANCHORS:
        name = f"openb_pod_list_cpu{nnn:03d}.csv"
        _, rows, text = _read(folder / name)
        anchors[float(nnn)] = measure(rows)["cpu_ratio"]
        sources[name] = sha256_text(text)
    spec_lists = []
    for nn in SPEC_SOURCES:
        name = f"openb_pod_list_gpuspec{nn}.csv"
        _, rows, text = _read(folder / name)
        spec_lists.append(rows)
        sources[name] = sha256_text(text)
    specs = spec_distribution(spec_lists)
    recipes = built_recipes(anchors)
    unknown = set(only) - {r.name for r in recipes}
    if unknown:
        names = ", ".join(r.name for r in recipes)
        raise ConfigurationError(f"no built list named {', '.join(sorted(unknown))}; choose from {names}")
    out.mkdir(parents=True, exist_ok=True)
    lists = []
    for recipe in recipes:
        if only and recipe.name not in only:
            continue
        rows = build(default, recipe, specs=specs)
        text = render_csv(columns, rows)
        file = f"openb_pod_list_{recipe.name}.csv"
        (out / file).write_text(text, encoding="utf-8")
        achieved = measure(rows)
        lists.append({
            "file": file,
            "recipe": recipe.as_dict(),
            "rows": len(rows),
            "achieved": achieved,
            "sha256": sha256_text(text),
        })
    return {
        "generator": "gpusched.sim.openb_lists",
        "command": "gpusched bench openb-lists --out DIR",
        "base": {"file": "openb_pod_list_default.csv", **measure(default)},
        "sources_sha256": sources,
        "cpu_ratio_anchors": {"default": measure(default)["cpu_ratio"],
                              **{f"cpu{int(k):03d}": v for k, v in sorted(anchors.items())}},
        "cpu_ratio_rule": "cpuNNN's ratio by linear interpolation of the family's (NNN, ratio) points, "
                          "the 100-200 slope extended beyond 200",
        "spec_distribution": {k: dict(v) for k, v in specs.items()},
        "lists": lists,
    }


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def lists_report(folder: Path, *, policies: Sequence[str] = ("fgd", "gpusched", "best-fit")) -> str:
    """Markdown of the openb benchmark on the built lists: ``folder`` holds ``lists.json`` and the
    ``openb_pod_list_<name>__<policy>.json`` results of ``gpusched bench openb``.

    Per list: each policy's median unallocated GPU %, Δ = gpusched − fgd, the median GPU-only bound,
    the distance-to-bound ratio (gpusched − bound) / (fgd − bound), the one-sided Mann–Whitney U
    p-value of gpusched < fgd over the seeds and the seeds on which gpusched is lower (same seed,
    same arrivals).
    """
    from scipy.stats import mannwhitneyu  # local: scipy only for the report

    manifest = json.loads((folder / "lists.json").read_text(encoding="utf-8"))
    head = ["list", *policies, "Δ gpusched − fgd", "bound", "(gps − bound)/(fgd − bound)",
            "MWU p (gpusched < fgd)", "seeds gpusched < fgd", "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for item in manifest["lists"]:
        stem = Path(item["file"]).stem
        runs = {}
        for policy in policies:
            path = folder / f"{stem}__{policy}.json"
            if path.is_file():
                runs[policy] = json.loads(path.read_text(encoding="utf-8"))
        if "gpusched" not in runs or "fgd" not in runs:
            continue
        gps, fgd = runs["gpusched"], runs["fgd"]
        bound = _median(gps["unallocated_gpu_pct_bound"])
        delta = gps["unallocated_gpu_pct_median"] - fgd["unallocated_gpu_pct_median"]
        gap = fgd["unallocated_gpu_pct_median"] - bound
        ratio = (gps["unallocated_gpu_pct_median"] - bound) / gap if gap > 0 else float("nan")
        p = mannwhitneyu(gps["unallocated_gpu_pct"], fgd["unallocated_gpu_pct"], alternative="less").pvalue
        by_seed = dict(zip(fgd["seeds"], fgd["unallocated_gpu_pct"], strict=True))
        lower = sum(1 for s, v in zip(gps["seeds"], gps["unallocated_gpu_pct"], strict=True)
                    if s in by_seed and v < by_seed[s])
        cells = [item["recipe"]["name"]]
        cells += [f"{runs[p_]['unallocated_gpu_pct_median']:.2f}" if p_ in runs else "—" for p_ in policies]
        cells += [f"{delta:+.2f}", f"{bound:.2f}", f"{ratio:.2f}", f"{p:.2g}", f"{lower}/{len(gps['seeds'])}",
                  str(len(gps["seeds"]))]
        lines.append("| " + " | ".join(cells) + " |")
    recipe_head = ["list", "recipe", "seed", "tasks", "CPU ratio", "sharing", "pinned", "multi-GPU"]
    recipes = ["| " + " | ".join(recipe_head) + " |", "|" + "---|" * len(recipe_head)]
    for item in [{"recipe": {"name": "default (base)", "seed": "—"}, "achieved": manifest["base"]},
                 *manifest["lists"]]:
        r, a = item["recipe"], item["achieved"]
        knobs = ", ".join(f"{k} {r[k]}" for k in ("cpu_ratio", "gpushare", "gpuspec", "multigpu")
                          if r.get(k) is not None) or "—"
        cells = [r["name"], knobs, str(r["seed"]), *(str(a[k]) for k in ("tasks", "cpu_ratio", "gpushare",
                                                                           "gpuspec", "multigpu"))]
        recipes.append("| " + " | ".join(cells) + " |")
    return "\n".join(["\n".join(recipes), "", "\n".join(lines)]) + "\n"
