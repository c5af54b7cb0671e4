"""The JSON the fleet API serves, computed from immutable records (pure: no DB, no web framework).

:mod:`gpusched.airflow.api` reads the ledger and hands the records here. Every function returns
plain JSON-safe dicts/lists so it can be tested, cached or printed without FastAPI.

Device states (the colours of the UI): ``faulty`` (unhealthy), ``cordoned`` (device or node),
``standby`` (node not in service), ``allocated`` (whole device taken), ``shared`` (a fraction
taken), ``free``. ``degraded`` is a flag on top of the state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gpusched.model import MILLI, Device, DeviceSample, FleetSnapshot, Health, Node, gpu_cards
from gpusched.quota import usage as quota_usage
from gpusched.quota.policy import UNITS_PER_A100_HOUR, QuotaPolicy, partition_capacity
from gpusched.request import Partition
from gpusched.scheduler.keys import parse_ti_key

if TYPE_CHECKING:  # the records only annotate; the plugin loads this module without the ledger
    from gpusched.ledger import Allocation, QueueEntry

__all__ = [
    "DEVICE_STATES",
    "allocations_view",
    "device_state",
    "fleet_view",
    "period_start",
    "preemptions_view",
    "queue_view",
    "quotas_view",
    "tenant_usage",
    "unschedulable_view",
]

GIB = 1024**3

DEVICE_STATES = ("allocated", "shared", "free", "faulty", "cordoned", "standby")
"""Every state :func:`device_state` returns (the UI legend, in this order)."""


def device_state(device: Device, node: Node, used_milli: int) -> str:
    """The one state a device is shown in (faults and cordons win over usage)."""
    if device.health is Health.UNHEALTHY:
        return "faulty"
    if device.cordoned or node.cordoned:
        return "cordoned"
    if node.standby:
        return "standby"
    if used_milli >= MILLI:
        return "allocated"
    if used_milli > 0:
        return "shared"
    return "free"


def _gib(n: int) -> float:
    return round(n / GIB, 1)


def _holders(allocations: Iterable[Allocation]) -> dict[str, list[dict[str, Any]]]:
    holders: dict[str, list[dict[str, Any]]] = {}
    for alloc in allocations:
        for share in alloc.shares:
            holders.setdefault(share.uuid, []).append(
                {"key": alloc.key, "milli": share.milli, "tenant": alloc.request.tenant}
            )
    return holders


def fleet_view(
    snapshot: FleetSnapshot,
    allocations: Sequence[Allocation] = (),
    samples: Sequence[DeviceSample] = (),
) -> dict[str, Any]:
    """The fleet as racks → nodes → islands → devices, with state, usage, holders and telemetry.

    ``samples``: recent telemetry; the newest sample of each device is attached.
    """
    holders = _holders(allocations)
    latest: dict[str, DeviceSample] = {}
    for sample in samples:
        if sample.uuid not in latest or sample.taken_at > latest[sample.uuid].taken_at:
            latest[sample.uuid] = sample
    counts = dict.fromkeys(DEVICE_STATES, 0)
    racks: dict[str, list[dict[str, Any]]] = {}
    used_milli = 0
    for node in snapshot.nodes:
        islands: dict[str, list[dict[str, Any]]] = {}
        slices_of: dict[str, list[Device]] = {}
        for device in node.devices:
            if device.parent is not None:
                slices_of.setdefault(device.parent, []).append(device)
        cards = [_card(parent, parts) for parent, parts in slices_of.items()
                 if not snapshot.has_device(parent)]
        for device in sorted([*(d for d in node.devices if d.parent is None), *cards], key=lambda d: d.index):
            slices = slices_of.get(device.uuid, [])
            entry = _device_entry(snapshot, node, device, holders, latest)
            if slices:  # a MIG GPU or a partitioned AMD card: its slices are drawn inside its tile
                entry["slices"] = [_device_entry(snapshot, node, s, holders, latest, parent=device)
                                   for s in sorted(slices, key=lambda d: (d.index, d.uuid))]
                entry["partitioned"] = "MIG" if device.mig_enabled else str(slices[0].profile)
                taken = [e for e in entry["slices"] if e["used_milli"]]
                physical = sum(e["used_milli"] * e["compute_milli"] // MILLI for e in entry["slices"])
                entry["used_milli"] = physical
                if entry["state"] in ("free", "shared", "allocated"):
                    full = len(taken) == len(entry["slices"])
                    entry["state"] = "allocated" if full else "shared" if taken else "free"
            counts[entry["state"]] += 1
            used_milli += entry["used_milli"]
            islands.setdefault(device.island or "pcie", []).append(entry)
        racks.setdefault(node.rack, []).append({
            "name": node.name,
            "rack": node.rack,
            "labels": dict(node.labels),
            "standby": node.standby,
            "cordoned": node.cordoned,
            "islands": [{"id": k, "devices": v} for k, v in islands.items()],
        })
    total = sum(counts.values())
    in_service = counts["allocated"] + counts["shared"] + counts["free"]
    return {
        "source": snapshot.source,
        "simulated": "simulated" in snapshot.source.lower(),
        "taken_at": snapshot.taken_at,
        "summary": {
            "devices": total,  # physical GPUs: a GPU cut into slices is one tile (gpu_cards)
            "slices": gpu_cards(snapshot.devices())[1],
            "nodes": len(snapshot.nodes),
            "states": counts,
            "in_service": in_service,
            "used_gpus": round(used_milli / MILLI, 2),
            # of the devices in service (faulty, cordoned and standby ones cannot be used)
            "utilisation_pct": round(100 * used_milli / (in_service * MILLI), 1) if in_service else 0.0,
        },
        "racks": [{"name": name, "nodes": nodes} for name, nodes in sorted(racks.items())],
    }


def _card(card_id: str, parts: Sequence[Device]) -> Device:
    """A tile for a partitioned AMD card, which has no device of its own (its partitions do)."""
    first = min(parts, key=lambda d: d.index)
    order = (Health.HEALTHY, Health.DEGRADED, Health.UNHEALTHY)
    worst = max((d.health for d in parts), key=order.index)
    return replace(first, uuid=card_id, memory_bytes=sum(d.memory_bytes for d in parts), health=worst,
                   parent=None, profile=None, compute_milli=MILLI)


def _device_entry(
    snapshot: FleetSnapshot,
    node: Node,
    device: Device,
    holders: dict[str, list[dict[str, Any]]],
    latest: dict[str, DeviceSample],
    parent: Device | None = None,
) -> dict[str, Any]:
    """One tile (or slice) of the fleet picture."""
    used = snapshot.used(device.uuid)
    state = device_state(device, node, used.used_milli)
    if parent is not None and state in ("free", "shared", "allocated"):
        state = device_state(parent, node, used.used_milli)  # a slice shares its GPU's faults
    entry: dict[str, Any] = {
        "uuid": device.uuid,
        "index": device.index,
        "model": device.model,
        "vendor": device.vendor.value,
        "architecture": device.architecture,
        "memory_gib": _gib(device.memory_bytes),
        "used_milli": used.used_milli,
        "used_memory_gib": _gib(used.used_memory_bytes),
        "state": state,
        "health": device.health.value,
        "degraded": device.health is Health.DEGRADED,
        "numa_node": device.numa_node,
        "link": device.link.value,
        "holders": holders.get(device.uuid, []),
        "profile": device.profile,
        "compute_milli": device.compute_milli,
    }
    newest = latest.get(device.uuid)
    if newest is not None:
        entry["telemetry"] = {
            "taken_at": newest.taken_at,
            "utilization_pct": newest.utilization_pct,
            "temperature_c": round(newest.temperature_mc / 1000, 1),
            "power_w": round(newest.power_mw / 1000, 1),
            "memory_used_gib": _gib(newest.memory_used_bytes),
        }
    return entry


def allocations_view(allocations: Sequence[Allocation], now: float) -> list[dict[str, Any]]:
    """Active allocations, oldest first, with a request summary and the lease's time left."""
    rows = []
    for alloc in sorted(allocations, key=lambda a: a.created_at):
        row = alloc.to_dict()
        row["summary"] = alloc.request.describe(owner=True)
        row["running_s"] = max(0.0, round(now - alloc.created_at, 1))
        row["lease_left_s"] = round(alloc.lease_expires_at - now, 1)
        row["nodes"] = sorted({s.node for s in alloc.shares})
        rows.append(row)
    return rows


def task_link(key: str) -> dict[str, Any] | None:
    """The Airflow task instance a ledger key names, with its page in the Airflow UI (a path
    under the UI's root), or None for keys that are not Airflow task tries."""
    parts = parse_ti_key(key)
    if parts is None:
        return None
    path = "/dags/{}/runs/{}/tasks/{}".format(*(quote(x, safe="") for x in
                                                (parts.dag_id, parts.run_id, parts.task_id)))
    if parts.map_index >= 0:
        path += f"/mapped/{parts.map_index}"
    label = f"{parts.dag_id} › {parts.task_id}" + (f" [{parts.map_index}]" if parts.map_index >= 0 else "")
    return {"dag_id": parts.dag_id, "task_id": parts.task_id, "run_id": parts.run_id,
            "try_number": parts.try_number, "map_index": parts.map_index,
            "label": f"{label} (run {parts.run_id}, try {parts.try_number})", "url": path}


def queue_view(entries: Sequence[QueueEntry], now: float) -> list[dict[str, Any]]:
    """Waiting tasks, longest-waiting first, each with the placement's reason and, for Airflow
    tasks, a link to the task instance (``task``)."""
    return [
        {
            "key": e.key,
            "task": task_link(e.key),
            "summary": e.request.describe(owner=True),
            "request": e.request.to_dict(),
            "priority": e.request.priority,
            "reason": e.reason,
            "since": e.since,
            "waiting_s": max(0.0, round(now - e.since, 1)),
        }
        for e in sorted(entries, key=lambda e: (e.since, e.key))
    ]


def preemptions_view(events: Sequence[Any]) -> list[dict[str, Any]]:
    """Recent ``preempted`` and ``migrated`` ledger events, newest first, as the *Preemptions*
    table shows them: ``kind`` ``preemption`` (the victim with its task link, for whom, the work
    it lost since its last checkpoint, why) or ``move`` (the moved try, from which model and
    devices to which, its next try, the gain, why)."""
    rows: list[dict[str, Any]] = []
    for e in events:
        detail = e.detail
        row: dict[str, Any] = {"at": e.at, "key": e.subject, "task": task_link(e.subject),
                               "reason": detail.get("reason"), "grace_s": detail.get("grace_s")}
        if e.kind == "preempted":
            by = str(detail.get("by") or "")
            row.update(kind="preemption", by=detail.get("by"), by_task=task_link(by),
                       lost_gpu_s=detail.get("lost_gpu_s"))
        elif e.kind == "migrated":
            source = _where(detail.get("from_model"), detail.get("from_devices"))
            target = _where(detail.get("to_model"), detail.get("devices"))
            next_try = str(detail.get("next_try") or "")
            row.update(kind="move", by=None, by_task=None, lost_gpu_s=None, source=source, target=target,
                       move=f"{source} -> {target}", next_try=next_try or None,
                       next_task=task_link(next_try), gain_gpu_s=detail.get("gain_gpu_s"))
        else:
            continue
        rows.append(row)
    return rows


def unschedulable_view(events: Sequence[Any]) -> list[dict[str, Any]]:
    """Recent ``unschedulable`` ledger events, newest first: the tries the executor failed without
    starting them (a request that can never fit this fleet, an invalid request, a retry the fault
    chain refused), each with its task link and the executor's one-line reason."""
    return [{"at": e.at, "key": e.subject, "task": task_link(e.subject), "reason": e.detail.get("reason")}
            for e in events if e.kind == "unschedulable"]


def _where(model: Any, devices: Any) -> str:
    """``model (node:index, …)`` of one side of a move (the devices when the event has them)."""
    place = ", ".join(str(d) for d in devices) if isinstance(devices, list) and devices else ""
    return f"{model or '?'} ({place})" if place else str(model or "?")


def tenant_usage(
    history: Iterable[Allocation],
    snapshot: FleetSnapshot,
    period_start: float,
    now: float,
) -> dict[str, int]:
    """Normalised usage (A100-equivalent milli-GPU-seconds) per tenant since ``period_start``
    (:func:`gpusched.quota.usage.tenant_usage` over the allocations)."""
    return quota_usage.tenant_usage(quota_usage.spans_of(history), snapshot, period_start, now)


def quotas_view(
    snapshot: FleetSnapshot,
    active: Sequence[Allocation],
    queued: Sequence[QueueEntry],
    policy: QuotaPolicy,
    usage: Mapping[str, int],
    period_start: float,
) -> dict[str, Any]:
    """Partitions (share, capacity, use, borrowing, waiting demand) and tenant budgets."""
    capacity = partition_capacity(snapshot)
    used = dict.fromkeys(Partition, 0)
    for alloc in active:
        used[alloc.request.partition] += alloc.total_milli
    pending = dict.fromkeys(Partition, 0)
    for entry in queued:
        pending[entry.request.partition] += entry.request.total_milli
    partitions = []
    for p in Partition:
        share = policy.share_milli(p, capacity)
        partitions.append({
            "partition": p.value,
            "share_pct": policy.shares_pct[p],
            "share_gpus": share / MILLI,
            "used_gpus": used[p] / MILLI,
            "borrowed_gpus": max(0, used[p] - share) / MILLI,
            "pending_gpus": pending[p] / MILLI,
            "used_pct_of_share": round(100 * used[p] / share, 1) if share else None,
        })
    tenants: set[str] = set(usage) | set(policy.budgets_hours)
    tenants |= {a.request.tenant for a in active}
    rows = []
    for tenant in sorted(tenants):
        budget = policy.budget(tenant)
        spent = usage.get(tenant, 0)
        rows.append({
            "tenant": tenant,
            "used_hours": round(spent / UNITS_PER_A100_HOUR, 2),
            "budget_hours": None if budget is None else budget / UNITS_PER_A100_HOUR,
            "used_pct": None if not budget else round(100 * spent / budget, 1),
            "running_gpus": sum(a.total_milli for a in active if a.request.tenant == tenant) / MILLI,
        })
    return {
        "capacity_gpus": capacity / MILLI,
        "borrowing": policy.borrowing,
        "period_start": period_start,
        "period_s": policy.period_s,
        "unit": "A100-equivalent GPU-hours",
        "partitions": partitions,
        "tenants": rows,
    }


def period_start(now: float, period_s: int) -> float:
    """Start of the budget period holding ``now`` (:func:`gpusched.quota.usage.period_start`)."""
    return quota_usage.period_start(now, period_s)
