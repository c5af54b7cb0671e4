"""``gpusched bench openb-lists``: build the held-out openb pod lists (:mod:`gpusched.sim.openb_lists`).

    gpusched bench openb-lists --out DIR [--traces DIR] [--manifest results/openb/built/lists.json]
                               [--only cpu150,gpushare90] [--json]
    gpusched bench openb-lists --tables results/openb/built   # markdown tables of the results there
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpusched.bench.openb_lists import build_lists, lists_report
from gpusched.commands.args import comma_list
from gpusched.errors import ConfigurationError
from gpusched.sim.traces import default_trace_dir

__all__ = ["register_bench"]


def register_bench(bench_subparsers: Any) -> None:
    """Add ``openb-lists`` under ``gpusched bench``."""
    parser = bench_subparsers.add_parser(
        "openb-lists", help="build openb pod lists that re-weight default as the family does (held-out lists)"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for the built CSV lists")
    parser.add_argument("--tables", type=Path, default=None, metavar="FOLDER",
                        help="instead of building: print markdown tables of the `gpusched bench openb` "
                             "results in FOLDER (beside its lists.json)")
    parser.add_argument("--traces", type=Path, default=default_trace_dir(),
                        help="trace folder holding openb/ (default $GPUSCHED_TRACES or ../shared/traces)")
    parser.add_argument("--manifest", type=Path, default=Path("results/openb/built/lists.json"),
                        help="where to write the manifest (default results/openb/built/lists.json)")
    parser.add_argument("--only", type=comma_list, default=(), metavar="NAME,...",
                        help="build only these lists (default all); the manifest keeps the others' entries")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.tables is not None:
        print(lists_report(args.tables), end="")
        return 0
    if args.out is None:
        raise ConfigurationError("give --out DIR for the built lists, or --tables FOLDER for result tables")
    manifest = build_lists(args.traces, args.out, only=args.only)
    if args.only and args.manifest.is_file():  # the lists not rebuilt keep their entries
        built = {item["file"] for item in manifest["lists"]}
        kept = json.loads(args.manifest.read_text(encoding="utf-8")).get("lists", [])
        manifest["lists"] = [item for item in kept if item.get("file") not in built] + manifest["lists"]
    text = json.dumps(manifest, indent=2)
    args.manifest.parent.mkdir(parents=True, exist_ok=True)
    args.manifest.write_text(text + "\n", encoding="utf-8")
    if args.json:
        print(text)
    else:
        for item in manifest["lists"]:
            a = item["achieved"]
            print(f"{item['file']}: {item['rows']} tasks, CPU ratio {a['cpu_ratio']}, "
                  f"sharing {a['gpushare']}, pinned {a['gpuspec']}, multi-GPU {a['multigpu']}")
    return 0
