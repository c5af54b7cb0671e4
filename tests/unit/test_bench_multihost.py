"""The multi-host benchmark's reading of Celery workers' logs: how long each try held its slot."""

from __future__ import annotations

from datetime import UTC, datetime

from gpusched.bench.multihost import STALL_S, slot_holds


def _at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


LOG = """\
2026-12-07T17:50:40.325871Z [info     ] Task execute_workload[aa9f8d53-4354] received
2026-12-07T17:50:41.407458Z [info     ] Task execute_workload[45cff074-19bf] succeeded in 5.501507912999955s
2026-12-07T17:50:44.964952Z [info     ] Task execute_workload[d06e6a5b-77f2] succeeded in 0.14958463599998595s
2026-12-07T17:51:30.000000Z [info     ] Task execute_workload[653959bf-8eb3] succeeded in 0.2s
"""


def test_slot_holds_reads_the_tries_that_succeeded_within_the_window() -> None:
    held = slot_holds(LOG.splitlines(), _at("2026-12-07T17:50:40"), _at("2026-12-07T17:51:00"))
    assert held == [5.501507912999955, 0.14958463599998595]  # not the received line, not the later try
    assert [h >= STALL_S for h in held] == [True, False]
    assert slot_holds(LOG.splitlines(), _at("2026-12-07T18:00:00"), _at("2026-12-07T18:01:00")) == []
