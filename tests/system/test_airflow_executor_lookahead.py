"""``[gpusched] policy = fgd-lookahead`` (and ``fgd-memory``, which decides the same where tasks
declare no host RAM) through the real GPUExecutor: the look-ahead tie-break runs in the
executor's cycle and every task gets its own devices.

GPUExecutor in-process against a real ledger and a migrated Airflow DB (the workers' queue is read
directly, as in ``test_airflow_executor.py``). Three identical nodes of two A100s, so the first
decisions tie at FGD's top integer score.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from _airflow_support import gpu_workload, queue_reading_executor, run_cycle

from gpusched.errors import ConfigurationError
from gpusched.placement.lookahead import ShapeDeltas
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

pytestmark = pytest.mark.airflow


@pytest.fixture(params=["fgd-lookahead", "fgd-memory"])
def executor(
    airflow_db: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Any]:
    fleet = tmp_path / "fleet.yaml"
    nodes = "".join(f"      - name: {n}\n        cpu: 64\n        memory: 512GiB\n"
                    "        devices: {model: A100-SXM-80GB, count: 2}\n" for n in ("n1", "n2", "n3"))
    fleet.write_text("racks:\n  - name: r\n    nodes:\n" + nodes)
    monkeypatch.setenv("GPUSCHED_FLEET", str(fleet))
    monkeypatch.setenv("AIRFLOW__GPUSCHED__POLICY", request.param)
    yield from queue_reading_executor(monkeypatch)


def test_lookahead_policy_places_every_task_on_its_own_devices(
    executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[int] = []
    real_pick = ShapeDeltas.pick

    def counting_pick(self: ShapeDeltas, *args: Any, **kwargs: Any) -> int:
        compared.append(len(args[2]))
        return real_pick(self, *args, **kwargs)

    monkeypatch.setattr(ShapeDeltas, "pick", counting_pick)
    requests = {"a": {"gpus": 1}, "b": {"gpus": 1}, "c": {"gpus": 2}, "d": {"gpus": 1}}
    workloads = [gpu_workload(name, {"gpusched": GPURequest.build(**gpu).to_dict()})
                 for name, gpu in requests.items()]
    sent = run_cycle(executor, *workloads)
    assert executor.gpu.policy.name == os.environ["AIRFLOW__GPUSCHED__POLICY"]
    assert sorted(sent) == sorted(w.key for w in workloads)
    assert compared and max(compared) >= 2  # ties were compared by the look-ahead
    taken: Counter[str] = Counter()
    for name, gpu in requests.items():
        alloc = executor.ledger.get(ti_key("d", name, "manual__1", 1, -1))
        assert alloc is not None and alloc.active and len(alloc.shares) == gpu["gpus"]
        taken.update(s.uuid for s in alloc.shares)
    assert max(taken.values()) == 1  # no device handed out twice


def test_the_engine_stays_warm_between_cycles(executor: Any) -> None:
    """The executor keeps its placement engine between cycles: a cycle whose fleet changed only in
    usage (a task waiting, then a task ended) rebases it instead of building a new one, and
    what it plans there is what a fresh engine plans: devices that are free, none twice."""
    def work(name: str, gpus: int) -> Any:
        return gpu_workload(name, {"gpusched": GPURequest.build(gpus=gpus).to_dict()})

    first = [work("a", 1), work("b", 1), work("c", 2), work("d", 1)]
    assert sorted(run_cycle(executor, *first)) == sorted(w.key for w in first)
    big = work("e", 2)
    assert run_cycle(executor, big) == []  # one GPU free: it waits
    assert run_cycle(executor) == []  # the same fleet and mix: the kept engine is rebased
    warm = executor.gpu.warm
    assert warm.rebased >= 1
    executor.ledger.release(ti_key("d", "c", "manual__1", 1, -1), reason="test: c ended")
    c_devices = {s.uuid for s in executor.ledger.get(ti_key("d", "c", "manual__1", 1, -1)).shares}
    rebased = warm.rebased
    assert run_cycle(executor) == [big.key]  # c's two devices are free again, in usage only
    assert warm.rebased == rebased + 1  # the mix moved less than workload_drift: no rebuild
    e = executor.ledger.get(ti_key("d", "e", "manual__1", 1, -1))
    assert e is not None and e.active and {s.uuid for s in e.shares} == c_devices
    held = Counter(s.uuid for name in "abde"
                   for s in executor.ledger.get(ti_key("d", name, "manual__1", 1, -1)).shares)
    assert max(held.values()) == 1


def test_policy_parts_change_the_executors_profile(
    airflow_db: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[gpusched] policy_parts`` reaches the executor's cycle: with the look-ahead swapped for the
    earliest candidate, ties go to the first node and no look-ahead runs; a wrong part is one line."""
    fleet = tmp_path / "fleet.yaml"
    nodes = "".join(f"      - name: {n}\n        cpu: 64\n        memory: 512GiB\n"
                    "        devices: {model: A100-SXM-80GB, count: 2}\n" for n in ("n1", "n2", "n3"))
    fleet.write_text("racks:\n  - name: r\n    nodes:\n" + nodes)
    monkeypatch.setenv("GPUSCHED_FLEET", str(fleet))
    monkeypatch.setenv("AIRFLOW__GPUSCHED__POLICY", "fgd-lookahead")
    monkeypatch.setenv("AIRFLOW__GPUSCHED__POLICY_PARTS", "tiebreak=earliest")
    compared: list[int] = []
    monkeypatch.setattr(ShapeDeltas, "pick", lambda *a, **k: compared.append(1) or 0)
    for executor in queue_reading_executor(monkeypatch):
        assert executor.gpu.policy.name == "fgd-lookahead" and executor.gpu.policy.lookahead_ties == 0
        work = gpu_workload("a", {"gpusched": GPURequest.build(gpus=1).to_dict()})
        assert run_cycle(executor, work) == [work.key]
        alloc = executor.ledger.get(ti_key("d", "a", "manual__1", 1, -1))
        assert alloc is not None and [s.node for s in alloc.shares] == ["n1"] and not compared
    monkeypatch.setenv("AIRFLOW__GPUSCHED__POLICY_PARTS", "tiebreak=sideways")
    for executor in queue_reading_executor(monkeypatch):
        with pytest.raises(ConfigurationError, match="policy_parts") as err:
            _ = executor.gpu.policy
        assert "\n" not in str(err.value)
