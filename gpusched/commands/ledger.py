"""``gpusched ledger``: look at and operate the allocation ledger.

    gpusched ledger migrate [--url URL]
    gpusched ledger status [--json] [--url URL]
    gpusched ledger allocations [--all] [--json] [--url URL]
    gpusched ledger events [--limit N] [--json] [--url URL]
    gpusched ledger release KEY [--reason TEXT] [--url URL]
    gpusched ledger cordon (TARGET | --host H) --reason TEXT [--url URL]
    gpusched ledger uncordon (TARGET | --host H) [--url URL]
    gpusched ledger hosts [--json] [--url URL]
    gpusched ledger expire [--url URL]

``--url`` may stand before or after the action. Where the ledger is: ``--url``, else
``$GPUSCHED_DB_URL``, else the SQLite file ``$AIRFLOW_HOME/gpusched/ledger.db`` (``AIRFLOW_HOME``
defaults to ``~/airflow``) — so point ``AIRFLOW_HOME`` (or ``GPUSCHED_DB_URL``) at the main
job's. Only ``migrate`` creates anything (it is idempotent); every other action reads or
changes an existing, migrated ledger and fails with one line saying where it looked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusched.commands.args import finite_float, int_range
from gpusched.errors import ConfigurationError, LedgerError
from gpusched.model import Health, gpu_cards
from gpusched.paths import state_dir

if TYPE_CHECKING:  # the ledger (sqlalchemy) loads when a ledger command runs, not at `gpusched --help`
    from gpusched.ledger import Ledger

__all__ = ["ledger_url", "opened_ledger", "register", "run"]

_URL_HELP = "database URL (default $GPUSCHED_DB_URL, else SQLite at $AIRFLOW_HOME/gpusched/ledger.db)"


def register(subparsers: Any) -> None:
    """Add the ``ledger`` command to the ``gpusched`` parser."""
    parser = subparsers.add_parser(
        "ledger", help="inspect and operate the allocation ledger",
        description="Inspect and operate the allocation ledger (SQLite or PostgreSQL). "
                    "Only `migrate` creates a ledger; the others need the main job's.",
    )
    parser.add_argument("--url", default=None, help=_URL_HELP)
    sub = parser.add_subparsers(dest="ledger_command", required=True, metavar="ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        child: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: an --url given before the action is kept unless repeated after it.
        child.add_argument("--url", default=argparse.SUPPRESS, help=_URL_HELP)
        return child

    action("migrate", "create or upgrade the schema (idempotent; the only action that creates files)")
    status = action("status", "schema revision, devices in service, allocations, queue")
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    allocations = action("allocations", "active allocations (or all with --all)")
    allocations.add_argument("--all", action="store_true", help="include released allocations")
    allocations.add_argument("--json", action="store_true", help="print machine-readable JSON")
    events = action("events", "recent events, newest first")
    events.add_argument("--limit", type=int_range(1, 100_000), default=30,
                        help="how many events, 1–100000 (default 30)")
    events.add_argument("--json", action="store_true", help="print machine-readable JSON")
    release = action("release", "release the active allocation of a task key")
    release.add_argument("key", help="the allocation key (see `gpusched ledger allocations`)")
    release.add_argument("--reason", default="released by operator", help="recorded with the release")
    cordon = action("cordon", "stop new allocations on a device uuid or node name")
    cordon.add_argument("target", nargs="?", help="device uuid or node name (see `gpusched inventory`)")
    cordon.add_argument("--host", help="drain GPU host H: cordon every node its agent registered")
    cordon.add_argument("--reason", required=True, help="why (recorded and shown on the fleet page)")
    uncordon = action("uncordon", "allow new allocations on a device uuid or node name")
    uncordon.add_argument("target", nargs="?", help="device uuid or node name")
    uncordon.add_argument("--host", help="every node of GPU host H")
    unquarantine = action("unquarantine", "release the quarantined allocations of GPU host H (a lost "
                                          "host's tries), once you know their processes are gone")
    unquarantine.add_argument("host", help="the GPU host (see `gpusched ledger hosts`)")
    unquarantine.add_argument("--key", help="only this allocation key")
    unquarantine.add_argument("--reason", default="operator confirmed the try stopped",
                              help="recorded with the release")
    hosts = action("hosts", "GPU hosts of a multi-host fleet: state, last heartbeat, devices, queue")
    hosts.add_argument("--json", action="store_true", help="print machine-readable JSON")
    action("expire", "release allocations whose lease has expired")
    durations = action("durations", "how well the executor's duration predictions fit the finished runs "
                                    "(each predicted from the runs before it)")
    durations.add_argument("--days", type=finite_float(0.0, 3650.0, strict_min=True), default=30.0,
                           help="finished runs of the last N days (default 30, as duration_history_days)")
    durations.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run)


def ledger_url(explicit: str | None) -> str:
    """The URL the CLI uses: ``--url``, ``$GPUSCHED_DB_URL``, else the SQLite file under AIRFLOW_HOME.

    Creates nothing (unlike :func:`gpusched.ledger.engine.default_url`, which makes the folder).
    """

    url = (explicit or os.environ.get("GPUSCHED_DB_URL", "")).strip()
    return url or f"sqlite:///{state_dir() / 'ledger.db'}"


def _missing_sqlite_file(url: str) -> Path | None:
    """The database file of a file-backed SQLite URL when it does not exist, else ``None``."""
    import sqlalchemy as sa

    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        return None  # make_engine reports it
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    path = Path(parsed.database)
    return None if path.is_file() else path


def _not_found(url: str, path: Path, explicit: bool) -> str:
    if explicit or os.environ.get("GPUSCHED_DB_URL", "").strip():
        source = "--url" if explicit else "GPUSCHED_DB_URL"
        return (f"no ledger at {path} (from {source}); give the main job's ledger URL, or run "
                "`gpusched ledger migrate` to create a new, empty one there")
    home = os.environ.get("AIRFLOW_HOME")
    assumed = f"AIRFLOW_HOME={home}" if home else "AIRFLOW_HOME is unset, so ~/airflow was assumed"
    return (f"no ledger at {path} ({assumed}); set AIRFLOW_HOME to the main job's AIRFLOW_HOME "
            "(or GPUSCHED_DB_URL / --url to its ledger database)")


def run(args: argparse.Namespace) -> int:
    """Carry out one ledger action; returns the exit code.

    Raises:
        LedgerError: no ledger where the CLI looked, no schema, or the database failed — one
            line naming the database and the fix.
    """
    with opened_ledger(args.url, existing=args.ledger_command != "migrate") as ledger:
        return _act(ledger, args)


@contextlib.contextmanager
def opened_ledger(explicit_url: str | None, *, existing: bool = True) -> Iterator[Ledger]:
    """The ledger the CLI uses (:func:`ledger_url`), open. With ``existing`` (every action but
    ``migrate``; ``gpusched check --ledger``) it must already exist with gpusched's schema, and
    nothing is created.

    Raises:
        LedgerError: no ledger where the CLI looked, no schema, or the database failed (also
            inside the ``with`` block) — one line naming the database and the fix.
    """
    import sqlalchemy as sa

    # local: sqlalchemy and alembic only when a ledger is opened
    from gpusched.ledger import Ledger
    from gpusched.ledger.migrate import current_revision

    url = ledger_url(explicit_url)
    missing = _missing_sqlite_file(url) if existing else None
    if missing is not None:
        raise LedgerError(_not_found(url, missing, bool(explicit_url)))
    try:
        with Ledger(url) as ledger:
            if existing and current_revision(ledger.engine) is None:
                raise LedgerError(
                    f"the database at {_where(ledger)} has no gpusched ledger schema; point AIRFLOW_HOME "
                    "or GPUSCHED_DB_URL (or --url) at the main job's ledger, or run `gpusched ledger "
                    "migrate` to set this one up"
                )
            yield ledger
    except sa.exc.SQLAlchemyError as exc:
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:200]
        where = sa.make_url(url).render_as_string(hide_password=True)
        raise LedgerError(
            f"cannot use the ledger at {where}: {first}; check --url / GPUSCHED_DB_URL and that the "
            "database is reachable"
        ) from None


def _act(ledger: Ledger, args: argparse.Namespace) -> int:
    action = args.ledger_command
    if action == "migrate":
        ledger.migrate()
        print(f"ledger at {_where(ledger)} is at the newest schema")
        return 0
    if action == "status":
        return _status(ledger, args.json)
    if action == "allocations":
        found = ledger.history(0.0) if args.all else ledger.active()
        if args.json:
            print(json.dumps([a.to_dict() for a in found], indent=2))
        else:
            for a in found:
                state = a.status if a.released_at is None else f"{a.status} ({a.release_reason})"
                devices = ", ".join(f"{s.uuid}:{s.milli}" for s in a.shares)
                print(f"{a.key}  holder={a.holder}  {state}  [{devices}]")
            print(f"{len(found)} allocation(s)")
        return 0
    if action == "events":
        found_events = ledger.events(args.limit)
        if args.json:
            print(json.dumps([{"id": e.id, "at": e.at, "kind": e.kind, "subject": e.subject,
                               "detail": dict(e.detail)} for e in found_events], indent=2))
        else:
            for e in found_events:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.at))
                print(f"{stamp}Z  {e.kind:<10} {e.subject}  {json.dumps(dict(e.detail))}")
        return 0
    if action == "release":
        released = ledger.release(args.key, reason=args.reason)
        print(f"released {args.key}" if released else f"{args.key} holds no active allocation")
        return 0
    if action == "unquarantine":
        keys = sorted({a.key for a in ledger.quarantined(args.host) if args.key in (None, a.key)})
        for key in keys:
            ledger.end_quarantine(key, host=args.host, reason=args.reason)
            print(f"released quarantined {key}")
        if not keys:
            print(f"GPU host {args.host} holds no quarantined allocation"
                  + (f" of {args.key}" if args.key else ""))
        return 0
    if action in ("cordon", "uncordon"):
        for target in _targets(ledger, args):
            if action == "cordon":
                ledger.cordon(target, args.reason)
            else:
                ledger.uncordon(target)
            print(f"{action}ed {target}")
        return 0
    if action == "hosts":
        from gpusched.ledger.hosts import loopback_warning  # local: sqlalchemy, as in run()

        registered = ledger.hosts()
        if args.json:
            print(json.dumps([{"name": h.name, "state": h.state, "reason": h.reason, "address": h.address,
                               "last_heartbeat": h.last_heartbeat, "devices": list(h.devices),
                               "queue": h.queue, "worker": h.worker_state, "worker_slots": h.worker_slots}
                              for h in registered], indent=2))
            return 0
        if not registered:
            print("no GPU host registered (start `gpusched agent --host-name H` on each GPU host)")
        for h in registered:
            ago = time.time() - h.last_heartbeat
            worker = f"  worker {h.worker_state}" if h.worker_state else ""
            print(f"{h.name:<20} {h.state:<5} heartbeat {ago:6.0f} s ago  {len(h.devices)} device(s)  "
                  f"queue {h.queue}  at {h.address}{worker}" + (f"  ({h.reason})" if h.reason else ""))
        warning = loopback_warning(registered)
        if warning:
            print(f"warning: {warning}")
        return 0
    if action == "durations":
        return _durations(ledger, args.days, args.json)
    expired = ledger.expire_leases()
    print(f"expired {len(expired)} allocation(s)" + "".join(f"\n  {a.key}" for a in expired))
    return 0


def _durations(ledger: Ledger, days: float, as_json: bool) -> int:
    # local: the duration models load numpy, which no other ledger command needs
    from gpusched.durations import DurationModel, replay_errors
    from gpusched.scheduler.durations import carried_work, finished_runs

    now = time.time()
    history = ledger.history(now - days * 86400.0, now)
    runs = finished_runs(history, carried_work(ledger, history))
    missed, errors = replay_errors(runs, DurationModel())
    report = {"days": days, "finished_runs": len(runs), "without_prediction": missed, **errors.as_dict()}
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    bases = ", ".join(f"{b} {v['count']} ({v['median_ape_pct']} %)" for b, v in errors.by_basis.items())
    print(f"{len(runs)} finished run(s) in {days:g} days; {missed} had too little history to predict")
    if errors.predicted:
        print(f"predicted {errors.predicted}: median absolute error {errors.median_ape_pct} %, "
              f"{errors.within_2x_pct} % within 2x; by basis: {bases}")
    return 0


def _where(ledger: Ledger) -> str:
    return str(ledger.engine.url.render_as_string(hide_password=True))


def _status(ledger: Ledger, as_json: bool) -> int:
    # local: both load the ledger (sqlalchemy), as in run()
    from gpusched.airflow.api_views import fleet_view
    from gpusched.ledger.migrate import current_revision, head_revision

    snapshot = ledger.snapshot()
    active = ledger.active()
    summary = fleet_view(snapshot, active)["summary"]  # GPUs counted as the fleet page counts them
    devices = list(snapshot.devices())
    data = {
        "database": _where(ledger),
        "revision": current_revision(ledger.engine),
        "head": head_revision(),
        "source": snapshot.source,
        "devices": summary["devices"],  # physical GPUs: a GPU cut into slices counts once
        "slices": gpu_cards(devices)[1],  # MIG instances / partitions, each scheduled on its own
        "in_service": summary["in_service"],
        "standby": summary["states"]["standby"],
        "cordoned": sum(1 for d in devices if d.cordoned or snapshot.node(d.node).cordoned),
        "unhealthy": sum(1 for d in devices if d.health is Health.UNHEALTHY),
        "degraded": sum(1 for d in devices if d.health is Health.DEGRADED),
        "active_allocations": len(active),
        "used_milli": sum(snapshot.used(d.uuid).used_milli for d in devices),
        "capacity_milli": 1000 * summary["in_service"],
        "queued": len(ledger.queue()),
    }
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        for key, value in data.items():
            print(f"{key:<20} {value}")
    return 0


def _targets(ledger: Any, args: argparse.Namespace) -> list[str]:
    if bool(args.target) == bool(args.host):
        raise ConfigurationError(
            f"ledger {args.ledger_command}: give a device uuid or node name, or --host H (one)"
        )
    if not args.host:
        return [str(args.target)]
    nodes = ledger.host_nodes(args.host)
    if not nodes:
        known = ", ".join(h.name for h in ledger.hosts()) or "none"
        raise ConfigurationError(
            f"ledger {args.ledger_command}: no GPU host {args.host!r} registered (hosts: {known})"
        )
    return list(nodes)

