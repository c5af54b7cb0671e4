"""``gpusched check``: would a DAG's GPU tasks fit the fleet, and where would they go?

    gpusched check PATH [--fleet FLEET_YAML | --ledger [--url URL]] [--json]

PATH is a DAG file or a DAGs folder, parsed as Airflow's dag-processor parses it. Each GPU task
(a multi-node gang as one unit) gets one verdict — ``fits now`` (``--ledger`` only: on the
devices free now), ``fits when idle``, ``fits only with standby nodes``, ``fits after a
re-partition`` (a hard slice a GPU can be re-partitioned into) or ``never fits`` — with
the scheduler's reason and its placement on the idle fleet (:mod:`gpusched.airflow.fit_check`).
The fleet: ``--fleet``, else ``$GPUSCHED_FLEET``, else the bundled default fleet (the simulated
fleet the main job uses without real devices); ``--ledger`` judges the main job's ledger now
(``--url``, else ``$GPUSCHED_DB_URL``, else ``$AIRFLOW_HOME/gpusched/ledger.db``). The policy is
``[gpusched] policy`` / ``policy_parts`` of Airflow's config.

Exit code 1 when any task never fits, 0 otherwise (2: bad input, one line). ``--json`` prints a
list, one object per GPU task or gang (``request``: each member's, for a gang)::

    [{"dag_id", "task", "task_ids": [str], "file", "gang": bool, "request": {...}, "describe",
      "verdict", "fits": bool, "reason",
      "where": [{"task_id", "node", "devices": [int],
                 "shares": [{"uuid", "node", "index", "milli", "memory_bytes", "profile"}]}]}]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusched.commands.ledger import opened_ledger
from gpusched.errors import ConfigurationError

if TYPE_CHECKING:  # Airflow and the placement engine load when the command runs, not at `gpusched --help`
    from gpusched.airflow.fit_check import FitReport
    from gpusched.model import FleetSnapshot
    from gpusched.records import Allocation

__all__ = ["register", "render_text", "run"]

_REASON_LABEL = {"fits only with standby nodes": "without standby nodes", "never fits": "why",
                 "fits after a re-partition": "how"}
"""What a report's reason explains, by verdict (any other: why it waits now, on a live ledger)."""


def register(subparsers: Any) -> None:
    """Add the ``check`` command to the ``gpusched`` parser."""
    parser = subparsers.add_parser(
        "check", help="check that a DAG's GPU tasks fit the fleet (for DAG authors and CI)",
        description="Parse DAG files as the dag-processor does and say, for every GPU task or gang, "
                    "whether it fits the fleet (now, when idle, only with standby nodes, never), why, "
                    "and where it would go. Exit code 1 when any task never fits.",
    )
    parser.add_argument("path", type=Path, metavar="PATH", help="a DAG file or a DAGs folder")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--fleet", type=Path, default=None, metavar="FLEET_YAML",
                        help="fleet YAML to check against (default $GPUSCHED_FLEET or "
                             "gpusched/include/fleets/default.yaml)")
    source.add_argument("--ledger", action="store_true",
                        help="check against the main job's ledger: the live fleet, with what runs now")
    parser.add_argument("--url", default=None,
                        help="ledger database URL (implies --ledger; default $GPUSCHED_DB_URL, else "
                             "SQLite at $AIRFLOW_HOME/gpusched/ledger.db)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON (a list)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check and print; returns 1 when a task never fits, else 0.

    Raises:
        ConfigurationError: a missing path, a DAG file that fails to import, a bad fleet file, or
            ``--url`` with ``--fleet``.
        LedgerError: ``--ledger`` and no usable ledger.
    """
    # local: Airflow (DagBag) and the placement engine load only when a check runs
    from gpusched.airflow.fit_check import check_fit, configured_policy, fleet_snapshot, load_dags
    from gpusched.hardware.detect import fleet_path_from_env
    from gpusched.hardware.simulated import display_path
    from gpusched.scheduler.cycle import running_tasks

    if args.url and args.fleet:
        raise ConfigurationError("--url names a ledger and --fleet a fleet file; give one of them")
    policy = configured_policy()
    if args.ledger or args.url:
        snapshot, active, where = _live_fleet(args.url)
        source, live, running = f"live ledger at {where}", True, running_tasks(active)
    else:
        path = args.fleet or fleet_path_from_env()
        snapshot, source, live, running = fleet_snapshot(path), f"fleet file {display_path(path)}", False, []
    reports = check_fit(load_dags(args.path), snapshot, policy, live=live, running=running)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        standby = sum(1 for node in snapshot.nodes if node.standby)
        fleet = f"{source}: {len(snapshot.nodes)} node(s), {standby} on standby"
        print(render_text(reports, source=fleet, policy=policy.name))
    return 0 if all(r.fits for r in reports) else 1


def _live_fleet(url_option: str | None) -> tuple[FleetSnapshot, list[Allocation], str]:
    """The main job's fleet now and its active allocations (one read), and where the ledger is.

    Found as every ``gpusched ledger`` action finds it; creates nothing. Opening it logs nothing
    on stdout (``--json`` stays JSON).

    Raises:
        LedgerError: no ledger there, no schema, or the database failed (one line).
    """
    from gpusched.airflow.fit_check import quiet  # local: as in run()

    with quiet(), opened_ledger(url_option) as ledger:
        snapshot, active = ledger.cycle_view()
        return snapshot, active, ledger.engine.url.render_as_string(hide_password=True)


def render_text(reports: Sequence[FitReport], *, source: str, policy: str) -> str:
    """The human view: the fleet, then per DAG one line per GPU task (verdict, placement, reason)
    and a closing count per verdict."""
    from gpusched.airflow.fit_check import Verdict  # local: as in run()

    lines = [f"checked against {source} (policy {policy})"]
    dag = None
    for r in reports:
        if r.dag_id != dag:
            dag = r.dag_id
            lines.append(f"{r.dag_id}  ({r.file})")
        what = r.request.describe() if r.request else "invalid request"
        if r.gang:
            what = f"{len(r.task_ids)} nodes × {what}"
        name = f"{r.name} (gang: {', '.join(r.task_ids)})" if r.gang else r.name
        lines.append(f"  {name}: {what}: {r.verdict}")
        if r.where:
            at = "with standby nodes on" if r.verdict is Verdict.NEEDS_STANDBY else "on the idle fleet"
            lines.append(f"    {at}: " + "; ".join(s.describe() for s in r.where))
        if r.reason:
            lines.append(f"    {_REASON_LABEL.get(str(r.verdict), 'now')}: {r.reason}")
    counts = {v: sum(1 for r in reports if r.verdict is v) for v in Verdict}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no GPU task found"
    lines.append(f"{len(reports)} GPU task(s): {summary}")
    return "\n".join(lines)
