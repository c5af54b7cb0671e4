"""AmdBackend against a fake AMD SMI: the REAL ``amdsmi`` package is imported (its C library replaced
by a mock, since this host has no ROCm) and every function the backend calls is an autospec of
the real one, so a wrong name or arity fails. The box modelled: two MI300X joined by xGMI."""

from __future__ import annotations

import ctypes
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
from _placement_support import no_quota

from gpusched.catalog import LinkKind, Vendor
from gpusched.errors import BackendUnavailableError, HardwareError
from gpusched.hardware.amd import AmdBackend, amd_catalog_model_name, import_amdsmi
from gpusched.hardware.base import HardwareBackend
from gpusched.hardware.topology import HostInfo
from gpusched.model import Health

SOURCE = Path(__file__).resolve().parents[2] / "gpusched" / "hardware" / "amd.py"
HOST = HostInfo(name="mi-1", rack="r2", labels=(), cpu_milli=192_000, memory_bytes=2**41)
VRAM = 205_822_885_888  # what an MI300X reports: 191.69 GiB


@pytest.fixture(scope="module")
def real_amdsmi() -> Iterator[ModuleType]:
    """The installed amdsmi package, loaded with a stand-in for libamd_smi.so."""
    saved = {k: v for k, v in sys.modules.items() if k == "amdsmi" or k.startswith("amdsmi.")}
    for key in saved:
        del sys.modules[key]
    with mock.patch.object(ctypes, "CDLL", return_value=mock.MagicMock(name="libamd_smi.so")):
        import amdsmi
    loaded = {k: v for k, v in sys.modules.items() if k == "amdsmi" or k.startswith("amdsmi.")}
    for key in loaded:
        del sys.modules[key]
    sys.modules.update(saved)
    yield amdsmi


@dataclass
class Gpu:
    uuid: str
    bdf: str
    numa: int
    activity: int = 0
    hotspot: int = 45
    power_w: int = 150
    used: int = 0
    uncorrectable: int = 0
    compute_partition: str = "SPX"
    memory_partition: str = "NPS1"
    vram: int = VRAM


@dataclass
class AmdBox:
    gpus: list[Gpu]
    xgmi: set[frozenset[int]] = field(default_factory=set)
    init_error: int | None = None
    memory_total_broken: bool = False


def mi300x_pair() -> AmdBox:
    return AmdBox(
        gpus=[Gpu("9aff74a1-0000-1000-80a2-d1b2c3e4f501", "0000:0c:00.0", 0, activity=37, used=40 * 2**30),
              Gpu("5bff74a1-0000-1000-80a2-d1b2c3e4f502", "0000:22:00.0", 1, uncorrectable=2)],
        xgmi={frozenset({0, 1})},
    )


def fake_functions(smi: Any, box: AmdBox) -> dict[str, Callable[..., Any]]:
    handles = [object() for _ in box.gpus]

    def gpu(handle: object) -> Gpu:
        return box.gpus[handles.index(handle)]

    def fail(code: int) -> Exception:
        return smi.AmdSmiLibraryException(code)

    def init(flag: Any = None) -> None:
        if box.init_error is not None:
            raise fail(box.init_error)

    def link_type(a: object, b: object) -> dict[str, int]:
        pair = frozenset({handles.index(a), handles.index(b)})
        kinds = smi.AmdSmiLinkType
        kind = kinds.AMDSMI_LINK_TYPE_XGMI if pair in box.xgmi else kinds.AMDSMI_LINK_TYPE_PCIE
        return {"hops": 1, "type": int(kind)}

    def memory_total(handle: object, mem_type: Any) -> int:
        assert mem_type == smi.AmdSmiMemoryType.VRAM
        if box.memory_total_broken:
            raise fail(smi.amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED)
        return gpu(handle).vram

    def temp(handle: object, sensor: Any, metric: Any) -> int:
        assert metric == smi.AmdSmiTemperatureMetric.CURRENT
        if sensor != smi.AmdSmiTemperatureType.HOTSPOT:
            raise fail(smi.amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED)  # MI300X: no edge sensor
        return gpu(handle).hotspot

    def set_compute_partition(handle: object, mode: Any) -> None:
        assert isinstance(mode, smi.AmdSmiComputePartitionType), mode  # the real one insists too
        card = gpu(handle)
        if card.activity:  # a process runs on the card: the driver refuses
            raise fail(smi.amdsmi_wrapper.AMDSMI_STATUS_BUSY)
        card.compute_partition = mode.name

    return {
        "amdsmi_init": init,
        "amdsmi_shut_down": lambda: None,
        "amdsmi_get_processor_handles": lambda: handles[: len(box.gpus)],
        "amdsmi_get_gpu_device_uuid": lambda h: gpu(h).uuid,
        "amdsmi_get_gpu_device_bdf": lambda h: gpu(h).bdf,
        "amdsmi_get_gpu_asic_info": lambda h: {
            "market_name": "AMD Instinct MI300X", "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc.", "device_id": "0x74a1",
            "target_graphics_version": "gfx942", "num_compute_units": 304,
        },
        "amdsmi_get_gpu_memory_total": memory_total,
        "amdsmi_get_gpu_vram_info": lambda h: {"vram_type": 5, "vram_size": VRAM // 2**20},
        "amdsmi_get_gpu_memory_usage": lambda h, mem_type: gpu(h).used,
        "amdsmi_topo_get_numa_node_number": lambda h: gpu(h).numa,
        "amdsmi_topo_get_link_type": link_type,
        "amdsmi_get_gpu_activity": lambda h: {"gfx_activity": gpu(h).activity, "umc_activity": 3,
                                              "mm_activity": "N/A"},
        "amdsmi_get_temp_metric": temp,
        "amdsmi_get_power_info": lambda h: {
            "current_socket_power": gpu(h).power_w, "average_socket_power": "N/A", "power_limit": 750,
        },
        # Both return the mode as a string ("SPX" … "CPX", "NPS1" / "NPS4"), as the real ones do.
        "amdsmi_get_gpu_compute_partition": lambda h: gpu(h).compute_partition,
        "amdsmi_set_gpu_compute_partition": set_compute_partition,
        "amdsmi_get_gpu_memory_partition": lambda h: gpu(h).memory_partition,
        "amdsmi_get_gpu_total_ecc_count": lambda h: {"correctable_count": 5,
                                                     "uncorrectable_count": gpu(h).uncorrectable,
                                                     "deferred_count": 0},
    }


@pytest.fixture
def install(real_amdsmi: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Callable[[AmdBox], ModuleType]:
    monkeypatch.setitem(sys.modules, "amdsmi", real_amdsmi)

    def apply(box: AmdBox) -> ModuleType:
        for name, impl in fake_functions(real_amdsmi, box).items():
            monkeypatch.setattr(real_amdsmi, name, mock.create_autospec(getattr(real_amdsmi, name),
                                                                        side_effect=impl))
        return real_amdsmi

    return apply


def test_every_amdsmi_name_used_exists_in_the_real_package(real_amdsmi: ModuleType) -> None:
    used = set(re.findall(r"smi\.((?:amdsmi|AmdSmi)\w+)", SOURCE.read_text()))
    assert len(used) > 15
    assert [name for name in used if not hasattr(real_amdsmi, name)] == []
    functions = {name for name in used if name.startswith("amdsmi_")}
    assert functions <= set(fake_functions(real_amdsmi, mi300x_pair()))


def test_autospec_rejects_wrong_arity(install: Callable[[AmdBox], ModuleType]) -> None:
    smi = install(mi300x_pair())
    with pytest.raises(TypeError):
        smi.amdsmi_get_temp_metric(object(), smi.AmdSmiTemperatureType.HOTSPOT)


def test_discovery_of_an_xgmi_pair(install: Callable[[AmdBox], ModuleType]) -> None:
    box = mi300x_pair()
    install(box)
    backend = AmdBackend(host=HOST)
    assert isinstance(backend, HardwareBackend)
    (node,) = backend.discover()
    assert (node.name, node.rack) == ("mi-1", "r2")
    first, second = node.devices
    assert first.uuid == box.gpus[0].uuid and second.index == 1
    assert (first.model, first.vendor, first.architecture) == ("MI300X", Vendor.AMD, "gfx942")
    assert first.memory_bytes == VRAM
    assert (first.numa_node, second.numa_node) == (0, 1)
    assert first.island == second.island == "mi-1/xgmi0"
    assert first.link is LinkKind.XGMI and first.peers == (second.uuid,)
    assert first.pcie_switch != second.pcie_switch
    assert (first.health, second.health) == (Health.HEALTHY, Health.DEGRADED)  # 2 uncorrectable ECC
    assert "2 device" in backend.description
    backend.close()


def test_no_xgmi_means_pcie_only(install: Callable[[AmdBox], ModuleType]) -> None:
    box = mi300x_pair()
    box.xgmi = set()
    box.memory_total_broken = True  # falls back to vram_info (MiB)
    install(box)
    (node,) = AmdBackend(host=HOST).discover()
    assert all(d.island is None and d.link is LinkKind.PCIE and d.peers == () for d in node.devices)
    assert node.devices[0].memory_bytes == (VRAM // 2**20) * 2**20


def test_samples(install: Callable[[AmdBox], ModuleType]) -> None:
    box = mi300x_pair()
    install(box)
    first, second = AmdBackend(host=HOST).sample()
    assert (first.utilization_pct, first.memory_used_bytes) == (37, 40 * 2**30)
    assert first.memory_total_bytes == VRAM
    assert (first.temperature_mc, first.power_mw) == (45_000, 150_000)
    assert (second.ecc_uncorrected, second.xid_errors) == (2, ())


def test_init_failure_and_no_devices_are_unavailable(install: Callable[[AmdBox], ModuleType]) -> None:
    box = mi300x_pair()
    smi = install(box)
    box.init_error = smi.amdsmi_wrapper.AMDSMI_STATUS_DRIVER_NOT_LOADED
    with pytest.raises(BackendUnavailableError, match="amdgpu driver"):
        AmdBackend(host=HOST)
    box.init_error = None
    box.gpus = []
    with pytest.raises(BackendUnavailableError, match="no AMD GPU"):
        AmdBackend(host=HOST)


def test_library_errors_become_hardware_errors(install: Callable[[AmdBox], ModuleType]) -> None:
    smi = install(mi300x_pair())
    backend = AmdBackend(host=HOST)
    smi.amdsmi_get_gpu_memory_usage.side_effect = smi.AmdSmiLibraryException(
        smi.amdsmi_wrapper.AMDSMI_STATUS_NOT_FOUND)
    with pytest.raises(HardwareError, match="amd-smi list") as info:
        backend.sample()
    assert isinstance(info.value.__cause__, smi.AmdSmiException)


def test_missing_rocm_library_is_unavailable_and_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    if "amdsmi" in sys.modules:
        pytest.skip("amdsmi is importable here")
    with pytest.raises(BackendUnavailableError, match="amd-smi-lib"):
        import_amdsmi()
    assert capsys.readouterr().out == ""  # amdsmi prints its complaint; it must not reach stdout


@pytest.mark.parametrize(("name", "model"), [("AMD Instinct MI300X", "MI300X"), ("MI250X", "MI250X"),
                                             ("AMD Instinct MI325X", "AMD Instinct MI325X"), ("T4", "T4")])
def test_market_names_map_to_catalog(name: str, model: str) -> None:
    assert amd_catalog_model_name(name) == model


# ---- compute / memory partitions ----------------------------------------------------------------


def mi300x_cpx() -> AmdBox:
    """One MI300X in CPX + NPS4: AMD SMI lists 8 logical devices, PCI functions .0–.7 of one card,
    each with 1/8 of the VRAM; plus one MI300X in SPX (whole)."""
    part = VRAM // 8
    gpus = [Gpu(f"c0ff74a1-0000-1000-80a2-d1b2c3e4f5{k:02d}", f"0000:0c:00.{k}", 0, vram=part,
                compute_partition="CPX", memory_partition="NPS4") for k in range(8)]
    gpus.append(Gpu("d1ff74a1-0000-1000-80a2-d1b2c3e4f599", "0000:22:00.0", 1))
    return AmdBox(gpus=gpus)


def test_partition_fakes_match_the_real_signatures(real_amdsmi: ModuleType,
                                                   install: Callable[[AmdBox], ModuleType]) -> None:
    import inspect

    names = ("amdsmi_get_gpu_compute_partition", "amdsmi_get_gpu_memory_partition")
    real = {name: inspect.signature(getattr(real_amdsmi, name)) for name in names}
    smi = install(mi300x_cpx())
    assert {name: inspect.signature(getattr(smi, name)) for name in names} == real
    with pytest.raises(TypeError):
        smi.amdsmi_get_gpu_compute_partition()


def test_cpx_partitions_are_isolated_slices_of_their_card(install: Callable[[AmdBox], ModuleType]) -> None:
    box = mi300x_cpx()
    install(box)
    backend = AmdBackend(host=HOST)
    (node,) = backend.discover()
    parts, whole = node.devices[:8], node.devices[8]
    assert [d.index for d in parts] == list(range(8))
    assert {d.parent for d in parts} == {"mi-1/0000:0c:00"}
    assert {(d.profile, d.compute_milli, d.memory_bytes) for d in parts} == {("CPX", 125, VRAM // 8)}
    assert whole.parent is None and whole.profile is None and whole.compute_milli == 1000
    assert backend.partition_modes == {"mi-1/0000:0c:00": ("CPX", "NPS4"), "mi-1/0000:22:00": ("SPX", "NPS1")}


def test_hard_fraction_lands_on_a_cpx_partition(install: Callable[[AmdBox], ModuleType]) -> None:
    from gpusched.hardware.envexport import devices_env
    from gpusched.model import FleetSnapshot
    from gpusched.placement import PendingTask, Policy, place
    from gpusched.request import GPURequest

    install(mi300x_cpx())
    snapshot = FleetSnapshot(tuple(AmdBackend(host=HOST).discover()))
    hard = GPURequest.build(gpus=0.1, memory="16GiB", profile="CPX")
    soft = GPURequest.build(gpus=0.1, memory="16GiB", isolation="soft")
    plan = place(no_quota([PendingTask("h", hard, 0.0), PendingTask("s", soft, 0.0)],
        snapshot, Policy(), now=0.0))
    (h,) = plan.assignment("h").shares  # type: ignore[union-attr]
    (s,) = plan.assignment("s").shares  # type: ignore[union-attr]
    assert snapshot.device(h.uuid).profile == "CPX" and h.milli == 1000
    assert snapshot.device(s.uuid).parent is None and s.milli == 100
    env = devices_env([h], snapshot)
    assert env["HIP_VISIBLE_DEVICES"] == str(h.index) and env["GPUSCHED_ISOLATION"] == "hard"


# ---- dynamic partitioning: the amdsmi provider ---------------------------------------------------


def test_every_amdsmi_name_the_partition_provider_uses_exists_and_is_faked(
    real_amdsmi: ModuleType,
) -> None:
    provider_source = SOURCE.with_name("mig_provider.py").read_text()
    used = set(re.findall(r"smi\.((?:amdsmi|AmdSmi)\w+)", provider_source))
    assert {"amdsmi_set_gpu_compute_partition", "AmdSmiComputePartitionType"} <= used
    assert [name for name in used if not hasattr(real_amdsmi, name)] == []
    functions = {name for name in used if name.startswith("amdsmi_")}
    assert functions <= set(fake_functions(real_amdsmi, mi300x_pair()))


def test_a_waiting_cpx_request_re_partitions_an_idle_spx_card(
    install: Callable[[AmdBox], ModuleType],
) -> None:
    from gpusched.capacity.mig_plan import plan_repartition
    from gpusched.hardware.mig_provider import AmdPartitionProvider
    from gpusched.model import FleetSnapshot
    from gpusched.placement import PendingTask, Policy, place
    from gpusched.request import GPURequest

    box = mi300x_pair()
    box.gpus[0].activity = 0
    smi = install(box)
    with pytest.raises(TypeError):  # an autospec of the real function: the mode is required
        smi.amdsmi_set_gpu_compute_partition(object())
    backend = AmdBackend(host=HOST)
    snapshot = FleetSnapshot(tuple(backend.discover()))
    request = GPURequest.build(gpus=0.1, memory="16GiB", profile="CPX")
    plan = place(no_quota([PendingTask("t", request, 0.0)], snapshot, Policy(), now=0.0))
    (rejection,) = plan.rejections
    assert not rejection.permanent
    card = box.gpus[0].uuid
    assert rejection.reason.startswith(f"waiting for a compute re-partition of {card} (MI300X on mi-1)")
    assert "GPUSCHED_DYNAMIC_MIG=amdsmi" in rejection.reason
    assert "--compute-partition CPX" in rejection.reason
    assert plan_repartition(snapshot, [request]) == ()  # the MIG planner leaves AMD cards alone
    (step,) = plan_repartition(snapshot, [request], "compute-partition")
    assert step.gpu == box.gpus[0].uuid and step.layout == ("CPX",) * 8
    result = AmdPartitionProvider(smi).apply([step])
    assert result.applied == (step.gpu,) and result.failed == ()
    assert result.detail == (f"{step.gpu}: compute partition SPX → CPX",)
    backend.discover()
    assert backend.partition_modes["mi-1/0000:0c:00"][0] == "CPX"


def test_the_partition_provider_reports_a_busy_card_and_never_touches_a_held_one(
    install: Callable[[AmdBox], ModuleType],
) -> None:
    from gpusched.hardware.mig_provider import AmdPartitionProvider
    from gpusched.model import MigStep

    box = mi300x_pair()  # card 0 runs a process (activity 37): the driver says busy
    smi = install(box)
    busy, idle = (MigStep(g.uuid, "mi-1", "MI300X", ("CPX",) * 8, "test") for g in box.gpus)
    result = AmdPartitionProvider(smi).apply([busy, idle], held={idle.gpu})
    assert result.applied == () and result.failed == (busy.gpu,)
    assert "AMDSMI_STATUS_BUSY" in result.detail[0]
    assert "amd-smi set --gpu <gpu> --compute-partition CPX" in result.detail[0]
    assert "held by a task" in result.detail[1]
    assert [g.compute_partition for g in box.gpus] == ["SPX", "SPX"]
