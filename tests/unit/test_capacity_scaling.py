"""Pre-scaling plans and the scaler providers (local state file, command, webhook on 127.0.0.1)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from gpusched.capacity.forecast import Forecast
from gpusched.capacity.scaling import (
    CommandScaler,
    LocalFleetScaler,
    ScalingPlan,
    WebhookScaler,
    activate_in_snapshot,
    plan_prescale,
    scaler_from_spec,
)
from gpusched.catalog import default_catalog
from gpusched.errors import ConfigurationError, ScalingError
from gpusched.model import Device, FleetSnapshot, Node

NOW = 1_700_000_000.0


def _node(name: str, gpus: int, standby: bool = True) -> Node:
    model = default_catalog().get("A100-SXM-80GB")
    devices = tuple(Device(f"{name}-{i}", i, name, model.name, model.vendor, model.architecture,
                           model.memory_bytes) for i in range(gpus))
    return Node(name, "r0", devices, standby=standby)


def _forecast(mean: list[float], band: float = 2.0) -> Forecast:
    return Forecast("ets", NOW, 3600, tuple(mean), tuple(m - band for m in mean),
                    tuple(m + band for m in mean), 0.9)


def test_activates_standby_ahead_of_predicted_peak() -> None:
    # Demand jumps to 30 GPUs in the second hour; with a 15-minute delay we must act now.
    fc = _forecast([10, 30, 10, 10])
    standby = [_node("big", 8), _node("small", 4), _node("huge", 16)]
    plan = plan_prescale(fc, 16, 900, now=NOW, standby=standby, headroom=0.0)
    assert plan.target_gpus == 32  # upper bound of the second hour
    assert plan.activate == ("huge",)  # one 16-GPU node covers the 16 missing
    assert [s.at for s in plan.steps] == [NOW, NOW + 3600]  # window: now .. now + delay + 1 h
    assert plan.steps[1].request_by == NOW + 3600 - 900
    assert "activate 1 standby node" in plan.reason


def test_smallest_sufficient_last_node_and_shortfall() -> None:
    standby = [_node("a", 8), _node("b", 8), _node("c", 2)]
    plan = plan_prescale(_forecast([18], band=0), 8, 900, now=NOW, standby=standby, headroom=0.0)
    assert plan.activate == ("a", "c")  # 8 + 2 covers the 10 missing
    short = plan_prescale(_forecast([100], band=0), 8, 900, now=NOW, standby=standby, headroom=0.0)
    assert set(short.activate) == {"a", "b", "c"} and "still 74 GPUs short" in short.reason


def test_no_activation_when_covered_and_burst_reserve() -> None:
    fc = _forecast([10, 12], band=3.0)
    plan = plan_prescale(fc, 40, 900, now=NOW, standby=[_node("a", 8)])
    assert plan.activate == () and plan.surplus_gpus == 40 - plan.target_gpus
    assert plan.burst_reserve_gpus == 3  # the uncertainty band
    burst = _forecast([4, 7], band=1.0)
    assert plan_prescale(fc, 40, 900, now=NOW, burst_forecast=burst).burst_reserve_gpus == 8
    assert ScalingPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_local_scaler_persists_and_activates_snapshot(tmp_path: Path) -> None:
    plan = plan_prescale(_forecast([30], band=0), 16, 900, now=NOW, standby=[_node("s1", 8), _node("s2", 8)],
                         headroom=0.0)
    scaler = LocalFleetScaler(tmp_path / "scaling.json")
    result = scaler.apply(plan)
    assert result.applied and result.activated == ("s1", "s2")
    state = json.loads((tmp_path / "scaling.json").read_text())
    assert state["active_standby"] == ["s1", "s2"] and state["last_plan"]["target_gpus"] == 30
    snapshot = FleetSnapshot((_node("on", 8, standby=False), _node("s1", 8), _node("s2", 8)))
    active = activate_in_snapshot(snapshot, state["active_standby"])
    assert [n.standby for n in active.nodes] == [False, False, False]
    scaler.deactivate(["s2"])
    assert scaler.state()["active_standby"] == ["s1"]


def test_local_scaler_default_path_is_under_state_dir() -> None:
    from gpusched.paths import state_dir

    assert LocalFleetScaler().state_file == state_dir() / "scaling.json"


def test_command_scaler_gets_plan_on_stdin(tmp_path: Path) -> None:
    out = tmp_path / "got.json"
    code = f"import sys, pathlib; pathlib.Path({str(out)!r}).write_text(sys.stdin.read()); print('scaled')"
    plan = plan_prescale(_forecast([30], band=0), 16, 900, now=NOW, standby=[_node("s1", 16)])
    result = CommandScaler([sys.executable, "-c", code]).apply(plan)
    assert result.detail == "scaled" and json.loads(out.read_text())["activate"] == ["s1"]
    failing = CommandScaler([sys.executable, "-c", "import sys; sys.exit('no credentials')"])
    with pytest.raises(ScalingError, match="no credentials"):
        failing.apply(plan)


class _Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, object]]] = []
    status = 200

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(_Hook.status)
        self.end_headers()
        self.wfile.write(b'{"ok": true}')

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def hook_url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/scale"
    finally:
        server.shutdown()
        server.server_close()


def test_webhook_scaler_posts_json(hook_url: str) -> None:
    _Hook.received.clear()
    _Hook.status = 200
    plan = plan_prescale(_forecast([30], band=0), 16, 900, now=NOW, standby=[_node("s1", 16)])
    result = WebhookScaler(hook_url).apply(plan)
    assert result.applied and '"ok"' in result.detail
    assert _Hook.received[0]["activate"] == ["s1"] and _Hook.received[0]["provisioning_delay_s"] == 900
    _Hook.status = 503
    with pytest.raises(ScalingError, match="HTTP 503"):
        WebhookScaler(hook_url).apply(plan)


def test_scaler_from_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(scaler_from_spec("local"), LocalFleetScaler)
    assert isinstance(scaler_from_spec("command:/bin/echo hi"), CommandScaler)
    monkeypatch.setenv("GPUSCHED_SCALER", "webhook:http://127.0.0.1:9/x")
    assert isinstance(scaler_from_spec(), WebhookScaler)
    with pytest.raises(ConfigurationError, match="GPUSCHED_SCALER"):
        scaler_from_spec("ftp:somewhere")
    with pytest.raises(ConfigurationError, match="http"):
        WebhookScaler("127.0.0.1:9")


def test_standby_for_waiting_serves_only_tasks_a_standby_node_helps() -> None:
    from dataclasses import replace as _replace

    from gpusched.capacity.prescale import WaitingTask, standby_for_waiting
    from gpusched.model import FleetSnapshot
    from gpusched.request import GPURequest
    from gpusched.testing import synthetic_fleet

    nodes = list(synthetic_fleet(3, used_fraction=0.0).nodes)
    nodes[2] = _replace(nodes[2], standby=True)
    fleet = FleetSnapshot(tuple(nodes), source="test")
    per_node = len(nodes[0].devices)
    fits_now = WaitingTask("small", GPURequest.build(gpus=1), 0.0)  # waits for a budget, not GPUs
    spread = {"gang": True, "interconnect": "any"}
    too_big = WaitingTask("huge", GPURequest.build(gpus=per_node * 5, **spread), 0.0)  # no node helps
    needs_standby = WaitingTask("wide", GPURequest.build(gpus=per_node * 3, **spread), 0.0)
    decision = standby_for_waiting([fits_now, too_big, needs_standby], fleet, now=600.0, threshold_s=300.0)
    assert decision.activate == (nodes[2].name,)
    assert len(decision.reasons) == 1 and decision.reasons[0].startswith("wide waited 10 min")
    assert standby_for_waiting([needs_standby], fleet, now=100.0, threshold_s=300.0).activate == ()


def test_a_waiting_gang_switches_on_the_standby_node_it_needs_as_one_unit() -> None:
    """Before: each member of the example gang fits a-h100-1 on its own, so the reactive rule
    left the gang alone and it never ran on the default fleet."""
    from gpusched.capacity.prescale import WaitingTask, standby_for_gang, standby_for_waiting
    from gpusched.fleetfile import load_fleet
    from gpusched.gang import GangMember
    from gpusched.model import FleetSnapshot
    from gpusched.paths import include_dir
    from gpusched.request import GPURequest

    fleet = FleetSnapshot(tuple(load_fleet(include_dir() / "fleets" / "default.yaml")), source="test")
    member = GPURequest.build(gpus=8, model="H100-SXM-80GB", interconnect="same_node")

    def gang(size: int, present: int, name: str = "pretrain") -> list[WaitingTask]:
        return [WaitingTask(f"{name}__node{r}", member, 60.0 * r, GangMember(f"d/r/-1/{name}", size, r))
                for r in range(present)]

    decision = standby_for_waiting(gang(2, 2), fleet, now=660.0, threshold_s=300.0)
    assert decision.activate == ("a-h100-2",)
    assert decision.reasons == ("multi-node gang pretrain (2 members of 8 GPU(s)) waited 10 min for "
                                "standby node a-h100-2; activating it",)
    # The gang waits as a whole since its last member came (60 s): 290 s < 300 s.
    assert standby_for_waiting(gang(2, 2), fleet, now=350.0, threshold_s=300.0).activate == ()
    # Not every member queued yet: nothing for the gang.
    assert standby_for_waiting(gang(2, 1), fleet, now=660.0, threshold_s=300.0).activate == ()
    assert standby_for_waiting(gang(3, 3), fleet, now=660.0, threshold_s=300.0).activate == ()  # never fits
    assert standby_for_gang(member, 2, True, fleet) == ("a-h100-2",)
    assert standby_for_gang(member, 1, True, fleet) == ()
    assert standby_for_gang(member, 3, True, fleet) is None
    assert standby_for_gang(member, 2, False, fleet) == ("a-h100-2",)


def test_scale_in_goes_through_every_provider(hook_url: str, tmp_path: Path) -> None:
    from gpusched.capacity.scaling import scale_in_after

    _Hook.received.clear()
    _Hook.status = 200
    plan = plan_prescale(_forecast([30], band=0), 16, 900, now=NOW, standby=[_node("s1", 16)])
    WebhookScaler(hook_url).apply(plan)
    result = WebhookScaler(hook_url).release(["s1"], reason="idle 31 min", now=NOW + 3600)
    assert result.applied and [r["action"] for r in _Hook.received] == ["activate", "release"]
    assert _Hook.received[1] == {"action": "release", "release": ["s1"], "reason": "idle 31 min",
                                 "created_at": NOW + 3600}
    local = LocalFleetScaler(tmp_path / "scaling.json")
    local.apply(plan)
    assert local.state()["activated_at"] == {"s1": NOW}
    assert local.release(["s1"], reason="idle", now=NOW + 3600).applied
    assert local.state()["active_standby"] == [] and local.state()["activated_at"] == {}
    assert scale_in_after("") == 1800.0 and scale_in_after("off") is None and scale_in_after("60") == 60.0
    with pytest.raises(ConfigurationError, match="GPUSCHED_SCALE_IN_AFTER_S"):
        scale_in_after("soon")


def test_a_switched_on_node_may_take_twice_the_provisioning_delay_to_come_up() -> None:
    from gpusched.capacity.scaling import provisioning_timeout

    assert provisioning_timeout("") == 1800.0 and provisioning_timeout("60") == 120.0
    with pytest.raises(ConfigurationError, match="GPUSCHED_PROVISIONING_DELAY_S"):
        provisioning_timeout("soon")
