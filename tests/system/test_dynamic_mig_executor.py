"""A MIG profile no existing instance offers, end to end in-process: the GPUExecutor keeps the task
waiting with the re-partition reason (not failed as never fitting), the agent's dynamic MIG
(local provider, the simulated fleet) re-lays out the idle MIG A100, the next inventory sync shows
the new instance, and the executor's next cycle dispatches the task on it with its MIG UUID."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import gpu_workload, queue_reading_executor

from gpusched.agent.telemetry import TelemetryAgent
from gpusched.hardware.mig_provider import LocalMigProvider
from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path
from gpusched.request import GPURequest

pytestmark = pytest.mark.airflow

MIG_GPU = "GPU-sim-a-a100mig-1-0"


@pytest.fixture
def executor(airflow_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from queue_reading_executor(monkeypatch)


def test_a_profile_no_instance_offers_waits_for_the_agent_then_runs_on_the_new_instance(
    executor: Any, tmp_path: Path
) -> None:
    request = GPURequest.build(gpus=0.5, memory="30GiB", profile="4g.40gb")
    work = gpu_workload("serve", {"gpusched": request.to_dict()})
    executor.queue_workload(work, session=None)
    executor.trigger_tasks(executor.parallelism)
    assert executor.activity_queue.empty() and work.key in executor.queued_tasks  # waits, not failed
    (entry,) = executor.ledger.queue()
    assert entry.reason.startswith(f"waiting for a MIG re-partition of {MIG_GPU} ")
    assert "4g.40gb" in entry.reason

    backend = SimulatedBackend(default_fleet_path(), state_folder=tmp_path)
    provider = LocalMigProvider(tmp_path / "mig_layouts.json")
    agent = TelemetryAgent(backend, executor.ledger, mig_provider=provider)
    result = agent.cycle()
    assert result.samples
    assert [e.subject for e in executor.ledger.events(kinds=["mig_repartition"])] == [MIG_GPU]
    new = [d for d in executor.ledger.snapshot().devices() if d.parent == MIG_GPU]
    assert [d.profile for d in new] == ["4g.40gb"]

    executor.trigger_tasks(executor.parallelism)
    items = []
    while not executor.activity_queue.empty():
        items.append(executor.activity_queue.get())
    ((sent, env),) = items
    assert sent.ti.key == work.ti.key
    assert env["CUDA_VISIBLE_DEVICES"] == new[0].uuid and env["GPUSCHED_ISOLATION"] == "hard"
    assert executor.ledger.queue() == []
    agent.cycle()  # the task holds the new instance: nothing to re-partition, nothing touched
    assert len(executor.ledger.events(kinds=["mig_repartition"])) == 1
