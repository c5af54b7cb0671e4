"""The gpusched FastAPI app: Airflow auth (401 without a user) and content from a real SQLite ledger."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusched.airflow.api_views import device_state
from gpusched.fleetfile import load_fleet
from gpusched.ledger import Ledger
from gpusched.model import DeviceSample, DeviceShare, Health
from gpusched.paths import include_dir
from gpusched.request import GPURequest

GIB = 1024**3
NOW = 1_800_000_000.0


@pytest.fixture()
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    led.migrate()
    led.sync_inventory(load_fleet(include_dir() / "fleets" / "default.yaml"), "simulated:default", now=NOW)
    yield led
    led.close()


def _populate(led: Ledger) -> dict[str, Any]:
    snap = led.snapshot(NOW)
    h100 = [d for d in snap.devices() if d.node == "a-h100-1"]
    a100 = [d for d in snap.devices() if d.node == "a-a100-1"]
    whole = GPURequest.build(gpus=4, memory="40GiB", interconnect="island", tenant="vision")
    led.allocate("dag.train.r1.1.-1", whole,
                 [DeviceShare(d.uuid, d.node, d.index, 1000, 40 * GIB) for d in h100[:4]],
                 holder="test", now=NOW - 1800)
    frac = GPURequest.build(gpus=0.25, memory="10GiB", tenant="nlp", partition="dev")
    led.allocate("dag.nb.r1.1.-1", frac, [DeviceShare(a100[0].uuid, a100[0].node, 0, 250, 10 * GIB)],
                 holder="test", now=NOW - 60)
    led.set_health(a100[5].uuid, Health.UNHEALTHY, "xid 79", now=NOW)
    led.cordon(a100[6].uuid, "maintenance", now=NOW)
    big = GPURequest.build(gpus=8, memory="80GiB", interconnect="island", tenant="vision")
    led.record_queue("dag.big.r1.1.-1", big, "needs 8 island-connected ≥80 GiB; largest free island: 4",
                     NOW - 300)
    led.record_samples([DeviceSample(h100[0].uuid, NOW - 5, 97, 38 * GIB, 80 * GIB, 71_000, 650_000)])
    return {"h100": h100, "a100": a100}


@pytest.fixture()
def client(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.testclient import TestClient

    from gpusched.airflow.api import create_app

    monkeypatch.setattr("time.time", lambda: NOW)
    app = create_app(ledger.url)
    app.dependency_overrides[get_user] = lambda: object()  # an authenticated Airflow user
    with TestClient(app) as c:
        yield c


ROUTES = ["/fleet", "/allocations", "/queue", "/quotas", "/forecast", "/events", "/preemptions",
          "/unschedulable", "/ui"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_needs_an_airflow_user(ledger: Ledger, route: str) -> None:
    from fastapi.testclient import TestClient

    from gpusched.airflow.api import create_app

    with TestClient(create_app(ledger.url)) as anonymous:
        response = anonymous.get(route)
        assert response.status_code == 401
        if route == "/ui":
            assert "Sign in" in response.text
        with_bad_cookie = anonymous.get(route, headers={"Authorization": "Basic abc"})
        assert with_bad_cookie.status_code == 401


def test_fleet_shows_topology_states_and_simulated_flag(client: Any, ledger: Ledger) -> None:
    devices = _populate(ledger)
    body = client.get("/fleet").json()
    assert body["simulated"] is True
    assert [r["name"] for r in body["racks"]] == ["rack-a", "rack-b"]
    nodes = {n["name"]: n for r in body["racks"] for n in r["nodes"]}
    flat = {d["uuid"]: d for n in nodes.values() for i in n["islands"] for d in i["devices"]}
    assert len(flat) == body["summary"]["devices"]
    h100, a100 = devices["h100"], devices["a100"]
    assert flat[h100[0].uuid]["state"] == "allocated"
    assert flat[h100[0].uuid]["holders"] == [{"key": "dag.train.r1.1.-1", "milli": 1000, "tenant": "vision"}]
    assert flat[h100[0].uuid]["telemetry"]["utilization_pct"] == 97
    assert flat[h100[4].uuid]["state"] == "free"
    assert flat[a100[0].uuid]["state"] == "shared" and flat[a100[0].uuid]["used_milli"] == 250
    assert flat[a100[5].uuid]["state"] == "faulty"
    assert flat[a100[6].uuid]["state"] == "cordoned"
    assert nodes["a-h100-2"]["standby"] is True
    assert {d["state"] for i in nodes["a-h100-2"]["islands"] for d in i["devices"]} == {"standby"}
    assert [len(i["devices"]) for i in nodes["a-a100-1"]["islands"]] == [4, 4]  # two NVLink islands
    states = body["summary"]["states"]
    assert states["allocated"] == 4 and states["shared"] == 1 and states["faulty"] == 1
    assert body["summary"]["used_gpus"] == 4.25
    in_service = body["summary"]["in_service"]
    assert in_service == states["allocated"] + states["shared"] + states["free"]
    assert body["summary"]["utilisation_pct"] == round(100 * 4.25 / in_service, 1)


def test_queue_allocations_and_events(client: Any, ledger: Ledger) -> None:
    _populate(ledger)
    queue = client.get("/queue").json()
    assert len(queue) == 1
    assert queue[0]["reason"].startswith("needs 8 island-connected")
    assert queue[0]["waiting_s"] == 300
    summary = queue[0]["summary"]
    assert "8 NVLink/xGMI/HCCS-connected GPUs with ≥80 GiB free" in summary and "tenant vision" in summary
    allocs = client.get("/allocations").json()
    assert [a["key"] for a in allocs] == ["dag.train.r1.1.-1", "dag.nb.r1.1.-1"]
    assert allocs[0]["running_s"] == 1800 and allocs[0]["nodes"] == ["a-h100-1"]
    kinds = {e["kind"] for e in client.get("/events").json()}
    assert {"allocate", "cordon"} <= kinds


def test_quotas_partitions_and_budgets(client: Any, ledger: Ledger, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    _populate(ledger)
    quota = tmp_path / "quota.yaml"
    quota.write_text("budgets: {vision: 100}\ndefault_budget: 10\n")
    monkeypatch.setenv("GPUSCHED_QUOTA_FILE", str(quota))
    body = client.get("/quotas").json()
    # in service: 8 H100 + 8 A100 + 4 L40S + rack-b nodes, minus 1 faulty, 1 cordoned, standby node
    parts = {p["partition"]: p for p in body["partitions"]}
    assert [p["share_pct"] for p in body["partitions"]] == [70, 20, 10]
    assert parts["training"]["used_gpus"] == 4.0 and parts["dev"]["used_gpus"] == 0.25
    assert parts["training"]["pending_gpus"] == 8.0
    assert parts["training"]["share_gpus"] == pytest.approx(body["capacity_gpus"] * 0.7, abs=0.01)
    tenants = {t["tenant"]: t for t in body["tenants"]}
    assert tenants["vision"]["budget_hours"] == 100 and tenants["nlp"]["budget_hours"] == 10
    assert tenants["vision"]["used_hours"] > 0  # 4 H100 for half an hour, normalised to A100-hours
    assert tenants["vision"]["running_gpus"] == 4.0
    assert body["enforced"] is True
    monkeypatch.setenv("GPUSCHED_QUOTA_FILE", str(tmp_path / "absent.yaml"))
    assert client.get("/quotas").json()["enforced"] is False


def test_page_says_whether_quotas_are_enforced(client: Any) -> None:
    page = client.get("/ui").text
    assert "q.enforced ?" in page and "placement does not apply them" in page


def test_forecast_empty_then_from_file(client: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUSCHED_FORECAST_FILE", str(tmp_path / "forecast.json"))
    empty = client.get("/forecast").json()
    assert empty["available"] is False and "no forecast yet" in empty["note"]
    data = {"model": "ets", "start": NOW, "step_s": 3600, "level": 0.9, "mean": [3.0, 4.0],
            "lower": [2.0, 3.0], "upper": [4.0, 5.0]}
    (tmp_path / "forecast.json").write_text(json.dumps(data))
    got = client.get("/forecast").json()
    assert got["available"] is True and got["forecast"]["mean"] == [3.0, 4.0]


def test_forecast_from_ledger_event(client: Any, ledger: Ledger) -> None:
    ledger.record_event("forecast", "demand", now=NOW, model="sarimax", start=NOW, step_s=3600, level=0.8,
                        mean=[1.0], lower=[0.5], upper=[1.5])
    got = client.get("/forecast").json()
    assert got["available"] is True and got["origin"] == "ledger" and got["forecast"]["model"] == "sarimax"


def test_page_is_served_and_calls_the_json_routes(client: Any) -> None:
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for route in ("fleet", "queue", "allocations", "quotas", "forecast"):
        assert f'"{route}"' in page.text
    assert 'credentials: "same-origin"' in page.text
    assert client.get("/", follow_redirects=False).headers["location"] == "ui"


def test_empty_ledger_gives_an_empty_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.testclient import TestClient

    from gpusched.airflow.api import create_app

    app = create_app(f"sqlite:///{tmp_path / 'fresh.db'}")  # created and migrated on first use
    app.dependency_overrides[get_user] = lambda: object()
    with TestClient(app) as c:
        body = c.get("/fleet").json()
    assert body["racks"] == [] and body["summary"]["devices"] == 0 and body["simulated"] is False


def test_pure_helpers(ledger: Ledger) -> None:
    snap = ledger.snapshot(NOW)
    node = snap.node("a-h100-2")
    assert device_state(node.devices[0], node, 0) == "standby"
    text = GPURequest.build(gpus=0.5, memory="8GiB", tenant="t1", partition="dev").describe(owner=True)
    assert text == "0.5 of a GPU with ≥8 GiB free, dev, tenant t1"


def test_plugin_registers_the_lazy_app_and_the_nav_view(ledger: Ledger) -> None:
    import importlib.util

    from fastapi.testclient import TestClient

    from gpusched.airflow.api import URL_PREFIX, LazyApp

    plugin_file = Path(__file__).resolve().parents[2] / "plugins" / "gpusched_plugin.py"
    spec = importlib.util.spec_from_file_location("gpusched_plugin_under_test", plugin_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = module.GpuschedPlugin
    (app_entry,) = plugin.fastapi_apps
    assert app_entry["url_prefix"] == URL_PREFIX == "/gpusched" and isinstance(app_entry["app"], LazyApp)
    (view,) = plugin.external_views
    assert view == {"name": "GPU fleet", "href": "/gpusched/ui", "destination": "nav",
                    "category": "browse", "url_route": "gpusched"}
    with TestClient(LazyApp(ledger.url)) as lazy:
        assert lazy.get("/fleet").status_code == 401


def test_queue_rows_link_to_the_airflow_task_instance() -> None:
    """Before: the fleet page showed the raw ledger key of a waiting task."""
    from gpusched.airflow.api_views import queue_view
    from gpusched.records import QueueEntry
    from gpusched.request import GPURequest
    from gpusched.scheduler.keys import ti_key

    key = ti_key("train dag", "fit", "manual__2026-01-01T00:00:00+00:00", 2, 3)
    rows = queue_view([QueueEntry(key, GPURequest.build(gpus=8), "8 on standby nodes", 100.0, 150.0),
                       QueueEntry("bench-7", GPURequest.build(gpus=1), "busy", 120.0, 150.0)], 200.0)
    task = rows[0]["task"]
    run = "manual__2026-01-01T00%3A00%3A00%2B00%3A00"
    assert task["url"] == f"/dags/train%20dag/runs/{run}/tasks/fit/mapped/3"
    assert task["label"].startswith("train dag › fit [3]") and "try 2" in task["label"]
    assert rows[1]["task"] is None and rows[1]["key"] == "bench-7"


def test_page_carries_security_headers_and_runs_only_its_own_script(client: Any) -> None:
    import base64
    import hashlib
    import re

    page = client.get("/ui")
    policy = page.headers["content-security-policy"]
    assert "frame-ancestors 'self'" in policy and "default-src 'none'" in policy
    assert "'unsafe-inline'" not in policy.split("script-src", 1)[1].split(";", 1)[0]
    script = re.search(r"<script>(.*?)</script>", page.text, flags=re.DOTALL)
    assert script is not None
    digest = base64.b64encode(hashlib.sha256(script.group(1).encode()).digest()).decode()
    assert f"'sha256-{digest}'" in policy
    assert page.headers["x-frame-options"] == "SAMEORIGIN"
    assert page.headers["x-content-type-options"] == "nosniff"
    assert client.get("/fleet").headers["x-content-type-options"] == "nosniff"


def test_no_schema_or_docs_pages_are_served(ledger: Ledger) -> None:
    from fastapi.testclient import TestClient

    from gpusched.airflow.api import create_app

    with TestClient(create_app(ledger.url)) as anonymous:
        for route in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            answer = anonymous.get(route)
            assert answer.status_code in (401, 404), (route, answer.status_code)
            assert answer.status_code != 500


def test_preemptions_table_shows_moves_from_model_and_host_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a move of ``preemption = migrate`` was not in the fleet page's Preemptions table."""
    from _core_support import StubCore
    from airflow.api_fastapi.core_api.security import get_user
    from airflow.models.taskinstancekey import TaskInstanceKey
    from fastapi.testclient import TestClient

    from gpusched.airflow import gpu_migration
    from gpusched.airflow.api import create_app
    from gpusched.airflow.gpu_migration import Migrator
    from gpusched.airflow.gpu_preemption import Preemptor
    from gpusched.node_builder import make_node
    from gpusched.placement import Policy
    from gpusched.scheduler.keys import ti_key

    monkeypatch.setattr(gpu_migration, "append_task_log", lambda k, m, **kw: None)
    monkeypatch.setattr(gpu_migration, "save_task_event", lambda ex, **kw: None)
    led = Ledger(f"sqlite:///{tmp_path / 'moves.db'}")
    led.migrate()
    led.sync_inventory([make_node("fast", "A100-SXM-80GB", 1), make_node("slow", "T4", 1)], "test", now=NOW)
    core = StubCore(led, {"preemption": "migrate", "preemption_min_runtime_seconds": "0",
                          "migration_interval_seconds": "360", "migration_restart_seconds": "60"})
    core.holder, core.process = "sched", None  # type: ignore[attr-defined]
    core.preemption = Preemptor(core)  # type: ignore[attr-defined]
    moved, victim = ti_key("d", "train", "r", 1), ti_key("d", "etl", "r", 1)
    slow = led.snapshot(NOW).node("slow").devices[0]
    led.allocate(moved, GPURequest.build(gpus=1, job_type="resnet"),
                 [DeviceShare(slow.uuid, "slow", 0, 1000, 0)], holder="sched", now=NOW - 3600)
    core.gpu_running[TaskInstanceKey("d", "train", "r", 1, -1)] = moved
    led.record_event("preempted", victim, now=NOW - 60, by=ti_key("d", "urgent", "r", 1), reason="for urgent",
                     lost_gpu_s=12.0, grace_s=20.0)
    policy = Policy.named("gpusched", throughput={"resnet": {"A100-SXM-80GB": 10.0, "T4": 1.0}})
    assert len(Migrator(core).consider(policy, NOW)) == 1  # type: ignore[arg-type]

    monkeypatch.setattr("time.time", lambda: NOW)
    app = create_app(led.url)
    app.dependency_overrides[get_user] = lambda: object()
    with TestClient(app) as c:
        move, preemption = c.get("/preemptions").json()
        page = c.get("/ui").text
    led.close()
    assert (move["kind"], move["key"]) == ("move", moved)
    assert move["move"] == "T4 (slow:0) -> A100-SXM-80GB (fast:0)"
    assert (move["source"], move["target"]) == ("T4 (slow:0)", "A100-SXM-80GB (fast:0)")
    assert move["next_try"] == ti_key("d", "train", "r", 2) and move["next_task"]["try_number"] == 2
    assert move["gain_gpu_s"] > 0 and "moving to A100-SXM-80GB" in move["reason"]
    assert move["task"]["label"].startswith("d › train") and move["lost_gpu_s"] is None
    assert (preemption["kind"], preemption["key"], preemption["lost_gpu_s"]) == ("preemption", victim, 12.0)
    assert preemption["by_task"]["task_id"] == "urgent"
    assert '"preemptions"' in page and 'e.kind === "move"' in page and "moved" in page


def test_the_fleet_page_lists_tries_failed_as_never_fitting(client: Any, ledger: Ledger) -> None:
    """Before: a task failed as never fitting appeared nowhere on the fleet page."""
    from gpusched.scheduler.keys import ti_key

    key = ti_key("train", "huge", "manual__1", 1)
    reason = "can never fit this fleet: needs 64 island-connected GPUs; the largest matching island has 8"
    ledger.record_event("unschedulable", key, now=NOW - 30, reason=reason)
    ledger.record_event("release", "other", now=NOW - 20, reason="done")
    (row,) = client.get("/unschedulable").json()
    assert (row["key"], row["at"], row["reason"]) == (key, NOW - 30, reason)
    assert row["task"]["label"] == "train › huge (run manual__1, try 1)"
    page = client.get("/ui").text
    assert "Failed without starting" in page and '"unschedulable"' in page and "drawFailed(un)" in page
