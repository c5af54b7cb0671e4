"""Quotas: capacity partitions (training / burst / dev, 70/20/10 by default) and tenant budgets.

Pure functions over immutable records; integer arithmetic throughout.

- **Partitions** split the fleet's in-service capacity (milli-GPU). A partition may always use its
  own share; beyond it, it may *borrow* idle capacity when borrowing is on and the fleet still
  keeps room for the other partitions' pending demand up to their own shares. Borrowed capacity
  is not preempted back; it returns when the borrowing tasks end.
- **Budgets** are per tenant and period, in A100-equivalent GPU-hours: a task's cost is
  Σ(share milli × the model's ``a100_equiv_milli`` / 1000) × seconds, counted in *normalised
  milli-GPU-seconds* (:data:`UNITS_PER_A100_HOUR` of them make one A100-GPU-hour).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpusched.catalog import Catalog, default_catalog
from gpusched.errors import ConfigurationError
from gpusched.model import MILLI, DeviceShare, FleetSnapshot, Health
from gpusched.request import GPURequest, Partition

__all__ = [
    "DEFAULT_SHARES",
    "OVER_BUDGET_ACTIONS",
    "UNITS_PER_A100_HOUR",
    "QuotaPolicy",
    "QuotaState",
    "QuotaVerdict",
    "check",
    "check_budget",
    "check_burst_reserve",
    "check_partition",
    "hours",
    "normalised_rate",
    "over_budget",
    "over_budget_mode",
    "partition_capacity",
    "physical_milli",
    "usable_gpus",
]

UNITS_PER_A100_HOUR = MILLI * 3600
"""Normalised milli-GPU-seconds in one A100-equivalent GPU-hour."""

DEFAULT_SHARES: Mapping[Partition, int] = MappingProxyType(
    {Partition.TRAINING: 70, Partition.BURST: 20, Partition.DEV: 10}
)


def hours(units: int) -> str:
    """``units`` of normalised milli-GPU-seconds as A100-GPU-hours, e.g. ``"12.5"`` (two
    significant digits below one hour: ``"0.25"``, ``"0.0083"``)."""
    value = units / UNITS_PER_A100_HOUR
    return f"{value:.1f}" if value == 0 or abs(value) >= 1 else f"{value:.2g}"


def _hours(name: str, value: Any) -> float:
    """A budget in GPU-hours from the quota file (fractions allowed), or a one-line error."""
    wrong = f"quota {name}: {value!r} is not a number of GPU-hours; write e.g. 500 or 0.5"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigurationError(wrong)
    try:
        return float(value)
    except ValueError:
        raise ConfigurationError(wrong) from None


@dataclass(frozen=True)
class QuotaPolicy:
    """Partition shares, borrowing and tenant budgets.

    Attributes:
        shares_pct: percent of capacity per partition (must sum to 100).
        borrowing: whether a partition may use idle capacity beyond its share.
        budgets_hours: A100-equivalent GPU-hours per period, per tenant.
        default_budget_hours: budget of tenants not listed (None = unlimited).
        period_s: length of a budget period in seconds.
        default_duration_s: duration charged for tasks that give no expected duration.
    """

    shares_pct: Mapping[Partition, int] = field(default_factory=lambda: dict(DEFAULT_SHARES))
    borrowing: bool = True
    budgets_hours: Mapping[str, float] = field(default_factory=dict)
    default_budget_hours: float | None = None
    period_s: int = 30 * 86400
    default_duration_s: int = 3600

    def __post_init__(self) -> None:
        shares = {Partition(p): int(v) for p, v in self.shares_pct.items()}
        if (
            set(shares) != set(Partition)
            or any(v < 0 for v in shares.values())
            or sum(shares.values()) != 100
        ):
            raise ConfigurationError(
                f"partition shares {dict(shares)} must give every partition "
                f"({', '.join(p.value for p in Partition)}) a non-negative percent summing to 100"
            )
        if any(v < 0 for v in self.budgets_hours.values()) or (
            self.default_budget_hours is not None and self.default_budget_hours < 0
        ):
            raise ConfigurationError("tenant budgets must be ≥ 0 GPU-hours; fix the quota configuration")
        if self.period_s <= 0 or self.default_duration_s <= 0:
            raise ConfigurationError("quota period_s and default_duration_s must be positive seconds")
        object.__setattr__(self, "shares_pct", MappingProxyType(shares))
        object.__setattr__(self, "budgets_hours", MappingProxyType(dict(self.budgets_hours)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuotaPolicy:
        """From a mapping such as ``{"shares": {"training": 70, ...}, "budgets": {"team": 500}}``."""
        known = {"shares", "borrowing", "budgets", "default_budget", "period_s", "default_duration_s"}
        unknown = set(data) - known
        if unknown:
            raise ConfigurationError(f"unknown quota setting(s) {sorted(unknown)}; accepted: {sorted(known)}")
        try:
            shares = {Partition(str(k)): int(v) for k, v in dict(data.get("shares", DEFAULT_SHARES)).items()}
        except ValueError as exc:
            raise ConfigurationError(
                f"quota shares: {exc}; partitions are {', '.join(p.value for p in Partition)}"
            ) from exc
        default, budgets = data.get("default_budget"), dict(data.get("budgets", {}))
        return cls(
            shares_pct=shares,
            borrowing=bool(data.get("borrowing", True)),
            budgets_hours={str(k): _hours(f"budgets.{k}", v) for k, v in budgets.items()},
            default_budget_hours=None if default is None else _hours("default_budget", default),
            period_s=int(data.get("period_s", 30 * 86400)),
            default_duration_s=int(data.get("default_duration_s", 3600)),
        )

    def budget(self, tenant: str) -> int | None:
        """The tenant's budget in normalised milli-GPU-seconds (None = unlimited)."""
        value = self.budgets_hours.get(tenant, self.default_budget_hours)
        return None if value is None else round(value * UNITS_PER_A100_HOUR)

    def share_milli(self, partition: Partition, capacity_milli: int) -> int:
        """The partition's guaranteed share of ``capacity_milli``."""
        return capacity_milli * self.shares_pct[partition] // 100


@dataclass(frozen=True)
class QuotaState:
    """Budget use so far in the current period (normalised milli-GPU-seconds per tenant).

    ``enforced`` False (:meth:`unlimited`, no quota file configured): placement applies neither
    budgets nor partitions (nor the burst reserve). Build one from the ledger with
    :func:`gpusched.quota.usage.quota_state`. ``burst_reserve_gpus``: GPUs kept free for the
    burst partition (the last forecast plan's, while it holds; :func:`usable_gpus`).
    """

    policy: QuotaPolicy = field(default_factory=QuotaPolicy)
    used: Mapping[str, int] = field(default_factory=dict)
    period_start: float = 0.0
    enforced: bool = True
    burst_reserve_gpus: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "used", MappingProxyType(dict(self.used)))

    @classmethod
    def unlimited(cls) -> QuotaState:
        """No quota configured: every tenant and partition unlimited."""
        return cls(enforced=False)

    def resets(self) -> str:
        """When the current period ends, e.g. ``"Monday 2026-12-07 00:00 UTC"``."""
        from datetime import UTC, datetime

        end = datetime.fromtimestamp(self.period_start + self.policy.period_s, UTC)
        return end.strftime("%A %Y-%m-%d %H:%M UTC")

    def period_name(self) -> str:
        """``"this week"`` / ``"today"`` / ``"this period"``."""
        return {7 * 86400: "this week", 86400: "today"}.get(self.policy.period_s, "this period")


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    """The answer of a quota check: allowed or not, why, and how much capacity is borrowed."""

    allowed: bool
    reason: str = ""
    borrowed_milli: int = 0
    permanent: bool = False


_OK = QuotaVerdict(True)


def normalised_rate(
    shares: Sequence[DeviceShare], snapshot: FleetSnapshot, catalog: Catalog | None = None
) -> int:
    """A100-equivalent milli-GPU of ``shares`` (cost per second)."""
    cat = catalog or default_catalog()
    total = 0
    for share in shares:
        # A device gone from the inventory (or an unknown model) counts as one A100.
        device = snapshot.device(share.uuid) if snapshot.has_device(share.uuid) else None
        model = cat.find(device.model) if device is not None else None
        equiv = model.a100_equiv_milli if model is not None else MILLI
        # A slice (MIG instance, AMD partition) costs its share of the physical device.
        part = device.compute_milli if device is not None else MILLI
        total += share.milli * equiv * part // (MILLI * MILLI)
    return total


def physical_milli(shares: Sequence[DeviceShare], snapshot: FleetSnapshot) -> int:
    """Milli-GPU of physical devices ``shares`` take: a whole slice counts as its compute share."""
    total = 0
    for share in shares:
        part = snapshot.device(share.uuid).compute_milli if snapshot.has_device(share.uuid) else MILLI
        total += share.milli * part // MILLI
    return total


def partition_capacity(snapshot: FleetSnapshot) -> int:
    """In-service capacity in milli-GPU: devices not unhealthy, not cordoned, not on standby nodes
    (those of the snapshot's :attr:`~gpusched.model.FleetSnapshot.closed` nodes count: they take
    no new work this cycle for a reason that is not capacity)."""

    # Slices count by their share of the physical device; a MIG-enabled GPU through its slices.
    return sum(
        d.compute_milli
        for node in snapshot.nodes
        if not node.standby and not node.cordoned
        for d in node.devices
        if d.takes_work and not d.cordoned and d.health is not Health.UNHEALTHY
    )


def usable_gpus(free_gpus: int, reserve_gpus: int, *, partition: Partition | str) -> int:
    """The burst reserve: the free GPUs work of ``partition`` may take — all of them for burst
    work, those beyond the reserve for any other partition. The one rule of the executors'
    placement (:func:`check_burst_reserve`), the agent's scale-in and the pre-scaling simulation
    (:mod:`gpusched.capacity.standby_rules`). Any unit, as long as both counts are in it."""
    if Partition(partition) is Partition.BURST:
        return max(0, free_gpus)
    return max(0, free_gpus - max(0, reserve_gpus))


def check_burst_reserve(
    partition: Partition, need_milli: int, free_milli: int, reserve_gpus: int
) -> QuotaVerdict:
    """Whether work of ``partition`` may take ``need_milli`` of the ``free_milli`` in service
    while ``reserve_gpus`` are kept for burst work (:func:`usable_gpus`, in milli-GPU)."""
    usable = usable_gpus(free_milli, reserve_gpus * MILLI, partition=partition)
    if reserve_gpus <= 0 or need_milli <= usable:
        return _OK
    return QuotaVerdict(False, (
        f"the burst reserve keeps {reserve_gpus} GPU(s) free for burst work (the last forecast plan); "
        f"{Partition(partition).value!r} work may take {usable / MILLI:g} of the {free_milli / MILLI:g} "
        f"free GPU(s) and this task needs {need_milli / MILLI:g}"))


def check_budget(state: QuotaState, tenant: str, cost: int, *, committed: int = 0) -> QuotaVerdict:
    """Whether ``tenant`` may spend ``cost`` more units, given use so far plus ``committed``
    (expected remaining use of its running tasks)."""
    budget = state.policy.budget(tenant)
    if budget is None:
        return _OK
    spent = state.used.get(tenant, 0) + committed
    if spent + cost <= budget:
        return _OK
    permanent = cost > budget
    used = state.used.get(tenant, 0)
    reason = (
        f"tenant {tenant} used {hours(used)} of {hours(budget)} A100-h {state.period_name()}"
        + (f" (+{hours(committed)} committed by its running tasks)" if committed else "")
        + f"; this task needs ~{hours(cost)}"
    )
    reason += (
        "; it exceeds the whole budget — raise the budget or shorten the task"
        if permanent
        else f"; resets {state.resets()}"
    )
    return QuotaVerdict(False, reason, permanent=permanent)


OVER_BUDGET_ACTIONS = ("finish", "stop")
"""What happens to running work whose tenant crossed its hard budget (``[gpusched] over_budget``)."""


def over_budget_mode(value: str) -> str:
    """``value`` as an over-budget action (``finish`` or ``stop``, any case), else a clear error."""
    mode = str(value).strip().lower()
    if mode not in OVER_BUDGET_ACTIONS:
        raise ConfigurationError(f"[gpusched] over_budget = {mode!r} is not finish or stop; "
                                 "e.g. over_budget = finish")
    return mode


def over_budget(state: QuotaState, tenant: str) -> str | None:
    """Why ``tenant`` has crossed its hard budget this period (its running work is over), or None.

    The one rule for running work: the executors' periodic check (``gpusched.scheduler.quota``)
    and the simulator (:mod:`gpusched.sim.overbudget`) act on every running task of a tenant for
    which this answers (let it finish or stop it, per :data:`OVER_BUDGET_ACTIONS`)."""
    budget = state.policy.budget(tenant) if state.enforced else None
    used = state.used.get(tenant, 0)
    if budget is None or used < budget:
        return None
    return (f"tenant {tenant} used {hours(used)} of {hours(budget)} A100-h {state.period_name()}; "
            f"resets {state.resets()}")


def check_partition(
    policy: QuotaPolicy,
    partition: Partition,
    need_milli: int,
    used: Mapping[Partition, int],
    capacity_milli: int,
    pending: Mapping[Partition, int] | None = None,
) -> QuotaVerdict:
    """Whether ``partition`` may take ``need_milli`` more, given each partition's use and the
    other partitions' pending demand (protected up to their shares)."""
    own = used.get(partition, 0)
    share = policy.share_milli(partition, capacity_milli)
    if own + need_milli <= share:
        return _OK
    pct = policy.shares_pct[partition]
    head = (
        f"partition {partition.value!r} uses {own / MILLI:g} of its {pct}% share "
        f"({share / MILLI:g} of {capacity_milli / MILLI:g} GPUs); this task needs {need_milli / MILLI:g}"
    )
    if not policy.borrowing:
        return QuotaVerdict(False, head + "; borrowing is off")
    pending = pending or {}
    protected = 0
    for other in Partition:
        if other is not partition:
            room = max(0, policy.share_milli(other, capacity_milli) - used.get(other, 0))
            protected += min(room, max(0, pending.get(other, 0)))
    total_used = sum(used.values())
    if total_used + need_milli + protected <= capacity_milli:
        return QuotaVerdict(True, borrowed_milli=own + need_milli - max(share, own))
    return QuotaVerdict(
        False,
        head + f"; no idle capacity to borrow ({(capacity_milli - total_used) / MILLI:g} GPUs free, "
        f"{protected / MILLI:g} kept for other partitions' waiting tasks)",
    )


def check(
    request: GPURequest,
    state: QuotaState,
    *,
    cost: int,
    partition_used: Mapping[Partition, int],
    capacity_milli: int,
    pending_milli: Mapping[Partition, int] | None = None,
    committed: int = 0,
) -> QuotaVerdict:
    """Budget then partition check for one request (``cost`` from :func:`normalised_rate` ×
    seconds; the compute it takes is ``request.total_milli``)."""
    verdict = check_budget(state, request.tenant, cost, committed=committed)
    if not verdict.allowed:
        return verdict
    return check_partition(
        state.policy, request.partition, request.total_milli, partition_used, capacity_milli, pending_milli
    )
