"""The bundled ``example_gpu_container`` DAG under the gpusched executor in real Airflow
(``scripts/run.sh``: scheduler, api-server, dag-processor, triggerer; the simulated fleet) against
a real Docker engine: each container sees exactly the GPUs the ledger allocated to its try, and
the allocations are released afterwards. Then the engine stops, as for a user without one: the
next run's tasks fail at once, each log saying in one line what is missing and how to fix it, and
their allocations are released too.

The engine is a private dockerd (``_docker_support.nvidia_engine``) whose NVIDIA device driver
runs a stand-in for the NVIDIA Container Toolkit's hook: the engine turns the operator's device
request into ``NVIDIA_VISIBLE_DEVICES`` and calls the hook with those GPUs, as on a GPU host; the
stand-in records them instead of mounting real devices. The DAG's images are params of the run:
here images built offline (busybox; this machine's Python), nothing is pulled. Root and dockerd
are needed, else the test skips saying so.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _docker_support import NvidiaEngine, busybox_image, nvidia_engine, python_image
from _run_sh_support import Airflow, run_sh_airflow
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import wait_for as _wait

from gpusched.records import AllocationStatus
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.docker]

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "example_gpu_container"


@pytest.fixture(scope="module")
def engine() -> Iterator[NvidiaEngine]:
    yield from nvidia_engine()


@pytest.fixture(scope="module")
def images(engine: NvidiaEngine) -> dict[str, str]:
    """The run's params: the DAG's two images, built offline in the private engine."""
    return {"image": busybox_image(engine.client), "python_image": python_image(engine.client)}


@pytest.fixture(scope="module")
def airflow(engine: NvidiaEngine, images: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    shutil.copy(REPO / "dags" / f"{DAG_ID}.py", dags)
    # The task processes reach the engine as a DAG author's would: DOCKER_HOST.
    yield from run_sh_airflow(home, dags, {"DOCKER_HOST": engine.url})


def _uuids_in_env_order(allocation: Any) -> str:
    """The allocation's UUIDs as the visible-device variables list them (by device index)."""
    return ",".join(s.uuid for s in sorted(allocation.shares, key=lambda s: s.index))


def test_each_container_sees_exactly_its_allocated_gpus_and_they_are_released(
    engine: NvidiaEngine, images: dict[str, str], airflow: Airflow
) -> None:
    from gpusched.ledger import Ledger

    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAG to be parsed", lambda: DAG_ID in {
        d["dag_id"] for d in airflow.api("GET", "/dags", params={"dag_id_pattern": DAG_ID})["dags"]},
        180, airflow)
    airflow.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    run_id = airflow.api("POST", f"/dags/{DAG_ID}/dagRuns",
                         json={"logical_date": None, "conf": images})["dag_run_id"]

    def run_state() -> str | None:
        state = str(airflow.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"])
        return state if state in ("success", "failed") else None

    state = _wait("the run to finish", run_state, 420, airflow, interval=2)
    tis = {ti["task_id"]: ti["state"] for ti in
           airflow.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")["task_instances"]}
    if state != "success":
        logs = {t: _log_text(airflow, DAG_ID, run_id, t, 1)[-3000:] for t in tis}
        pytest.fail(f"run {state}: {tis}\n{json.dumps(logs, indent=1)}")
    assert tis == {"show_devices": "success", "train": "success"}

    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        keys = {task: ti_key(DAG_ID, task, run_id, 1) for task in tis}
        # Released once the tries ended (the executor and the task-side listener both release).
        allocations = _wait("both allocations to be released", lambda: (lambda found: found if all(
            a is not None and a.released_at is not None for a in found.values()) else None)(
            {task: ledger.get(key) for task, key in keys.items()}), 60, airflow)
        assert {t: a.status for t, a in allocations.items()} == {
            "show_devices": AllocationStatus.SUCCEEDED, "train": AllocationStatus.SUCCEEDED}
        assert not {a.key for a in ledger.active()} & set(keys.values())
        show, train = allocations["show_devices"], allocations["train"]
        assert len(show.shares) == 1 and len(train.shares) == 2
        assert all(s.uuid.startswith("GPU-sim-") for s in (*show.shares, *train.shares))  # NVIDIA

        # show_devices (GPUDockerOperator): its container printed what it was given.
        text = _log_text(airflow, DAG_ID, run_id, "show_devices", 1)
        assert f"CUDA_VISIBLE_DEVICES={_uuids_in_env_order(show)}" in text, text[-3000:]
        assert f"NVIDIA_VISIBLE_DEVICES={_uuids_in_env_order(show)}" in text, text[-3000:]

        # train (@gpu_docker_task): Python in the container returned what it saw.
        seen = airflow.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/xcomEntries/"
                           "return_value", params={"deserialize": "true", "stringify": "false"})["value"]
        assert seen == {
            "cuda_visible_devices": _uuids_in_env_order(train),
            "nvidia_visible_devices": _uuids_in_env_order(train),
            "node": train.shares[0].node,
            "devices": sorted(s.index for s in train.shares),
            "uuids": [s.uuid for s in sorted(train.shares, key=lambda s: s.index)],
            "key": keys["train"],
        }, seen

        # The engine asked the toolkit's hook for exactly those GPUs, one container each.
        assert sorted(c["NVIDIA_VISIBLE_DEVICES"] for c in engine.hook_calls()) == sorted(
            [_uuids_in_env_order(show), _uuids_in_env_order(train)])
    finally:
        ledger.close()


def test_without_an_engine_the_tasks_fail_at_once_with_the_fix_and_release_their_gpus(
    engine: NvidiaEngine, images: dict[str, str], airflow: Airflow
) -> None:
    from gpusched.ledger import Ledger

    engine.stop()  # runs after the test above: the same Airflow, its engine gone
    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = airflow.token or _wait("a login token", lambda: _login(airflow), 60, airflow)
    airflow.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    run_id = airflow.api("POST", f"/dags/{DAG_ID}/dagRuns",
                         json={"logical_date": None, "conf": images})["dag_run_id"]

    def run_state() -> str | None:
        state = str(airflow.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"])
        return state if state in ("success", "failed") else None

    assert _wait("the run to fail", run_state, 300, airflow, interval=2) == "failed"
    url = engine.url
    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        for task in ("show_devices", "train"):
            ti = airflow.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task}")
            assert (ti["state"], ti["try_number"]) == ("failed", 1), ti
            text = _log_text(airflow, DAG_ID, run_id, task, 1)
            assert (f"task '{task}': no Docker engine answers at {url}: start one (e.g. `sudo systemctl "
                    "start docker`) or point DOCKER_HOST / docker_url at one") in text, text[-3000:]
            key = ti_key(DAG_ID, task, run_id, 1)
            allocation = _wait(f"{task}'s allocation to be released", lambda key=key: (
                lambda a: a if a is not None and a.released_at is not None else None)(ledger.get(key)),
                60, airflow)
            assert allocation.status == AllocationStatus.RELEASED, allocation
        assert not [a for a in ledger.active() if a.key.endswith(run_id)]
    finally:
        ledger.close()
