"""Telemetry: sample the devices into the ledger and run the alert rules (the agent's cycle).

:func:`sample_once` reads every device once and stores the readings. :class:`TelemetryAgent`
is what ``gpusched agent`` runs each interval: sample → evaluate the alert rules over the recent
window (:mod:`gpusched.faults.alerts`) → apply the actions (:mod:`gpusched.faults.remediation`) → refresh the
Prometheus text (:mod:`gpusched.agent.prometheus`). The agent only judges the devices its own backend
sees, so one agent per GPU host can share one ledger.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpusched.agent.prometheus import TenantBudget, exposition, metric_families, scheduling_families
from gpusched.capacity.mig_plan import plan_repartition
from gpusched.capacity.scaling import react_to_waiting, release_idle, scale_in_after
from gpusched.errors import HardwareError, TelemetryError
from gpusched.faults.alerts import Action, ActionKind, AlertConfig, evaluate
from gpusched.faults.remediation import apply_actions
from gpusched.faults.stopping import TaskStopper
from gpusched.hardware.base import HardwareBackend
from gpusched.hardware.mig_provider import MigProvider, MigResult
from gpusched.ledger import Ledger
from gpusched.model import DeviceSample, FleetSnapshot
from gpusched.quota.file import load_quota_policy
from gpusched.quota.policy import UNITS_PER_A100_HOUR
from gpusched.quota.usage import period_start, spans_of, tenant_usage

__all__ = ["CycleResult", "TelemetryAgent", "sample_once"]

log = logging.getLogger(__name__)


class _FromEnv:
    """Default of a setting read from the environment when the agent starts."""


_FROM_ENV = _FromEnv()


def sample_once(backend: HardwareBackend, ledger: Ledger) -> list[DeviceSample]:
    """Read every device of ``backend`` once and store the readings in ``ledger``.

    Raises:
        TelemetryError: the backend failed to sample (the message names the backend).
    """
    try:
        samples = backend.sample()
    except HardwareError as exc:
        raise TelemetryError(
            f"sampling the {backend.name} backend failed: {exc}; check the driver / vendor library"
        ) from exc
    ledger.record_samples(samples)
    return samples


@dataclass(frozen=True, slots=True)
class CycleResult:
    """What one agent cycle saw and did."""

    at: float
    samples: tuple[DeviceSample, ...]
    actions: tuple[Action, ...]
    applied: tuple[str, ...]
    expired: tuple[str, ...] = ()


class TelemetryAgent:
    """The per-host agent: inventory sync, sampling, alerting, remediation and metrics text.

    Args:
        backend: the host's hardware backend (or the simulated fleet).
        ledger: the shared ledger (migrated).
        config: alert thresholds.
        window_s: how far back the alert rules look.
        stopper: stops a task for ``stop_task`` actions (None: record only).
        inventory_every_s: how often the inventory (and reported health) is re-synced.
        retention_s: samples older than this are pruned (hourly).
        scale_after_s: tasks waiting longer than this for capacity a standby node gives switch
            that node on (:func:`gpusched.capacity.scaling.react_to_waiting`); None: never.
        release_after_s: switched-on standby nodes idle this long go back to standby
            (:func:`gpusched.capacity.scaling.release_idle`); None: never. Default:
            ``$GPUSCHED_SCALE_IN_AFTER_S`` (1800 when unset; ``off`` = never).
        mig_provider: dynamic MIG (``GPUSCHED_DYNAMIC_MIG``; None = off, the default): each cycle,
            idle MIG-capable GPUs are re-partitioned for waiting hard-isolated requests
            (:func:`gpusched.capacity.mig_plan.plan_repartition`) and the inventory re-synced.
    """

    MIG_RETRY_S = 600.0
    """A GPU whose re-partition failed is not tried again before this many seconds."""

    def __init__(
        self,
        backend: HardwareBackend,
        ledger: Ledger,
        *,
        config: AlertConfig | None = None,
        window_s: float = 300.0,
        stopper: TaskStopper | None = None,
        inventory_every_s: float = 60.0,
        retention_s: float = 7 * 86400.0,
        scale_after_s: float | None = None,
        release_after_s: float | _FromEnv | None = _FROM_ENV,
        mig_provider: MigProvider | None = None,
    ) -> None:
        self.scale_after_s = scale_after_s
        self.release_after_s: float | None = (
            scale_in_after() if isinstance(release_after_s, _FromEnv) else release_after_s)
        self.backend = backend
        self.ledger = ledger
        self.config = config or AlertConfig()
        self.window_s = window_s
        self.stopper = stopper
        self.inventory_every_s = inventory_every_s
        self.retention_s = retention_s
        self.mig_provider = mig_provider
        self._mig_failed: dict[str, float] = {}  # GPU uuid -> when its re-partition last failed
        self._own_nodes: frozenset[str] | None = None  # nodes of the last inventory sync
        self.counters: Counter[tuple[str, str]] = Counter()
        self._synced_at = float("-inf")
        self._pruned_at = float("-inf")
        self._once: set[tuple[str, str, str]] = set()  # stop/notify already done: (kind, rule, target)
        self._families: list[Any] = []  # prometheus_client metric families of the last cycle
        self.source = str(getattr(backend, "description", backend.name))
        self.host = socket.gethostname()

    def sync_inventory(self, now: float | None = None) -> None:
        """Write the backend's nodes (with reported health) into the ledger."""
        at = time.time() if now is None else now
        nodes = self.backend.discover()
        self.ledger.sync_inventory(nodes, source=self.backend.name)
        self._own_nodes = frozenset(n.name for n in nodes)
        self._synced_at = at

    def cycle(self, now: float | None = None) -> CycleResult:
        """One round: expire leases, sample, evaluate, apply, refresh metrics. Returns what happened.

        Expiring leases here means a crashed executor's devices come back even while no executor
        runs at all.
        """
        at = time.time() if now is None else now
        expired = tuple(a.key for a in self.ledger.expire_leases(at))
        for key in expired:
            log.warning("gpusched agent: the lease of %s ran out; its devices are free again", key)
        if at - self._synced_at >= self.inventory_every_s:
            self.sync_inventory(at)
        scaled: list[str] = []
        if self.scale_after_s is not None:
            try:
                scaled = list(react_to_waiting(self.ledger, threshold_s=self.scale_after_s, now=at).reasons)
            except Exception as exc:  # a scaler failure must not stop sampling and alerting
                scaled = [f"reactive scale-out failed: {exc}"]
            if scaled:
                self.sync_inventory(at)  # activated nodes are usable at once
        if self.release_after_s is not None:
            try:
                released = list(release_idle(self.ledger, cool_down_s=self.release_after_s, now=at).reasons)
            except Exception as exc:  # a scaler failure must not stop sampling and alerting
                released = [f"scale-in failed: {exc}"]
            if released and not released[0].startswith("scale-in failed"):
                self.sync_inventory(at)  # released nodes take no more work
            scaled += released
        observe = getattr(self.backend, "observe_allocations", None)
        if observe is not None:  # the simulated fleet: devices held by tasks look busy
            observe(self.ledger.active())
        if self.mig_provider is not None:
            try:
                self.repartition(at)
            except Exception as exc:  # e.g. the ledger read failed: sampling and alerting go on
                log.warning("gpusched agent: dynamic MIG failed this cycle (%s); sampling goes on", exc)
        samples = sample_once(self.backend, self.ledger)
        own = {s.uuid for s in samples}
        window = [s for s in self.ledger.samples(None, at - self.window_s) if s.uuid in own]
        snapshot = self.ledger.snapshot(at)
        allocations = self.ledger.active()
        actions = self._fresh(evaluate(window, snapshot, allocations, config=self.config))
        applied = apply_actions(actions, self.ledger, self.stopper, now=at)
        for action in actions:
            self.counters[(action.rule, str(action.kind))] += 1
            log.warning("gpusched agent: %s %s on %s: %s", action.rule, action.kind, action.target,
                        action.reason)
        if at - self._pruned_at >= 3600:
            self.ledger.prune_samples(at - self.retention_s)
            self._pruned_at = at
        after = self.ledger.snapshot(at) if actions else snapshot
        self._families = metric_families(samples, after, self.ledger.active() if actions else allocations,
                                         counters=self.counters, source=self.source)
        self._families += self._scheduling_families(after, at)
        return CycleResult(at, tuple(samples), tuple(actions), tuple(scaled) + tuple(applied), expired)

    def _scheduling_families(self, snapshot: FleetSnapshot, at: float) -> list[Any]:
        """Queue waits and tenant budgets, read from the ledger (what the alert rules watch)."""
        waiting_since: dict[str, float] = {}
        for entry in self.ledger.queue():
            partition = str(entry.request.partition)
            waiting_since[partition] = min(entry.since, waiting_since.get(partition, entry.since))
        policy = load_quota_policy()
        start = period_start(at, policy.period_s)
        usage = tenant_usage(spans_of(self.ledger.history(start, at)), snapshot, start, at)
        budgets = []
        for tenant in sorted(set(usage) | set(policy.budgets_hours)):
            budget = policy.budget(tenant)
            budgets.append(TenantBudget(tenant, usage.get(tenant, 0) / UNITS_PER_A100_HOUR,
                                        None if budget is None else budget / UNITS_PER_A100_HOUR))
        return scheduling_families(waiting_since, budgets, at)

    def repartition(self, now: float) -> tuple[str, ...]:
        """Dynamic MIG: re-partition idle GPUs for waiting hard requests; the GPUs changed.

        Never raises: a provider failure is logged and recorded as a ``mig_repartition_failed``
        ledger event naming the GPU and the fix, and that GPU is not tried again for
        :attr:`MIG_RETRY_S` (nor one whose step the provider skipped, e.g. MIG mode off); the cycle
        goes on (sampling, alerts and metrics).
        """
        if self.mig_provider is None:
            return ()
        waiting = [entry.request for entry in self.ledger.queue()]
        snapshot = self.ledger.snapshot(now)
        held = {share.uuid for a in self.ledger.active() for share in a.shares}
        steps = [
            s
            for s in plan_repartition(snapshot, waiting, getattr(self.mig_provider, "partitioning", "mig"))
            # Every agent plans alike from the one ledger; each carries out its own host's steps.
            if (self._own_nodes is None or s.node in self._own_nodes)
            and now - self._mig_failed.get(s.gpu, float("-inf")) >= self.MIG_RETRY_S
            and s.gpu not in held
            and not any(d.uuid in held for d in snapshot.devices() if d.parent == s.gpu)
        ]
        if not steps:
            return ()
        provider = self.mig_provider.name
        try:
            result = self.mig_provider.apply(steps, held=frozenset(held))
        except Exception as exc:  # a provider failure must not stop sampling and alerting
            result = MigResult(provider, (), tuple(
                f"{s.gpu} on {s.node}: re-partitioning into {' + '.join(s.layout)} failed ({exc}); "
                "check the GPU's MIG instances (nvidia-smi mig -lgi) or set GPUSCHED_DYNAMIC_MIG=off"
                for s in steps), tuple(s.gpu for s in steps))
        layouts = {s.gpu: list(s.layout) for s in steps}
        for line in result.detail:
            log.warning("gpusched agent: dynamic MIG (%s): %s", result.provider, line)
        for gpu in result.failed:
            self._mig_failed[gpu] = now
            line = next((d for d in result.detail if d.startswith(gpu)), f"{gpu}: re-partitioning failed")
            self.ledger.record_event("mig_repartition_failed", gpu, now=now, provider=result.provider,
                                     layout=layouts.get(gpu, []), detail=line)
        for step in steps:  # a step skipped (e.g. MIG mode off) waits like a failed one
            if step.gpu not in result.applied and step.gpu not in result.failed:
                self._mig_failed[step.gpu] = now
        for gpu in result.applied:
            self._mig_failed.pop(gpu, None)
            self.ledger.record_event("mig_repartition", gpu, now=now, provider=result.provider,
                                     layout=layouts.get(gpu, []))
        if result.applied:
            self.sync_inventory(now)
        return result.applied

    def _fresh(self, actions: Sequence[Action]) -> list[Action]:
        # Health and cordon actions are already skipped once in effect (the rules see the
        # snapshot); stop/notify have no such state, so each is done once per agent.
        fresh = []
        for action in actions:
            if action.kind in (ActionKind.STOP_TASK, ActionKind.NOTIFY):
                mark = (str(action.kind), action.rule, action.target)
                if mark in self._once:
                    continue
                self._once.add(mark)
            fresh.append(action)
        return fresh

    def metric_families(self) -> list[Any]:
        """The metric families of the last cycle (what ``/metrics`` serves; no I/O here)."""
        return list(self._families)

    def metrics_text(self) -> str:
        """The Prometheus text of the last cycle."""
        return exposition(self.metric_families)
