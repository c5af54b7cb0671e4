"""Hard isolation end to end without hardware: requests (isolation / profile), the default
simulated fleet's MIG A100 and CPX MI300X, placement (hard on a slice, soft shared, any), the
environment and Docker spec of a slice, quotas, the ledger, the fleet file and the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _placement_support import no_quota

from gpusched.airflow.docker_devices import (
    container_gpu_spec,
    profiles_from_allocation,
    shares_from_allocation,
)
from gpusched.catalog import Vendor, default_catalog
from gpusched.errors import FleetFileError, GPURequestError
from gpusched.fleetfile import load_fleet, parse_fleet
from gpusched.hardware.envexport import allocation_from_env, devices_env
from gpusched.hardware.simulated import default_fleet_path
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, Policy, RunningTask, place
from gpusched.quota.policy import normalised_rate, partition_capacity, physical_milli
from gpusched.request import GPURequest

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
MIG_GPU = "GPU-sim-a-a100mig-1-0"


@pytest.fixture(scope="module")
def fleet() -> FleetSnapshot:
    return FleetSnapshot(tuple(load_fleet(default_fleet_path())))


# ---- requests ------------------------------------------------------------------------------------


def test_isolation_defaults_to_any_and_round_trips() -> None:
    plain = GPURequest.build(gpus=0.25, memory="8GiB")
    assert (plain.isolation, plain.profile) == ("any", None)
    hard = GPURequest.build(gpus=0.25, memory="8GiB", profile="3G.40GB")
    assert (hard.isolation, hard.profile) == ("hard", "3g.40gb")
    assert GPURequest.from_dict(hard.to_dict()) == hard


@pytest.mark.parametrize(
    ("kwargs", "field", "accepted"),
    [
        ({"gpus": 0.25, "memory": "8GiB", "isolation": "strict"}, "isolation", "any, hard, soft"),
        (
            {"gpus": 0.25, "memory": "8GiB", "isolation": "hard", "model": "L40S"},
            "isolation",
            "models with MIG or compute partitions: H100-SXM-80GB",
        ),
        ({"gpus": 0.25, "memory": "8GiB", "isolation": "hard", "vendor": "ascend"}, "isolation", "MI300X"),
        ({"gpus": 0.1, "memory": "8GiB", "profile": "5g.50gb"}, "profile", "1g.10gb"),
        ({"gpus": 0.1, "memory": "8GiB", "profile": "CPX", "model": "A100"}, "profile", "3g.40gb"),
        ({"gpus": 0.5, "memory": "8GiB", "profile": "1g.10gb"}, "gpus", "at most 0.142"),
        ({"gpus": 0.1, "memory": "16GiB", "profile": "1g.10gb"}, "memory", "at most 10 GiB"),
        ({"gpus": 1, "isolation": "hard"}, "isolation", "a fraction of one device"),
        ({"gpus": 0.1, "memory": "1GiB", "profile": "CPX", "isolation": "soft"}, "isolation", "hard"),
    ],
)
def test_bad_isolation_is_rejected_at_parse_time(
    kwargs: dict[str, object], field: str, accepted: str
) -> None:
    with pytest.raises(GPURequestError) as info:
        GPURequest.build(**kwargs)
    message = str(info.value)
    assert f"GPURequest.{field}:" in message and accepted in message, message
    assert "\n" not in message


# ---- placement on the default simulated fleet ----------------------------------------------------


def test_default_fleet_has_a_mig_a100_and_a_cpx_mi300x(fleet: FleetSnapshot) -> None:
    gpu = fleet.device(MIG_GPU)
    assert gpu.mig_enabled and not gpu.takes_work
    mig = [d for d in fleet.devices() if d.parent == MIG_GPU]
    assert [d.profile for d in mig] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    cpx = [d for d in fleet.devices() if d.profile == "CPX"]
    assert len(cpx) == 8 and len({d.parent for d in cpx}) == 1 and all(d.vendor is Vendor.AMD for d in cpx)
    assert {d.memory_bytes for d in cpx} == {24 * GIB}


def _place(
    fleet: FleetSnapshot, *requests: GPURequest, running: tuple[RunningTask, ...] = ()
) -> dict[str, str]:
    tasks = [PendingTask(f"t{i}", r, 0.0) for i, r in enumerate(requests)]
    plan = place(no_quota(tasks, fleet, Policy(), now=0.0, running=running))
    out = {a.key: a.shares[0].uuid for a in plan.assignments}
    out.update({r.key: "rejected: " + r.reason for r in plan.rejections})
    return out


def test_hard_fraction_gets_the_smallest_matching_mig_instance_whole(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=0.1, memory="8GiB", isolation="hard", vendor="nvidia")
    plan = place(no_quota([PendingTask("t", request, 0.0)], fleet, Policy(), now=0.0))
    (share,) = plan.assignments[0].shares
    device = fleet.device(share.uuid)
    assert device.parent == MIG_GPU and device.profile == "1g.10gb"
    assert (share.milli, share.memory_bytes) == (1000, device.memory_bytes)  # the whole slice
    env = devices_env([share], fleet)
    assert env["CUDA_VISIBLE_DEVICES"] == share.uuid and share.uuid.startswith("MIG-")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env and env["GPUSCHED_ISOLATION"] == "hard"
    assert json.loads(env["GPUSCHED_ALLOCATION"])["profiles"] == ["1g.10gb"]


def test_a_slice_is_never_handed_out_twice_and_its_gpu_never_at_all(fleet: FleetSnapshot) -> None:
    hard = GPURequest.build(gpus=0.1, memory="8GiB", isolation="hard", vendor="nvidia")
    placed = _place(fleet, *[hard] * 6)
    slices = [u for u in placed.values() if not u.startswith("rejected")]
    assert len(slices) == 4 == len(set(slices))  # four MIG instances, each once
    assert all(fleet.device(u).parent == MIG_GPU for u in slices)
    assert sum(v.startswith("rejected: waiting") for v in placed.values()) == 2
    whole = _place(fleet, *[GPURequest.build(gpus=1, model="A100")] * 10)
    assert MIG_GPU not in whole.values()
    assert not any(fleet.device(u).parent for u in whole.values() if not u.startswith("rejected"))


def test_soft_shares_a_whole_device_and_any_prefers_sharing(fleet: FleetSnapshot) -> None:
    soft = GPURequest.build(gpus=0.1, memory="8GiB", isolation="soft", model="A100")
    anyway = GPURequest.build(gpus=0.1, memory="8GiB", model="A100")
    placed = _place(fleet, soft, anyway)
    for uuid in placed.values():
        device = fleet.device(uuid)
        assert device.parent is None and device.takes_work


def test_any_falls_back_to_a_slice_when_no_device_can_be_shared(fleet: FleetSnapshot) -> None:
    a100s = [d for d in fleet.devices() if d.model == "A100-SXM-80GB" and d.takes_work and not d.parent]
    busy = tuple(
        RunningTask(
            f"busy{i}",
            GPURequest.build(gpus=1),
            (DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes),),
            0.0,
            None,
        )
        for i, d in enumerate(a100s)
    )
    snapshot = fleet.with_usage([s for r in busy for s in r.shares])
    placed = _place(snapshot, GPURequest.build(gpus=0.1, memory="8GiB", model="A100"), running=busy)
    assert snapshot.device(placed["t0"]).parent == MIG_GPU


def test_profile_pins_the_slice_and_cpx_is_an_amd_partition(fleet: FleetSnapshot) -> None:
    placed = _place(
        fleet,
        GPURequest.build(gpus=0.3, memory="30GiB", profile="3g.40gb"),
        GPURequest.build(gpus=0.1, memory="16GiB", profile="CPX"),
    )
    assert fleet.device(placed["t0"]).profile == "3g.40gb"
    cpx = fleet.device(placed["t1"])
    assert cpx.profile == "CPX" and cpx.vendor is Vendor.AMD
    env = devices_env([DeviceShare(cpx.uuid, cpx.node, cpx.index, 1000, cpx.memory_bytes)], fleet)
    assert env["HIP_VISIBLE_DEVICES"] == str(cpx.index) and env["GPUSCHED_ISOLATION"] == "hard"


def test_hard_request_on_a_fleet_without_slices_waits_for_a_re_partition() -> None:
    plain = FleetSnapshot(tuple(load_fleet(default_fleet_path().with_name("small.yaml"))))
    if any(d.parent for d in plain.devices()):
        pytest.skip("the small fleet has slices")
    request = GPURequest.build(gpus=0.1, memory="8GiB", isolation="hard")
    plan = place(no_quota([PendingTask("t0", request, 0.0)], plain, Policy(), now=0.0))
    (rejection,) = plan.rejections
    assert not rejection.permanent  # the A100 can be cut into MIG instances: it waits
    assert rejection.reason.startswith("waiting for a MIG re-partition of GPU-sim-n1-0 (A100-SXM-80GB on n1)")
    assert "1g.10gb" in rejection.reason and "nvidia-smi -i <gpu> -mig 1" in rejection.reason
    # Without a GPU that has slice profiles it never fits, as before.
    unsliceable = FleetSnapshot(tuple(
        n for n in plain.nodes if not any(d.model in ("A100-SXM-80GB", "MI300X") for d in n.devices)))
    plan = place(no_quota([PendingTask("t0", request, 0.0)], unsliceable, Policy(), now=0.0))
    (rejection,) = plan.rejections
    assert rejection.permanent and "MIG instance or compute partition" in rejection.reason


def test_slices_of_a_cordoned_or_unhealthy_gpu_are_out_of_service(fleet: FleetSnapshot) -> None:
    from dataclasses import replace

    from gpusched.model import Health

    broken = fleet.with_device(replace(fleet.device(MIG_GPU), health=Health.UNHEALTHY))
    placed = _place(broken, GPURequest.build(gpus=0.1, memory="8GiB", isolation="hard", vendor="nvidia"))
    assert placed["t0"].startswith("rejected") and "unhealthy" in placed["t0"]


# ---- quota, Docker, ledger ----------------------------------------------------------------------


def test_a_slice_costs_its_share_of_the_gpu(fleet: FleetSnapshot) -> None:
    slice_ = next(d for d in fleet.devices() if d.profile == "3g.40gb")
    share = DeviceShare(slice_.uuid, slice_.node, slice_.index, 1000, slice_.memory_bytes)
    a100 = default_catalog().get("A100-SXM-80GB").a100_equiv_milli
    assert normalised_rate([share], fleet) == 1000 * a100 * slice_.compute_milli // 10**6
    assert physical_milli([share], fleet) == slice_.compute_milli == 428
    whole_devices = sum(
        1 for d in fleet.devices() if d.takes_work and not d.parent and not fleet.node(d.node).standby
    )
    slices = sum(d.compute_milli for d in fleet.devices() if d.parent)
    assert partition_capacity(fleet) == whole_devices * 1000 + slices


def test_docker_gets_the_mig_uuid_and_the_cpx_render_node(fleet: FleetSnapshot) -> None:
    slice_ = next(d for d in fleet.devices() if d.profile == "2g.20gb")
    env = devices_env([DeviceShare(slice_.uuid, slice_.node, 0, 1000, slice_.memory_bytes)], fleet, key="k")
    record = allocation_from_env(env)
    assert record is not None
    shares, vendor, models = shares_from_allocation(record)
    spec = container_gpu_spec(shares, vendor, models=models, profiles=profiles_from_allocation(record))
    assert spec.gpu_device_ids == (slice_.uuid,) and not spec.ipc_host and spec.bind_mounts == ()
    assert spec.environment["CUDA_VISIBLE_DEVICES"] == slice_.uuid
    assert spec.environment["GPUSCHED_ISOLATION"] == "hard"
    cpx = next(d for d in fleet.devices() if d.profile == "CPX" and d.index == 5)
    spec = container_gpu_spec(
        [DeviceShare(cpx.uuid, cpx.node, 5, 1000, cpx.memory_bytes)],
        Vendor.AMD,
        dev_root="/dev",
        profiles={cpx.uuid: "CPX"},
    )
    assert "/dev/dri/renderD133:/dev/dri/renderD133:rwm" in spec.devices
    assert spec.environment["HIP_VISIBLE_DEVICES"] == "0" and spec.environment["GPUSCHED_ISOLATION"] == "hard"


def test_ledger_keeps_slices_across_a_restart(tmp_path: Path) -> None:
    from gpusched.ledger import Ledger

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    nodes = [n for n in load_fleet(default_fleet_path()) if n.name in ("a-a100mig-1", "b-mi300x-cpx-1")]
    with Ledger(url) as ledger:
        ledger.migrate()
        ledger.sync_inventory(nodes, "test")
    with Ledger(url) as ledger:
        snapshot = ledger.snapshot()
    slice_ = snapshot.device("MIG-GPU-sim-a-a100mig-1-0-0")
    assert (slice_.parent, slice_.profile, slice_.compute_milli) == (MIG_GPU, "3g.40gb", 428)
    assert snapshot.device(MIG_GPU).mig_enabled
    assert {d.profile for d in snapshot.devices() if d.vendor is Vendor.AMD} == {"CPX"}


def test_ledger_never_hands_out_a_mig_enabled_gpu(tmp_path: Path) -> None:
    from gpusched.errors import AllocationConflictError
    from gpusched.ledger import Ledger

    nodes = [n for n in load_fleet(default_fleet_path()) if n.name == "a-a100mig-1"]
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        ledger.migrate()
        ledger.sync_inventory(nodes, "test")
        gpu = ledger.snapshot().device(MIG_GPU)
        share = DeviceShare(gpu.uuid, gpu.node, gpu.index, 1000, gpu.memory_bytes)
        with pytest.raises(AllocationConflictError, match="in MIG mode"):
            ledger.allocate("k", GPURequest.build(gpus=1), [share], holder="test", lease_s=60)
        assert not ledger.active()


def test_an_oom_on_a_slice_retries_on_a_bigger_slice(fleet: FleetSnapshot) -> None:
    from gpusched.faults.classify import Classification, FailureKind
    from gpusched.faults.remedies import choose_remedy
    from gpusched.placement.feasible import feasible

    small = next(d for d in fleet.devices() if d.profile == "1g.10gb")
    request = GPURequest.build(gpus=0.1, memory="8GiB", profile="1g.10gb")
    cls = Classification(FailureKind.CUDA_OOM, ("CUDA out of memory",), tried_bytes=6 * GIB)
    remedy = choose_remedy(cls, request, [small.uuid], fleet, attempt=1)
    assert remedy.retry and remedy.request is not None
    assert remedy.request.isolation == "hard" and remedy.request.profile is None
    assert remedy.request.memory_per_gpu == 14 * GIB
    placed = _place(fleet, remedy.request)
    assert fleet.device(placed["t0"]).profile in ("2g.20gb", "3g.40gb", "CPX")
    too_big = GPURequest.build(gpus=0.5, memory="60GiB", isolation="hard", model="A100")
    assert not feasible(too_big, fleet, empty=True)  # no A100 slice has 60 GiB: scale out, not retry


# ---- fleet file ----------------------------------------------------------------------------------


def _group(**extra: object) -> dict[str, object]:
    return {"racks": [{"name": "r", "nodes": [{"name": "n", "devices": {"count": 1, **extra}}]}]}


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"model": "L40S", "mig": ["1g.10gb"]}, "L40S has no MIG"),
        ({"model": "A100", "mig": ["5g.50gb"]}, "no slice profile '5g.50gb'"),
        ({"model": "A100", "mig": ["4g.40gb", "4g.40gb"]}, "at most 1 × 4g.40gb"),
        ({"model": "A100", "mig": ["3g.40gb", "3g.40gb", "1g.10gb"]}, "more memory"),
        ({"model": "A100", "mig": ["4g.40gb", "2g.20gb", "2g.20gb"]}, "more compute"),
        ({"model": "MI300X", "compute_partition": "OCTO"}, "not a partition mode"),
        ({"model": "MI300X", "compute_partition": "CPX", "memory_partition": "NPS2"}, "NPS1, NPS4"),
        ({"model": "H100", "compute_partition": "CPX"}, "no compute partitions"),
    ],
)
def test_impossible_partition_layouts_are_rejected(group: dict[str, object], message: str) -> None:
    with pytest.raises(FleetFileError, match=message):
        parse_fleet(_group(**group))


# ---- simulator -----------------------------------------------------------------------------------


def test_simulate_places_hard_isolation_pods_on_slices(tmp_path: Path) -> None:
    from gpusched.sim.engine import simulate
    from gpusched.sim.jobs import load_any_trace

    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,isolation,creation_time,deletion_time\n"
        + "".join(f"h{i},1000,1024,1,100,A100-SXM-80GB,hard,{i},{i + 600}\n" for i in range(4))
        + "s0,1000,1024,1,100,A100-SXM-80GB,soft,0,600\n",
        encoding="utf-8",
    )
    fleet = FleetSnapshot(tuple(load_fleet(default_fleet_path())))
    result = simulate(load_any_trace(pods), fleet, Policy(), policy_name="gpusched")
    records = {r.key: r for r in result.records}
    for i in range(4):
        (share,) = records[f"h{i}"].shares
        assert fleet.device(share.uuid).parent == MIG_GPU and share.milli == 1000
    (soft,) = records["s0"].shares
    assert fleet.device(soft.uuid).parent is None and soft.milli == 100
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpusched.cli",
            "simulate",
            "--trace",
            str(pods),
            "--fleet",
            str(default_fleet_path()),
            "--json",
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["jobs_started"] == 5


def test_a_hard_pod_must_be_a_fraction(tmp_path: Path) -> None:
    from gpusched.errors import TraceError
    from gpusched.sim.traces import load_openb_pods

    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,isolation\np,1,1,2,1000,hard\n", encoding="utf-8"
    )
    with pytest.raises(TraceError, match="isolation"):
        load_openb_pods(pods)


# ---- fleet page ----------------------------------------------------------------------------------


def test_fleet_page_draws_slices_inside_their_device_tile(fleet: FleetSnapshot) -> None:
    from gpusched.airflow.api_views import fleet_view
    from gpusched.airflow.ui_page import render_page

    slice_ = next(d for d in fleet.devices() if d.profile == "3g.40gb")
    used = fleet.with_usage([DeviceShare(slice_.uuid, slice_.node, 0, 1000, slice_.memory_bytes)])
    body = fleet_view(used)
    tiles = {
        d["uuid"]: d for r in body["racks"] for n in r["nodes"] for i in n["islands"] for d in i["devices"]
    }
    assert not any(uuid.startswith("MIG-") for uuid in tiles)  # slices are not tiles of their own
    gpu = tiles[MIG_GPU]
    assert gpu["partitioned"] == "MIG" and [s["profile"] for s in gpu["slices"]] == [
        "3g.40gb",
        "2g.20gb",
        "1g.10gb",
        "1g.10gb",
    ]
    assert gpu["state"] == "shared" and gpu["slices"][0]["state"] == "allocated"
    assert gpu["used_milli"] == 428
    card = tiles["AMD-sim-b-mi300x-cpx-1-card0"]
    assert card["partitioned"] == "CPX" and len(card["slices"]) == 8 and card["state"] == "free"
    assert card["memory_gib"] == 192
    assert body["summary"]["devices"] == len(tiles) and body["summary"]["used_gpus"] == 0.43
    assert "function slices(list)" in render_page()


# ---- genetic optimiser ---------------------------------------------------------------------------


def test_the_genetic_optimiser_keeps_hard_requests_on_whole_slices(fleet: FleetSnapshot) -> None:
    from gpusched.placement.genetic import optimise_with_report

    tasks = [
        PendingTask(f"h{i}", GPURequest.build(gpus=0.1, memory="8GiB", isolation="hard", vendor="nvidia",
                                              expected_duration=600 * (i + 1)), 0.0)
        for i in range(6)
    ] + [PendingTask(f"s{i}", GPURequest.build(gpus=0.1, memory="8GiB", isolation="soft", model="A100",
                                               expected_duration=600), 0.0) for i in range(3)]
    result = optimise_with_report(no_quota(tasks, fleet, Policy.named("gpusched"), now=0.0), budget_ms=5_000,
                                  max_generations=15)
    used: dict[str, int] = {}
    for a in result.plan.assignments:
        (share,) = a.shares
        device = fleet.device(share.uuid)
        used[share.uuid] = used.get(share.uuid, 0) + share.milli
        if a.key.startswith("h"):
            assert device.parent == MIG_GPU and share.milli == 1000
        else:
            assert device.parent is None and device.takes_work and share.milli == 100
    assert all(milli <= 1000 for milli in used.values())
    assert sum(a.key.startswith("h") for a in result.plan.assignments) == 4  # four MIG instances


def test_a_hard_request_bigger_than_every_slice_waits_for_a_re_partition(fleet: FleetSnapshot) -> None:
    # The README's example on the default fleet: its largest MIG slice is 3g.40gb, 3/7 of an A100;
    # the idle MIG A100 can be re-laid out with a 4g.40gb instance, so the task waits for that.
    placed = _place(fleet, GPURequest.build(gpus=0.5, memory="20GiB", isolation="hard"))
    assert placed["t0"].startswith("rejected: waiting for a MIG re-partition of GPU-sim-a-a100mig-1-0 ")
    assert "makes a 4g.40gb slice (GPUSCHED_DYNAMIC_MIG)" in placed["t0"]
    busy = fleet.with_usage([DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)
                             for d in fleet.devices() if d.model == "A100-SXM-80GB" and d.takes_work])
    placed = _place(busy, GPURequest.build(gpus=0.5, memory="20GiB", isolation="hard", model="A100"))
    assert "once it is idle" in placed["t0"]
    assert "GPU(s) that could be re-partitioned are busy" in placed["t0"]


