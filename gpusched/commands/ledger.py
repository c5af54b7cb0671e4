"""``gpusched ledger``: look at and operate the allocation ledger.

    gpusched ledger [--url URL] migrate
    gpusched ledger [--url URL] status [--json]
    gpusched ledger [--url URL] allocations [--all] [--json]
    gpusched ledger [--url URL] events [--limit N] [--json]
    gpusched ledger [--url URL] release KEY [--reason TEXT]
    gpusched ledger [--url URL] cordon TARGET --reason TEXT
    gpusched ledger [--url URL] uncordon TARGET
    gpusched ledger [--url URL] expire

``--url`` defaults to ``$GPUSCHED_DB_URL``, else the SQLite ledger under ``$AIRFLOW_HOME/gpusched``.
Every command but ``migrate`` expects a migrated ledger; ``migrate`` is idempotent.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpusched.ledger import Ledger

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``ledger`` command to the ``gpusched`` parser."""
    parser = subparsers.add_parser(
        "ledger", help="inspect and operate the allocation ledger",
        description="Inspect and operate the allocation ledger (SQLite or PostgreSQL).",
    )
    parser.add_argument("--url", default=None,
                        help="database URL (default $GPUSCHED_DB_URL or SQLite under $AIRFLOW_HOME)")
    sub = parser.add_subparsers(dest="ledger_command", required=True, metavar="ACTION")
    sub.add_parser("migrate", help="create or upgrade the schema (idempotent)")
    status = sub.add_parser("status", help="schema revision, devices, allocations, queue")
    status.add_argument("--json", action="store_true")
    allocations = sub.add_parser("allocations", help="active allocations (or all with --all)")
    allocations.add_argument("--all", action="store_true", help="include released allocations")
    allocations.add_argument("--json", action="store_true")
    events = sub.add_parser("events", help="recent events, newest first")
    events.add_argument("--limit", type=int, default=30)
    events.add_argument("--json", action="store_true")
    release = sub.add_parser("release", help="release the active allocation of a task key")
    release.add_argument("key")
    release.add_argument("--reason", default="released by operator")
    cordon = sub.add_parser("cordon", help="stop new allocations on a device uuid or node name")
    cordon.add_argument("target")
    cordon.add_argument("--reason", required=True)
    uncordon = sub.add_parser("uncordon", help="allow new allocations on a device uuid or node name")
    uncordon.add_argument("target")
    sub.add_parser("expire", help="release allocations whose lease has expired")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Carry out one ledger action; returns the exit code."""
    from gpusched.errors import LedgerError
    from gpusched.ledger import Ledger
    from gpusched.ledger.migrate import current_revision

    with Ledger(args.url) as ledger:
        action = args.ledger_command
        if action == "migrate":
            ledger.migrate()
            print(f"ledger at {_where(ledger)} is at the newest schema")
            return 0
        if current_revision(ledger.engine) is None:
            raise LedgerError(
                f"the ledger at {_where(ledger)} has no schema yet; run `gpusched ledger migrate`"
            )
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
        if action == "cordon":
            ledger.cordon(args.target, args.reason)
            print(f"cordoned {args.target}")
            return 0
        if action == "uncordon":
            ledger.uncordon(args.target)
            print(f"uncordoned {args.target}")
            return 0
        expired = ledger.expire_leases()
        print(f"expired {len(expired)} allocation(s)" + "".join(f"\n  {a.key}" for a in expired))
        return 0


def _where(ledger: Ledger) -> str:
    return str(ledger.engine.url.render_as_string(hide_password=True))


def _status(ledger: Ledger, as_json: bool) -> int:
    from gpusched.ledger.migrate import current_revision, head_revision

    snapshot = ledger.snapshot()
    active = ledger.active()
    devices = list(snapshot.devices())
    data = {
        "database": _where(ledger),
        "revision": current_revision(ledger.engine),
        "head": head_revision(),
        "source": snapshot.source,
        "devices": len(devices),
        "cordoned": sum(1 for d in devices if d.cordoned or snapshot.node(d.node).cordoned),
        "unhealthy": sum(1 for d in devices if d.health != "healthy"),
        "active_allocations": len(active),
        "used_milli": sum(snapshot.used(d.uuid).used_milli for d in devices),
        "capacity_milli": 1000 * len(devices),
        "queued": len(ledger.queue()),
    }
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        for key, value in data.items():
            print(f"{key:<20} {value}")
    return 0
