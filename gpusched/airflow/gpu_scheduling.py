"""The GPU half of gpusched's executors: placement, holds, allocations, leases, release, hosts.

One implementation serves :class:`gpusched.airflow.executor.GPUExecutor` (LocalExecutor) and
:class:`gpusched.airflow.celery_executor.GPUCeleryExecutor` (CeleryExecutor). The executor owns
Airflow's bookkeeping and hands its GPU workloads here; :class:`GPUScheduling` builds one
:class:`~gpusched.scheduler.cycle.CycleRequest` per cycle (:mod:`gpusched.airflow.gpu_inputs`:
fault-chain overrides applied, durations predicted where none was given, attained service), calls
:func:`~gpusched.scheduler.cycle.decide`, writes each launch's allocation to the ledger and
gives the launch to the executor's :class:`Dispatcher` (a local worker with the devices'
environment, or the Celery queue of the host that owns them).

Also here: release when a task process ends or is revoked, leases, reconcile after a restart, lost
GPU hosts (:mod:`.gpu_faults`), preemption (:mod:`.gpu_preemption`), migration (:mod:`.gpu_migration`).

When the dispatcher cannot reach its workers (:class:`~gpusched.errors.DispatchUnavailableError`:
the Celery broker is down), the launch is undone — the devices it allocated are released, the
workload stays queued, nothing is failed, no retry is spent — and GPU dispatch pauses, with one
log line, until :meth:`Dispatcher.available` says the workers can be reached again (asked every
:attr:`GPUScheduling.dispatch_probe_s` seconds), exactly as an unreachable ledger pauses GPU work
(:class:`~gpusched.airflow.ledger_guard.LedgerGuard`). Releasing rather than holding the devices:
nothing ran on them, and the next cycle places the task afresh on the fleet as it is then.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from gpusched import settings
from gpusched.airflow import gpu_faults, gpu_inputs, gpu_over_budget
from gpusched.airflow.authoring import is_gpu_task, request_from_executor_config
from gpusched.airflow.executor_compat import fail_unstarted, save_task_event
from gpusched.airflow.gpu_migration import Migrator, throughput_table
from gpusched.airflow.gpu_preemption import Preemptor
from gpusched.airflow.ledger_guard import LedgerGuard
from gpusched.airflow.orphans import reconcile_holder, task_state
from gpusched.airflow.scheduler_metrics import SchedulerMetrics
from gpusched.airflow.task_log import append_task_log
from gpusched.errors import (
    AllocationConflictError,
    DispatchUnavailableError,
    LedgerUnavailableError,
    UnknownAllocationError,
)
from gpusched.gang import gang_member
from gpusched.ledger.liveness import current_process
from gpusched.placement import Policy
from gpusched.placement.genetic import parse_weights
from gpusched.placement.warm import WarmPlacement
from gpusched.placement.workload import SteadyWorkload
from gpusched.request import GPURequest
from gpusched.scheduler.attained import AttainedService
from gpusched.scheduler.cycle import (
    CycleReply,
    CycleRequest,
    Hold,
    Launch,
    PendingWork,
    RunningTasks,
    decide,
    quota_admitted,
)
from gpusched.scheduler.durations import DurationHistory
from gpusched.scheduler.keys import ti_key_of
from gpusched.scheduler.ledger_store import LedgerStore
from gpusched.scheduler.quota import over_budget_action

if TYPE_CHECKING:
    from airflow.executors.base_executor import BaseExecutor
    from airflow.executors.workloads import ExecuteTask
    from airflow.models.taskinstancekey import TaskInstanceKey

    from gpusched.durations.predictor import Prediction
    from gpusched.placement.types import RunningTask
    from gpusched.records import Allocation

__all__ = ["Dispatcher", "GPUScheduling"]

_NOT_FINISHED = frozenset({"running", "queued", "scheduled", "restarting", "deferred"})


class Dispatcher(Protocol):
    """How one executor starts a task on its devices (the only part that differs per executor)."""

    def refuse(self, launch: Launch, *, prefetch: bool = False) -> str | None:
        """Why ``launch`` cannot be dispatched by this executor now (it is held), or None;
        ``prefetch``: it may use the room :meth:`prefetch_nodes` gave beyond a host's slots."""
        ...

    def dispatch(self, workload: ExecuteTask, launch: Launch) -> None:
        """Send ``workload`` (fresh token) to run on ``launch.shares`` with ``launch.env``.

        Raises:
            DispatchUnavailableError: the workers cannot be reached; nothing was sent and
                ``workload`` is still queued in the executor.
        """
        ...

    def available(self) -> bool:
        """Whether the workers can be reached now (asked while dispatch is paused)."""
        ...

    def full_nodes(self, active: Sequence[Allocation]) -> dict[str, str]:
        """Nodes whose workers have no free slot now (node -> why), given the cycle's ``active``
        allocations; they take no new task this cycle."""
        ...

    def prefetch_nodes(self, running: Sequence[RunningTask], now: float) -> frozenset[str]:
        """Nodes of hosts without a free slot whose workers may still be sent a task to wait for
        one (:func:`gpusched.scheduler.hosts.prefetch_room`, over those of ``running`` whose task
        process has started), after this cycle's launches so far; none when prefetch is off."""
        ...


class GPUScheduling:
    """GPU placement and allocation lifecycle for one executor (see the module docstring).

    ``executor`` is the Airflow executor composing this (its ``log``, ``queued_tasks``,
    ``jwt_generator`` and ``fail`` are used; event-log rows are written directly); ``dispatcher``
    starts launches. Settings: every ``[gpusched]`` option of :mod:`gpusched.settings` the executor
    uses, read from its team-scoped config (``policy``, leases, quotas, re-planning, hosts, preemption …).
    """

    dispatch_probe_s = 5.0
    """While dispatch is paused, how often the dispatcher is asked whether its workers answer."""

    def __init__(self, executor: BaseExecutor, dispatcher: Dispatcher, *, holder: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.executor = executor
        self.clock = clock  # every "now" of the GPU core (a test or a replay passes its own)
        self.dispatcher, self.holder = dispatcher, holder
        conf = executor.conf  # the executor's team-scoped config (BaseExecutor's ExecutorConf)
        self.conf, self.throughputs = conf, throughput_table(conf)  # job type -> model -> speed
        self.lease_s = settings.get_int("lease_seconds", conf)
        self.fail_unschedulable = settings.get_bool("fail_unschedulable", conf)
        self.use_uuids = settings.get_bool("visible_devices_by_uuid", conf)
        # Genetic re-planning of each cycle's batch (0 = greedy only), and its objective weights.
        self.replan_budget_ms = settings.get_float("replan_budget_ms", conf)
        self.replan_weights = parse_weights(settings.get_str("replan_weights", conf),
                                            where="[gpusched] replan_weights")
        self.host_timeout_s = settings.get_float("host_timeout_seconds", conf)
        self.ledger_wait_s = settings.get_float("ledger_wait_seconds", conf)
        self.reconcile_s = settings.get_float("reconcile_seconds", conf)
        self.durations = DurationHistory.from_settings(conf)  # run times learnt from history
        self.attained = AttainedService()  # GPU-time of earlier tries (preemption = service)
        self.predicted: dict[str, Prediction] = {}  # ledger key -> this cycle's prediction
        self.slot_notes: list[str] = []  # this cycle: hosts whose worker slots are all busy
        # The placement engine kept between cycles, and the request mix it scores by (kept until
        # it drifts past [gpusched] workload_drift, so the engine need not be rebuilt every cycle).
        self.warm = WarmPlacement()
        self.steady = SteadyWorkload(settings.get_float("workload_drift", conf))
        self.kept_running = RunningTasks()  # the ledger keeps unchanged allocations: convert each once
        # Running work over its tenant's hard budget: finish|stop, acted on once per allocation.
        self.over_budget, self.over_budget_seen = over_budget_action(conf), set[str]()
        self._guard = LedgerGuard(self.ledger_wait_s, lambda: self.log)
        self._safe = self._guard.run
        # Why GPU dispatch is paused (None: it is not), since when, and when to ask again.
        self.dispatch_down: str | None = None
        self._dispatch_down_since = self._dispatch_probe_at = 0.0
        # Places a dispatched try that never started again (GPUCeleryExecutor's dispatch watch).
        self.unstarted_hook: Callable[[TaskInstanceKey, str], bool] | None = None
        self.process: Any = None  # this executor as a HolderProcess (set by start_process)
        self._ledger: LedgerStore | None = None
        self._policy: Policy | None = None
        # Airflow key -> ledger key of dispatched GPU work (the executors' ``running`` is not enough).
        self.gpu_running: dict[TaskInstanceKey, str] = {}
        self.submitted: dict[TaskInstanceKey, float] = {}  # Airflow key -> when its workload began to wait
        self.seen: set[TaskInstanceKey] = set()  # Airflow keys of waiting workloads offered to a cycle
        self.cycle_requests: dict[str, GPURequest] = {}  # ledger key -> its author's request, this cycle
        self._queue_reason: dict[str, str] = {}
        self._last_renew = self._last_host_check = self._last_gang_check = self._last_reconcile = 0.0
        self.gangs: dict[str, set[TaskInstanceKey]] = {}  # launched multi-node gangs: gang id -> Airflow keys
        self.preemption = Preemptor(self)  # [gpusched] preemption: stops lower-priority work
        self.migration = Migrator(self, lease_s=self.lease_s)  # preemption = migrate: between GPU types
        self.metrics = SchedulerMetrics(clock)  # the scheduler's /metrics ([gpusched] metrics_port)

    @property
    def log(self) -> Any:
        return self.executor.log

    @property
    def ledger(self) -> LedgerStore:
        """The allocation ledger, as the scheduler's store (opened on first use)."""
        if self._ledger is None:
            self._ledger = LedgerStore(lock_wait_s=self.ledger_wait_s)
        return self._ledger

    @property
    def policy(self) -> Policy:
        """The placement policy: the profile ``[gpusched] policy`` names, changed by ``policy_parts``."""
        if self._policy is None:
            self._policy = Policy.configured(
                settings.get_str("policy", self.conf), settings.get_str("policy_parts", self.conf),
                throughput=self.throughputs,
            )
        return self._policy

    # ---- lifecycle -------------------------------------------------------------------------

    def start_process(self) -> None:
        """Record this process as the executor that holds the allocations it makes; a wrong
        ``[gpusched] policy`` or ``policy_parts`` stops the executor here with its one-line
        ConfigurationError (not once per cycle later)."""
        self.process = current_process("executor")
        _ = self.policy

    def reconcile(self) -> list[str]:
        """Release this holder's allocations that no live try needs, renew those still in use
        (:func:`gpusched.airflow.orphans.reconcile_holder`: superseded or finished tries and dead
        holder processes are released); return the released keys."""
        waiting = {ti_key_of(w.ti) for w in self.executor.queued_tasks.values() if is_gpu_task(w)}
        # Devices held for a moved task's next try (the moves in flight before a restart are read
        # back from the ledger first, so their holds are kept).
        waiting |= self.migration.held_keys()
        return reconcile_holder(self.ledger, self.holder, dispatched=set(self.gpu_running.values()),
                                waiting=waiting, lease_s=self.lease_s, log=self.log)

    def end(self, queued: Sequence[ExecuteTask], *, release_running: bool = True) -> None:
        """Forget the waiting records of ``queued`` workloads and, with ``release_running``,
        release what is still held (without it the allocations stay, leases running, for the
        executor that adopts the tasks; :meth:`reconcile` releases those that are gone)."""
        for key in list(self.gpu_running) if release_running else ():
            self.release(key, "executor stopped")
        for workload in queued:
            if is_gpu_task(workload):
                self._safe(lambda w=workload: self.ledger.clear_queue(ti_key_of(w.ti)))

    def queued(self, workload: ExecuteTask) -> None:
        """Remember when a GPU workload started to wait."""
        if is_gpu_task(workload):
            self.submitted.setdefault(workload.key, self.clock())

    def revoke(self, ti: Any) -> None:
        """Forget a task: drop it from the GPU queue and release its devices. Never raises."""
        key = ti.key
        self.executor.queued_tasks.pop(key, None)
        self.submitted.pop(key, None)
        self.seen.discard(key)
        ledger_key = ti_key_of(ti)
        self._queue_reason.pop(ledger_key, None)
        self._safe(lambda: self.ledger.clear_queue(ledger_key))
        if key in self.gpu_running:
            self.release(key, "revoked: stuck in queued")
        else:
            self._safe(lambda: self.ledger.release(ledger_key, reason="revoked: stuck in queued",
                                                  now=self.clock()))

    def finished(self, key: TaskInstanceKey, state: Any) -> None:
        """The executor learnt ``state`` for ``key``: release its devices once the process ended."""
        if key in self.gpu_running and str(state) not in _NOT_FINISHED:
            # The executor's state only says the process ended; the reason names the task's own
            # outcome (a SIGKILLed task ends "success" here but "failed" in Airflow).
            outcome = self._safe(lambda: task_state(key)) or f"executor state {state}"
            reason = (self.preemption.release_reason(self.gpu_running[key])
                      or f"task process ended (task {outcome})")
            if not self._safe(lambda: gpu_faults.quarantine_if_unconfirmed(self, key, reason)):
                self.release(key, reason, succeeded=outcome == "success")

    # ---- one cycle ---------------------------------------------------------------------------

    def schedule(self, workloads: Sequence[ExecuteTask]) -> None:
        """Place ``workloads`` (GPU ones); launch what fits, hold the rest. Never raises."""
        if not workloads or not self._guard.usable() or not self._dispatch_usable():
            return
        try:
            self._schedule(workloads)
        except LedgerUnavailableError as exc:
            self._guard.pause(exc)
        except DispatchUnavailableError as exc:
            self._pause_dispatch(exc)
        except Exception:  # keep the scheduler loop alive; the workloads stay queued
            self.log.exception("gpusched: GPU scheduling cycle failed; retrying next heartbeat")

    def cycle_request(self, pending: Sequence[PendingWork], now: float) -> CycleRequest:
        """Every input of one cycle, read from the ledger now (:func:`.gpu_inputs.read_cycle_request`)."""
        return gpu_inputs.read_cycle_request(self, pending, now)

    def _schedule(self, workloads: Sequence[ExecuteTask]) -> None:
        now, started = self.clock(), time.perf_counter()
        self.migration.claim(now)  # a moved task's target, freed by another mover, before anyone else
        pending, by_key = gpu_inputs.pending_work(self, workloads, now)
        if not pending:
            return
        # The room being made for preemptions in flight stays theirs; service: queue by index.
        cycle = self.preemption.rank(self.preemption.hold_nominated(self.cycle_request(pending, now)))
        victims = set(self.preemption.evictions)
        reply = self.preemption.consider(cycle, self.preemption.decide(cycle))
        self.metrics.preempted(victims, self.preemption.evictions)
        self.metrics.decided(time.perf_counter() - started, reply)
        # One task's failure never costs the others their turn; only an unreachable or locked
        # ledger ends the cycle (every write would wait out its bound in turn).
        launched: list[Launch] = []

        def launch_one(workload: ExecuteTask, launch: Launch) -> None:
            if self._launch(workload, launch, now):
                launched.append(launch)

        for launch in reply.launches:
            self._isolated(launch.key, lambda w=by_key[launch.key], x=launch: launch_one(w, x))
        for hold in reply.holds:
            self._isolated(hold.key, lambda w=by_key[hold.key], x=hold: self.hold(w, x, now))
        if cycle.snapshot.closed:  # hosts with busy worker slots
            self._prefetch(cycle, reply, launched, by_key, now)
        self.metrics.cycle_done()

    def _prefetch(self, cycle: CycleRequest, reply: CycleReply, launched: list[Launch],
                  by_key: dict[str, ExecuteTask], now: float) -> None:
        """Send what this cycle left waiting, only for want of a free worker slot, to hosts whose
        workers may hold it until a slot frees (:func:`.gpu_inputs.prefetch_request`); what still
        does not fit keeps the reason the cycle gave it."""
        sent = {launch.key for launch in launched}
        waiting = ({h.key for h in reply.holds if not h.permanent}
                   | {x.key for x in reply.launches if x.key not in sent and not x.reused})
        waiting -= set(self.preemption.nominated)  # the room being made for them stays theirs
        held = [w for w in cycle.pending if w.key in waiting]
        second = gpu_inputs.prefetch_request(self, cycle, held, launched) if held else None
        if second is None:
            return
        placement, whole = second
        for launch in quota_admitted(decide(placement).launches, whole):
            self._isolated(launch.key, lambda w=by_key[launch.key], x=launch:
                           self._launch(w, x, now, prefetch=True))

    def _pause_dispatch(self, exc: DispatchUnavailableError) -> None:
        now = time.monotonic()
        self.dispatch_down, self._dispatch_down_since = str(exc), now
        self._dispatch_probe_at = now + self.dispatch_probe_s
        waiting = sum(1 for w in self.executor.queued_tasks.values() if is_gpu_task(w))
        self.log.error("gpusched: GPU dispatch paused: %s; %d GPU task(s) stay queued (not failed, no "
                       "retry spent) until it answers again", exc, waiting)

    def _dispatch_usable(self) -> bool:
        """False while dispatch is paused; asks the dispatcher (at most every ``dispatch_probe_s``)."""
        if self.dispatch_down is None:
            return True
        now = time.monotonic()
        if now < self._dispatch_probe_at:
            return False
        if not self.dispatcher.available():
            self._dispatch_probe_at = now + self.dispatch_probe_s
            return False
        self.log.warning("gpusched: GPU dispatch resumed after %.0f s (it was paused: %s)",
                         now - self._dispatch_down_since, self.dispatch_down)
        self.dispatch_down = None
        return True

    def _isolated(self, key: str, action: Any) -> None:
        try:
            action()
        except (LedgerUnavailableError, DispatchUnavailableError):
            raise
        except Exception:
            self.log.exception("gpusched: %s failed this cycle; it stays queued", key)

    def _launch(self, workload: ExecuteTask, launch: Launch, now: float, *, prefetch: bool = False) -> bool:
        """Allocate and dispatch ``launch`` (True), or hold ``workload`` with why not (False).
        ``prefetch``: a second look's launch; refused, it keeps the cycle's reason and no hold."""
        refusal = self.dispatcher.refuse(launch, prefetch=prefetch)
        if refusal:
            if launch.reused:
                self._safe(lambda: self.ledger.release(launch.key, reason=refusal, now=now))
            if not prefetch:
                self.hold(workload, Hold(launch.key, refusal), now)
            return False
        if not launch.reused:
            try:
                self.ledger.allocate(  # the author's request (the prediction is re-made each cycle)
                    launch.key, self.cycle_requests.get(launch.key, launch.request), launch.shares,
                    holder=self.holder, lease_s=self.lease_s, now=now, process=self.process,
                    queued_at=self.submitted.get(workload.key),
                )
            except AllocationConflictError as exc:
                self.hold(workload, Hold(launch.key, f"devices taken meanwhile, retrying: {exc}"), now)
                return False
        self._queue_reason.pop(launch.key, None)
        if launch.reused:  # a new allocation left the queue with its write
            self.ledger.clear_queue(launch.key)
        from airflow.executors.workloads import ExecuteTask

        # The token minted at queue time expires after task_queued_timeout; a task that waited
        # for devices needs a fresh one or its start is refused (HTTP 403).
        token = ExecuteTask.generate_token(str(workload.ti.id), self.executor.jwt_generator)
        fresh = workload.model_copy(update={"token": token})
        submitted = self.submitted.pop(workload.key, None)
        self.seen.discard(workload.key)
        self.gpu_running[workload.key] = launch.key
        gang = launch.env.get("GPUSCHED_GANG")
        if gang:  # watched: a failed member stops the others
            self.gangs.setdefault(gang, set()).add(workload.key)
        try:
            self.dispatcher.dispatch(fresh, launch)
        except DispatchUnavailableError as exc:
            self._unsent(workload, launch, submitted, f"not sent ({exc}); placed again once it answers", now)
            raise
        devices = ", ".join(f"{s.node}:{s.index}({s.milli}m)" for s in launch.shares)
        note = f" ({launch.note})" if launch.note else ""
        self.log.info("gpusched: %s dispatched on %s%s", launch.key, devices, note)
        if launch.note:
            append_task_log(workload.key, f"gpusched: {launch.note}", level="info")
        if launch.key in self.predicted:
            append_task_log(workload.key, f"gpusched: {self.predicted[launch.key].describe()}", level="info")
        save_task_event(
            self.executor,
            event="gpusched.allocated",
            extra=json.dumps({"devices": devices, "env": launch.env.get("CUDA_VISIBLE_DEVICES")}),
            ti_key=workload.key,
        )
        return True

    def _unsent(
        self, workload: ExecuteTask, launch: Launch, submitted: float | None, reason: str, now: float
    ) -> None:
        """Undo a launch whose workload was not sent: it waits again, as if never placed."""
        self.gpu_running.pop(workload.key, None)
        gang = launch.env.get("GPUSCHED_GANG")
        if gang and gang in self.gangs:
            self.gangs[gang].discard(workload.key)
            if not self.gangs[gang]:
                del self.gangs[gang]
        if submitted is not None:
            self.submitted[workload.key] = submitted
        if not launch.reused:  # devices held before this launch (a move's target) stay held
            self._safe(lambda: self.ledger.release(launch.key, reason=reason, now=now))

    def requeue(self, workload: ExecuteTask, reason: str) -> None:
        """Put a dispatched ``workload`` that never started back to wait for devices (same try).

        Its devices are released with ``reason``; the next cycle places it again. The caller
        has made sure its try cannot start from the earlier dispatch any more.
        """
        self.release(workload.key, reason)
        self.executor.queued_tasks[workload.key] = workload
        self.queued(workload)

    def requeue_unstarted(self, key: TaskInstanceKey, reason: str) -> bool:
        """Place try ``key`` again (True) when it was dispatched and surely never started
        (:attr:`unstarted_hook`, set by an executor that can tell; False without one)."""
        return self.unstarted_hook is not None and self.unstarted_hook(key, reason)

    def hold(self, workload: ExecuteTask, hold: Hold, now: float) -> None:
        """Keep ``workload`` waiting with ``hold.reason`` (or fail it when it can never fit)."""
        if hold.permanent:
            lost = sorted(h.name for h in self.ledger.hosts() if h.state not in ("live", "standby"))
            if lost:  # their devices may come back: wait for them rather than fail
                hold = Hold(hold.key, f"{hold.reason}; GPU host(s) {', '.join(lost)} lost: "
                                      "waiting for them to come back")
        if hold.permanent and self.fail_unschedulable:
            self.reject(workload, hold.key, f"can never fit this fleet: {hold.reason}")
            return
        if self.slot_notes and "worker slot" not in hold.reason:  # devices free there, slots not
            more = f" (+{len(self.slot_notes) - 2} more)" if len(self.slot_notes) > 2 else ""
            hold = Hold(hold.key, f"{hold.reason}; {'; '.join(self.slot_notes[:2])}{more}", hold.permanent)
        if hold.key in self.predicted:
            hold = Hold(hold.key, f"{hold.reason} ({self.predicted[hold.key].describe()})", hold.permanent)
        self.metrics.held(hold, self.submitted.get(workload.key, now), self._queue_reason.get(hold.key))
        if self._queue_reason.get(hold.key) == hold.reason:
            return  # already recorded; the ledger keeps the first time it started waiting
        self._queue_reason[hold.key] = hold.reason
        request = (self.cycle_requests.get(hold.key)
                   or request_from_executor_config(workload.ti.executor_config))
        assert request is not None
        ti = workload.ti  # a gang member's membership: the standby scale-out serves whole gangs
        gang = gang_member(ti.executor_config, dag_id=ti.dag_id, run_id=ti.run_id,
                           map_index=ti.map_index if ti.map_index is not None else -1)
        self.ledger.record_queue(hold.key, request, hold.reason, now, gang=gang)
        self.log.info("gpusched: %s waits: %s", hold.key, hold.reason)
        append_task_log(workload.key, f"gpusched: waiting for GPUs: {hold.reason}", level="info")

    def reject(self, workload: ExecuteTask, key: str, reason: str) -> None:
        """Fail ``workload`` now with ``reason`` (one line: in the try's log, the task's event log
        and the ledger's ``unschedulable`` events, which the fleet page lists), for good: a try
        that can never fit, was refused by the fault chain or has an invalid request fails the
        same way on every retry, so none is spent (:func:`.executor_compat.fail_unstarted`)."""
        self.executor.queued_tasks.pop(workload.key, None)
        self.submitted.pop(workload.key, None)
        self.seen.discard(workload.key)
        self._queue_reason.pop(key, None)
        self._safe(lambda: self.ledger.clear_queue(key))
        # Where users look: the try's log (Logs tab, task-log API) and the ledger's events.
        append_task_log(workload.key, f"gpusched: not started, {reason}")
        self._safe(lambda: self.ledger.record_event("unschedulable", key, reason=reason))
        save_task_event(self.executor, event="gpusched.unschedulable", extra=reason, ti_key=workload.key)
        final = fail_unstarted(self.executor, workload, reason)  # failed in Airflow's database
        self.log.error("gpusched: failed %s%s: %s", key, " (no retry)" if final else "", reason)
        self.executor.fail(workload.key, info=reason)

    # ---- leases, release, hosts ----------------------------------------------------------------

    def periodic(self, now: float | None = None) -> None:
        """Renew this executor's leases, expire dead ones, and handle GPU hosts that went silent."""
        now = self.clock() if now is None else now
        if not self._guard.usable():
            return
        if now - self._last_reconcile >= self.reconcile_s:
            self._last_reconcile = now
            self._safe(self.reconcile)
            self._safe(lambda: gpu_over_budget.check_running(self, now))
        if now - self._last_renew >= max(5.0, min(60.0, self.lease_s / 4)):
            self._last_renew = now
            held = self._safe(self.migration.held_keys) or set()  # devices held for moved tries
            for ledger_key in [*self.gpu_running.values(), *sorted(held)]:
                self._safe(lambda k=ledger_key: self._renew(k))
            # Leases of a crashed executor (any holder) run out here.
            for alloc in self._safe(lambda: self.ledger.expire_leases(now)) or ():
                self.log.warning("gpusched: lease of %s expired; devices released", alloc.key)
        # Victims being stopped (also those an earlier executor began to stop: restore).
        self._safe(lambda: self.preemption.advance(now))
        if self.migration.enabled:  # claim freed targets, then (every interval) the migration rule
            self.metrics.migrated(self._safe(lambda: self.migration.tick(self.policy, now)))
        if self.gangs and now - self._last_gang_check >= 2.0:
            self._last_gang_check = now
            self._safe(self.stop_broken_gangs)
        if self.host_timeout_s > 0 and now - self._last_host_check >= min(5.0, self.host_timeout_s / 3):
            self._last_host_check = now
            self._safe(lambda: self.handle_lost_hosts(now))
        self._safe(lambda: self.metrics.periodic(  # budget use every minute; waiting tasks gone
            self.ledger, any(is_gpu_task(w) for w in self.executor.queued_tasks.values()), now))

    def _renew(self, ledger_key: str) -> None:
        try:
            self.ledger.renew(ledger_key, self.lease_s)
        except UnknownAllocationError:  # the task side released it already; the executor learns soon
            self.log.debug("gpusched: %s already released", ledger_key)

    def handle_lost_hosts(self, now: float) -> list[str]:
        """Mark silent GPU hosts lost; release their allocations and fail their tasks (node lost)."""
        before = self.ledger.hosts()
        lost = gpu_faults.handle_lost_hosts(self, now)
        self.metrics.hosts_judged(before, self.ledger.hosts() if before else ())
        return lost

    def stop_broken_gangs(self) -> list[TaskInstanceKey]:
        """Stop the live members of every launched gang one of whose members failed (or was lost)."""
        return gpu_faults.stop_broken_gangs(self)

    def release(self, key: TaskInstanceKey, reason: str, *, succeeded: bool = False) -> None:
        """Release the devices of Airflow key ``key`` (idempotent with the task-side listener);
        ``succeeded``: its task did (what learned durations learn from)."""
        ledger_key = self.gpu_running.pop(key, None)
        if ledger_key is None:
            return
        if self._safe(lambda: self.ledger.release(ledger_key, reason=reason, now=self.clock(),
                                                  succeeded=succeeded)) is not None:
            self.log.info("gpusched: released %s (%s)", ledger_key, reason)

    def fail_orphaned(self) -> list[str]:
        """Release and fail the tries whose LocalExecutor worker (their supervisor) died."""
        return gpu_faults.fail_orphaned(self)
