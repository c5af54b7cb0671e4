"""A multi-node gang preempts through the real GPUExecutor only when the whole gang fits afterwards.

GPUExecutor in-process against a real ledger and a migrated Airflow DB (the workers' queue is read
directly, as in ``test_airflow_executor.py``); ``[gpusched] preemption = priority``. Two nodes of
two A100s; a critical gang of two members, each asking a whole node, on distinct nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _airflow_support import gpu_workload, queue_reading_executor
from _airflow_support import run_cycle as _cycle

from gpusched.gang import GANG_KEY
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

pytestmark = pytest.mark.airflow


@pytest.fixture
def executor(airflow_db: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    fleet = tmp_path / "fleet.yaml"
    nodes = "".join(f"      - name: {n}\n        cpu: 64\n        memory: 512GiB\n"
                    "        devices: {model: A100-SXM-80GB, count: 2}\n" for n in ("n1", "n2"))
    fleet.write_text("racks:\n  - name: r\n    nodes:\n" + nodes)
    monkeypatch.setenv("GPUSCHED_FLEET", str(fleet))
    for name, value in (("PREEMPTION", "priority"), ("PREEMPTION_MIN_RUNTIME_SECONDS", "0"),
                        ("PREEMPTION_GRACE_SECONDS", "600")):
        monkeypatch.setenv(f"AIRFLOW__GPUSCHED__{name}", value)
    yield from queue_reading_executor(monkeypatch)


def _workload(task_id: str, priority: str, gang_rank: int | None = None) -> Any:
    config: dict[str, Any] = {"gpusched": GPURequest.build(gpus=2, priority=priority).to_dict()}
    if gang_rank is not None:
        config[GANG_KEY] = {"name": "train", "size": 2, "rank": gang_rank, "scope": "any"}
    return gpu_workload(task_id, config)




def _key(task_id: str) -> str:
    return ti_key("d", task_id, "manual__1", 1, -1)


def test_a_gang_preempts_only_when_every_member_fits_on_its_own_node(executor: Any) -> None:
    from airflow.utils.state import TaskInstanceState

    ex = executor
    low, peer = _workload("low", "low"), _workload("peer", "critical")
    assert len(_cycle(ex, low, peer)) == 2  # one node each
    gang = [_workload(f"train__node{r}", "critical", r) for r in range(2)]
    # Stopping "low" would free one node; the gang needs two: nothing is stopped.
    assert _cycle(ex, *gang) == []
    assert ex.gpu.preemption.evictions == {}
    assert ex.ledger.events(10, kinds=["preempted"]) == []
    # The critical peer ends: with its node free, stopping "low" makes room for both members.
    ex.change_state(peer.key, TaskInstanceState.SUCCESS)
    assert _cycle(ex) == []  # the gang waits while its victim has its grace to checkpoint
    assert list(ex.gpu.preemption.evictions) == [_key("low")]
    assert ex.gpu.metrics.preemptions == 1  # gpusched_scheduler_preemptions_total
    (event,) = ex.ledger.events(10, kinds=["preempted"])
    assert event.subject == _key("low") and event.detail["by"] == _key("train__node0")
    proven = {s.split(":")[0] for v in event.detail["proof"].values() for s in v}
    assert proven == {"n1", "n2"}  # the proof placed the members on distinct nodes
    # Meanwhile the free node is kept for the gang: a low-priority task queued now does not take it.
    low2 = _workload("low2", "low")
    assert _cycle(ex, low2) == []
    reasons = {q.key: q.reason for q in ex.ledger.queue()}
    assert reasons[_key("train__node0")].startswith("waiting for preempted"), reasons
    kinds = {k: kind for k, (kind, _) in ex.gpu.metrics.waiting.items()}  # pending_tasks{reason}
    assert kinds[_key("train__node0")] == kinds[_key("train__node1")] == "preemption", kinds
    assert ex.gpu.metrics.preemptions == 1
    # The victim's process ends (it was cleared): the gang starts on both nodes, low2 still waits.
    ex.change_state(low.key, TaskInstanceState.SUCCESS)
    assert sorted(_cycle(ex)) == sorted(w.key for w in gang)
    released = ex.ledger.get(_key("low"))
    assert released is not None and str(released.release_reason).startswith("preempted for")
    nodes = {a.key: {s.node for s in a.shares} for a in ex.ledger.active()}
    assert nodes[_key("train__node0")] | nodes[_key("train__node1")] == {"n1", "n2"}
    assert _key("low2") not in nodes and ex.gpu.preemption.nominated == {}
