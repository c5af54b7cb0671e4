"""Host health from the agent, its Celery worker and the running tries (gpusched.scheduler.hosts)."""

from __future__ import annotations

from gpusched.agent.host_guard import DEFAULT_WORKER_SLOTS, _serves, worker_slots
from gpusched.ledger.hosts import HostRecord, HostState, WorkerState
from gpusched.scheduler.hosts import judge_hosts, quarantine_reason

T = 1000.0


def _host(name: str = "host-a", *, state: str = HostState.LIVE, beat: float = T, worker: str | None = None,
          seen: float | None = None) -> HostRecord:
    return HostRecord(name, "f", (), "10.0.0.1", state, None, 0.0, beat, worker, seen, 2)


def test_a_host_whose_agent_and_worker_answer_stays_live() -> None:
    assert judge_hosts([_host(worker=WorkerState.RUNNING, seen=T)], T + 5, 10, {}) == []
    assert judge_hosts([_host()], T + 5, 10, {}) == []  # a worker not watched: the agent decides


def test_a_dead_worker_beside_a_live_agent_loses_the_host_after_the_timeout() -> None:
    host = _host(beat=T + 20, worker=WorkerState.MISSING, seen=T)
    assert judge_hosts([host], T + 9, 10, {}) == []  # within the timeout: not yet
    (verdict,) = judge_hosts([host], T + 12, 10, {})
    assert (verdict.state, verdict.previous) == (HostState.LOST, HostState.LIVE)
    assert verdict.reason.startswith("node lost: no heartbeat from host host-a")
    assert "Celery worker (queue gpusched@host-a) is missing for 12 s while its agent answers" in (
        verdict.reason)
    (frozen,) = judge_hosts([_host(beat=T + 20, worker=WorkerState.STOPPED, seen=T)], T + 12, 10, {})
    assert "is stopped" in frozen.reason


def test_a_silent_agent_whose_tries_still_heartbeat_keeps_them_and_takes_nothing_new() -> None:
    (verdict,) = judge_hosts([_host()], T + 15, 10, {"host-a": T + 14})
    assert verdict.state == HostState.UNCONFIRMED
    assert "running tries still heartbeat" in verdict.reason
    unconfirmed = _host(state=HostState.UNCONFIRMED)
    assert judge_hosts([unconfirmed], T + 30, 10, {"host-a": T + 28}) == []  # no change
    (lost,) = judge_hosts([unconfirmed], T + 30, 10, {"host-a": T + 12})  # the tries fell silent too
    assert lost.state == HostState.LOST and "fell silent too" in lost.reason
    (dead,) = judge_hosts([_host()], T + 15, 10, {})  # nothing runs there: lost at once
    assert dead.state == HostState.LOST and dead.reason == "node lost: no heartbeat from host host-a for 15 s"


def test_lost_hosts_wait_for_their_agent_and_verdicts_come_in_name_order() -> None:
    hosts = [_host("b"), _host("a"), _host("c", state=HostState.LOST, beat=0.0)]
    assert [v.name for v in judge_hosts(hosts, T + 60, 10, {})] == ["a", "b"]


def test_the_quarantine_reason_names_the_host_the_try_and_the_way_out() -> None:
    line = quarantine_reason("host-a", "node lost: x", 1)
    assert line.startswith("node lost: x; host host-a: waiting for its agent to confirm try 1 stopped")
    assert "gpusched ledger unquarantine host-a" in line


def test_the_agent_finds_its_worker_by_queue_and_reads_its_slots() -> None:
    argv = ["/venv/bin/python", "/venv/bin/airflow", "celery", "worker", "--queues",
            "gpusched@host-a,default", "--concurrency", "2"]
    assert _serves(argv, "gpusched@host-a") and not _serves(argv, "gpusched@host-b")
    assert not _serves(["/venv/bin/python", "-m", "gpusched.cli", "agent", "--host-name", "host-a"],
                       "gpusched@host-a")
    assert worker_slots(argv, {}) == 2
    titled = ["[celeryd: host-a@box:MainProcess] -active- (worker -O fair --queues gpusched@host-a,default "
              "--concurrency 2 --loglevel INFO)"]  # the process title Celery sets (setproctitle)
    assert _serves(titled, "gpusched@host-a") and worker_slots(titled, {}) == 2
    assert _serves(titled[0].split(" "), "gpusched@host-a")
    assert not _serves(["[celeryd: host-a@box:ForkPoolWorker-1]"], "gpusched@host-a")  # a pool child
    assert worker_slots(["celery", "worker", "-c", "3"], {}) == 3
    assert worker_slots(["celery", "worker", "--concurrency=5"], {}) == 5
    assert worker_slots(["celery", "worker"], {"AIRFLOW__CELERY__WORKER_CONCURRENCY": "8"}) == 8
    assert worker_slots(["celery", "worker"], {}) == DEFAULT_WORKER_SLOTS


def test_worker_slots_count_a_hosts_active_tries_one_each() -> None:
    from gpusched.model import DeviceShare
    from gpusched.records import Allocation
    from gpusched.request import GPURequest
    from gpusched.scheduler.hosts import slot_full_reason, worker_slot_use
    from gpusched.scheduler.keys import ti_key

    def alloc(task: str, node: str, status: str = "active", key: str | None = None) -> Allocation:
        return Allocation(key or ti_key("d", task, "r", 1), GPURequest(count=1),
                          (DeviceShare(f"{node}-0", node, 0, 250, 0),), "executor", 0.0, 1.0, status=status)

    hosts = [_host("host-a"), _host("host-b"), _host("host-c", state=HostState.LOST)]
    node_host = {"a1": "host-a", "b1": "host-b", "c1": "host-c"}
    active = [alloc("t1", "a1"), alloc("t2", "a1"), alloc("t3", "b1"),
              alloc("t4", "a1", status="quarantined"),  # fenced: no worker slot
              alloc("t5", "a1", key="test-run:x"),  # a test run does not run on the worker
              alloc("t6", "c1")]
    assert worker_slot_use(hosts, node_host, active) == {"host-a": (2, 2), "host-b": (1, 2)}
    unwatched = [HostRecord("host-a", "f", (), "a", HostState.LIVE, None, 0.0, T)]
    assert worker_slot_use(unwatched, node_host, active) == {}  # slots unknown: no limit
    assert slot_full_reason("host-a", 2, 2).startswith(
        "GPU host host-a: every Celery worker slot is busy (2 of 2)")



def test_prefetch_room_only_on_full_hosts_with_a_try_ending_soon() -> None:
    from gpusched.model import DeviceShare
    from gpusched.placement.types import RunningTask
    from gpusched.request import GPURequest
    from gpusched.scheduler.hosts import prefetch_room

    def running(node: str, end: float | None) -> RunningTask:
        share = DeviceShare(f"{node}-0", node, 0, 250, 0)
        return RunningTask(f"k-{node}-{end}", GPURequest(count=1), (share,), 0.0, end)

    node_host = {"a1": "host-a", "b1": "host-b", "c1": "host-c", "d1": "host-d"}
    use = {"host-a": (2, 2), "host-b": (2, 2), "host-c": (1, 2), "host-d": (3, 2)}
    tries = [running("a1", 110.0), running("a1", 120.0),  # host-a: two end within 30 s
             running("b1", 500.0), running("b1", None),  # host-b: none ends soon, one never known
             running("c1", 101.0),  # host-c has a free slot: no prefetch needed
             running("d1", 105.0)]  # host-d already holds one beyond its slots
    def room(multiplier: int, within_s: float) -> dict[str, int]:
        return prefetch_room(use, node_host, tries, 100.0, multiplier=multiplier, within_s=within_s)

    assert room(1, 30.0) == {"host-a": 2, "host-d": 1}  # one per try ending soon
    assert room(0, 30.0) == {}
    assert room(1, 5.0) == {"host-d": 1}
    # At most multiplier × slots, however many tries end soon.
    use["host-a"] = (1, 1)
    assert room(1, 30.0) == {"host-a": 1, "host-d": 1}
    assert room(2, 30.0) == {"host-a": 2, "host-d": 1}
