"""GPUExecutor: Airflow's LocalExecutor that starts a GPU task only once devices are allocated.

Configure with ``[core] executor = gpusched.airflow.executor.GPUExecutor``
(``AIRFLOW__CORE__EXECUTOR``). Tasks whose ``executor_config`` carries a ``gpusched`` request
(see :mod:`gpusched.airflow.authoring`) wait in ``queued_tasks`` until the placement engine
finds devices on the ledger's fleet snapshot; then the allocation is written to the ledger in
one transaction, the workload gets a fresh token and goes to a worker with the devices'
environment. Every other workload runs exactly as under LocalExecutor.

Lifecycle of an allocation: written at dispatch (recording the executor process; the worker that
picks the task up and the task process add themselves), lease renewed on heartbeats, released when
the task process ends (``change_state``), when the task is revoked, when the executor ends, at
once when the worker running it dies (the task is then failed, so Airflow retries it), or — after
a crash — by ``reconcile`` (on start and every few seconds: a superseded or finished try, or one
whose holder processes are gone) or when its lease expires.

The executor never waits on the ledger longer than ``ledger_wait_seconds``: a writer stuck inside
a transaction makes the GPU part of a heartbeat give up (workloads stay queued) instead of
stalling the scheduler loop, and the ledger is left alone for that long before the next try.

Settings (``[gpusched]`` section of the executor's team-scoped config, or
``AIRFLOW__GPUSCHED__<NAME>``; declared with types and defaults in :mod:`gpusched.settings`):
``policy`` (gpusched,
first-fit, best-fit, random), ``lease_seconds`` (600), ``fail_unschedulable`` (True: a request
that can never fit this fleet fails at once instead of waiting), ``visible_devices_by_uuid``
(False), ``sync_inventory_on_start`` (True: discover the hardware or simulated fleet on start),
``pool_sync`` (default: the ``GPUSCHED_POOL_SYNC`` variable; keeps the ``gpu_<partition>`` pools
sized to the fleet, see :mod:`gpusched.airflow.pool_sync`), ``wait_for_api_seconds`` (90: on start,
wait this long for the execution API to answer before dispatching anything; 0 = do not wait),
``ledger_wait_seconds`` (5: the most one ledger operation waits for a lock), ``reconcile_seconds``
(5: how often allocations of gone or superseded tries are looked for).
"""

from __future__ import annotations

import json
import socket
import time
from typing import TYPE_CHECKING, Any

from airflow.executors.local_executor import LocalExecutor

from gpusched import settings
from gpusched.airflow.authoring import request_from_executor_config
from gpusched.airflow.dispatch import run_gpu_worker
from gpusched.airflow.gpu_cycle import Hold, Launch, PendingWork, decide, running_tasks
from gpusched.airflow.keys import ti_key_of
from gpusched.airflow.orphans import reconcile_holder, task_state
from gpusched.airflow.task_log import append_task_log
from gpusched.errors import AllocationConflictError, GPURequestError, GpuschedError, LedgerUnavailableError
from gpusched.failures import load_overrides
from gpusched.placement.genetic import parse_weights
from gpusched.request import GPURequest

if TYPE_CHECKING:
    from gpusched.ledger import Ledger
    from gpusched.placement import Policy

__all__ = ["GPUExecutor"]

_NOT_FINISHED = frozenset({"running", "queued", "scheduled", "restarting", "deferred"})


class GPUExecutor(LocalExecutor):
    """LocalExecutor plus GPU placement, allocation, per-task device environment and release."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holder = f"GPUExecutor@{socket.gethostname()}" + (f"/{self.team_name}" if self.team_name else "")
        self.lease_s = settings.get_int("lease_seconds", self.conf)
        self.fail_unschedulable = settings.get_bool("fail_unschedulable", self.conf)
        self.use_uuids = settings.get_bool("visible_devices_by_uuid", self.conf)
        # Genetic re-planning of each cycle's batch (0 = greedy only), and its objective weights.
        self.replan_budget_ms = settings.get_float("replan_budget_ms", self.conf)
        self.replan_weights = parse_weights(
            settings.get_str("replan_weights", self.conf), where="[gpusched] replan_weights"
        )
        self._ledger: Ledger | None = None
        self._policy: Policy | None = None
        # Airflow key -> ledger key of dispatched GPU work (self.running stays empty in 3.3).
        self.gpu_running: dict[Any, str] = {}
        self._submitted: dict[Any, float] = {}
        self._seen: set[Any] = set()
        self._cycle_requests: dict[str, GPURequest] = {}  # ledger key -> request used this cycle
        self._queue_reason: dict[str, str] = {}
        self._last_renew = 0.0
        self._last_pool_check = 0.0
        self._last_reconcile = 0.0
        self.ledger_wait_s = settings.get_float("ledger_wait_seconds", self.conf)
        self.reconcile_s = settings.get_float("reconcile_seconds", self.conf)
        self._ledger_down_until = 0.0  # monotonic time before which the ledger is left alone
        self._process: Any = None  # this executor as a HolderProcess (set on start)
        pool_default = settings.env_bool("GPUSCHED_POOL_SYNC")
        self._pool_syncer: Any = None
        if settings.get_bool("pool_sync", self.conf, empty=pool_default):
            from gpusched.airflow.pool_sync import PoolSyncer

            self._pool_syncer = PoolSyncer()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, open the ledger, sync the inventory and reconcile after a restart."""
        super().start()
        from gpusched.ledger.liveness import current_process

        self._process = current_process("executor")
        ledger = self.ledger
        ledger.migrate()
        if settings.get_bool("sync_inventory_on_start", self.conf):
            from gpusched.hardware.detect import detect_backend

            backend = detect_backend()
            try:
                ledger.sync_inventory(backend.discover(), source=backend.name)
            finally:
                backend.close()
            self.log.info("gpusched: fleet inventory from the %s backend", backend.name)
        self.reconcile()
        self._wait_for_execution_api()

    def _wait_for_execution_api(self) -> None:
        # `airflow standalone` starts the scheduler and the api-server together; a task
        # dispatched before the execution API listens fails at once (connection refused).
        timeout = settings.get_float("wait_for_api_seconds", self.conf)
        if timeout <= 0:
            return
        import httpx
        from airflow.executors.base_executor import get_execution_api_server_url

        url = get_execution_api_server_url(self.conf).rstrip("/") + "/health"
        deadline = time.monotonic() + timeout
        while True:
            try:
                httpx.get(url, timeout=2.0)
                return
            except httpx.TransportError:
                if time.monotonic() >= deadline:
                    self.log.warning("gpusched: execution API %s not reachable after %.0f s", url, timeout)
                    return
                time.sleep(1.0)

    @property
    def ledger(self) -> Ledger:
        """The allocation ledger (opened on first use)."""
        if self._ledger is None:
            from gpusched.ledger import Ledger

            self._ledger = Ledger(lock_wait_s=self.ledger_wait_s)
        return self._ledger

    @property
    def policy(self) -> Policy:
        """The placement policy named by ``[gpusched] policy``."""
        if self._policy is None:
            from gpusched.placement import Policy

            self._policy = Policy.named(settings.get_str("policy", self.conf))
        return self._policy

    def reconcile(self) -> list[str]:
        """Release this holder's allocations that no live try needs; renew those still in use.

        Looks at every active allocation of this holder that this executor did not dispatch and
        does not hold queued: released when Airflow has superseded the try, when the task instance
        is no longer queued or running, or when every recorded holder process is gone
        (:func:`gpusched.airflow.orphans.stale_reason`); renewed when a process of it still runs
        (a task that outlived a restarted scheduler). Returns the released keys.
        """
        waiting = {ti_key_of(w.ti) for w in self.queued_tasks.values()}
        return reconcile_holder(
            self.ledger, self.holder, dispatched=set(self.gpu_running.values()), waiting=waiting,
            lease_s=self.lease_s, log=self.log,
        )

    def end(self) -> None:
        """Wait for running tasks (as LocalExecutor), then release what is still held."""
        super().end()
        for key in list(self.gpu_running):
            self._release(key, "executor stopped")
        for workload in list(self.queued_tasks.values()):
            if self._is_gpu(workload):
                self._safe(lambda w=workload: self.ledger.clear_queue(ti_key_of(w.ti)))

    def revoke_task(self, *, ti: Any) -> None:
        """Forget a task stuck in queued: drop it from the GPU queue and release its devices.

        The scheduler then sets it back to scheduled (and fails it after
        ``[scheduler] num_stuck_in_queued_retries``). Never raises.
        """
        key = ti.key
        self.queued_tasks.pop(key, None)
        self._submitted.pop(key, None)
        self._seen.discard(key)
        ledger_key = ti_key_of(ti)
        self._queue_reason.pop(ledger_key, None)
        self._safe(lambda: self.ledger.clear_queue(ledger_key))
        if key in self.gpu_running:
            self._release(key, "revoked: stuck in queued")
        else:
            self._safe(lambda: self.ledger.release(ledger_key, reason="revoked: stuck in queued"))

    # ---- queueing and dispatch ---------------------------------------------------------------

    def queue_workload(self, workload: Any, session: Any) -> None:
        """Queue as LocalExecutor does, remembering when a GPU workload started to wait."""
        super().queue_workload(workload, session)
        if self._is_gpu(workload):
            self._submitted.setdefault(workload.key, time.time())

    def _process_workloads(self, workload_list: Any) -> None:
        gpu_work = [w for w in workload_list if self._is_gpu(w)]
        plain = [w for w in workload_list if not self._is_gpu(w)]
        if plain:
            super()._process_workloads(plain)
        if gpu_work and self._ledger_usable():
            try:
                self._schedule_gpu(gpu_work)
            except LedgerUnavailableError as exc:
                self._ledger_unavailable(exc)
            except Exception:  # keep the scheduler loop alive; the workloads stay queued
                self.log.exception("gpusched: GPU scheduling cycle failed; retrying next heartbeat")

    def _schedule_gpu(self, workloads: list[Any]) -> None:
        now = time.time()
        ledger = self.ledger
        pending: list[PendingWork] = []
        by_key: dict[str, Any] = {}
        # The fault chain may have replaced a task's request (more memory, another model) or
        # refused its retry (code errors fail the same way on any GPU): both live in the ledger.
        overrides = load_overrides(ledger)
        self._cycle_requests.clear()
        for workload in workloads:
            ti = workload.ti
            key = ti_key_of(ti)
            refusal = overrides.refusal(ti.dag_id, ti.task_id, ti.run_id, ti.try_number)
            if refusal:
                self._reject(workload, key, f"gpusched fault chain refused this retry: {refusal}")
                continue
            try:
                request = overrides.lookup(ti.dag_id, ti.task_id, ti.run_id) or (
                    request_from_executor_config(ti.executor_config)
                )
            except GPURequestError as exc:
                self._reject(workload, key, f"invalid GPU request in executor_config: {exc}")
                continue
            assert request is not None
            self._cycle_requests[key] = request
            shares: tuple[Any, ...] = ()
            if workload.key not in self._seen:
                # Only a workload queued again (scheduler restart) can already own an allocation.
                self._seen.add(workload.key)
                existing = ledger.get(key)
                shares = tuple(existing.shares) if existing and existing.released_at is None else ()
            by_key[key] = workload
            pending.append(PendingWork(key, request, self._submitted.get(workload.key, now), shares))
        if not pending:
            return
        snapshot = ledger.snapshot(now)
        running = running_tasks(ledger.active())
        decision = decide(
            pending, snapshot, self.policy, now=now, running=running, use_uuids=self.use_uuids,
            replan_budget_ms=self.replan_budget_ms, replan_weights=self.replan_weights,
        )
        # One task's failure never costs the others their turn; only an unreachable or locked
        # ledger ends the cycle (every write would wait out its bound in turn).
        for launch in decision.launches:
            self._isolated(launch.key, lambda w=by_key[launch.key], x=launch: self._launch(w, x, now))
        for hold in decision.holds:
            self._isolated(hold.key, lambda w=by_key[hold.key], x=hold: self._hold(w, x, now))

    def _isolated(self, key: str, action: Any) -> None:
        try:
            action()
        except LedgerUnavailableError:
            raise
        except Exception:
            self.log.exception("gpusched: %s failed this cycle; it stays queued", key)

    def _launch(self, workload: Any, launch: Launch, now: float) -> None:
        if not launch.reused:
            try:
                self.ledger.allocate(
                    launch.key, launch.request, launch.shares, holder=self.holder,
                    lease_s=self.lease_s, now=now, process=self._process,
                )
            except AllocationConflictError as exc:
                self._hold(workload, Hold(launch.key, f"devices taken meanwhile, retrying: {exc}"), now)
                return
        self._queue_reason.pop(launch.key, None)
        self.ledger.clear_queue(launch.key)
        from airflow.executors.workloads import ExecuteTask

        # The token minted at queue time expires after task_queued_timeout; a task that waited
        # for devices needs a fresh one or its start is refused (HTTP 403).
        fresh = workload.model_copy(
            update={"token": ExecuteTask.generate_token(str(workload.ti.id), self.jwt_generator)}
        )
        self.activity_queue.put((fresh, dict(launch.env)))  # type: ignore[arg-type]
        self.queued_tasks.pop(workload.key, None)
        self._submitted.pop(workload.key, None)
        self._seen.discard(workload.key)
        self.gpu_running[workload.key] = launch.key
        with self._unread_messages:
            self._unread_messages.value += 1
        self._check_workers()
        devices = ", ".join(f"{s.node}:{s.index}({s.milli}m)" for s in launch.shares)
        self.log.info("gpusched: %s dispatched on %s", launch.key, devices)
        self.log_task_event(
            event="gpusched.allocated",
            extra=json.dumps({"devices": devices, "env": launch.env.get("CUDA_VISIBLE_DEVICES")}),
            ti_key=workload.key,
        )

    def _hold(self, workload: Any, hold: Hold, now: float) -> None:
        if hold.permanent and self.fail_unschedulable:
            self._reject(workload, hold.key, f"can never fit this fleet: {hold.reason}")
            return
        if self._queue_reason.get(hold.key) == hold.reason:
            return  # already recorded; the ledger keeps the first time it started waiting
        self._queue_reason[hold.key] = hold.reason
        request = self._cycle_requests.get(hold.key) or request_from_executor_config(
            workload.ti.executor_config
        )
        assert request is not None
        self.ledger.record_queue(hold.key, request, hold.reason, now)
        self.log.info("gpusched: %s waits: %s", hold.key, hold.reason)
        append_task_log(workload.key, f"gpusched: waiting for GPUs: {hold.reason}", level="info")

    def log_task_event(self, *, event: str, extra: str, ti_key: Any) -> None:
        """Write the event-log row (``/api/v2/eventLogs``, the Audit Log) now, in its own session.

        BaseExecutor only queues the row for the scheduler's batched flush, which in Airflow
        3.3.2 lost our rows ("NOT NULL constraint failed: log.event" for the whole batch).
        """
        try:
            from airflow.models.log import Log
            from airflow.utils.session import create_session

            with create_session() as session:
                session.add(Log(event=event, task_instance=ti_key, extra=extra))
        except Exception:
            self.log.exception("gpusched: could not write the %s event log row; queueing it", event)
            super().log_task_event(event=event, extra=extra, ti_key=ti_key)

    def _reject(self, workload: Any, key: str, reason: str) -> None:
        self.queued_tasks.pop(workload.key, None)
        self._submitted.pop(workload.key, None)
        self._seen.discard(workload.key)
        self._queue_reason.pop(key, None)
        self._safe(lambda: self.ledger.clear_queue(key))
        self.log.error("gpusched: failing %s: %s", key, reason)
        # Where users look: the try's log (Logs tab, task-log API) and the ledger's events.
        append_task_log(workload.key, f"gpusched: not started, {reason}")
        self._safe(lambda: self.ledger.record_event("unschedulable", key, reason=reason))
        self.log_task_event(event="gpusched.unschedulable", extra=reason, ti_key=workload.key)
        self.fail(workload.key, info=reason)

    # ---- completion, leases --------------------------------------------------------------------

    def change_state(self, key: Any, state: Any, info: Any = None, remove_running: bool = True) -> None:
        """Record the state as LocalExecutor does; release the devices once the process ended."""
        super().change_state(key, state, info, remove_running=remove_running)
        if key in self.gpu_running and str(state) not in _NOT_FINISHED:
            # The executor's state only says the process ended; the reason names the task's own
            # outcome (a SIGKILLed task ends "success" here but "failed" in Airflow).
            outcome = self._safe(lambda: task_state(key))
            self._release(key, f"task process ended (task {outcome})" if outcome
                          else f"task process ended (executor state {state})")

    def sync(self) -> None:
        """Read results (releasing finished GPU tasks), watch workers, renew leases, reconcile."""
        super().sync()
        now = time.time()
        if not self._ledger_usable():
            return
        if now - self._last_reconcile >= self.reconcile_s:
            self._last_reconcile = now
            self._safe(self.reconcile)
            if self.gpu_running:  # a worker death missed while the ledger was unavailable
                self._safe(self._fail_orphaned)
        if now - self._last_renew >= max(5.0, min(60.0, self.lease_s / 4)):
            self._last_renew = now
            for ledger_key in list(self.gpu_running.values()):
                self._safe(lambda k=ledger_key: self.ledger.renew(k, self.lease_s))
            # Leases of a crashed executor (any holder) run out here.
            for alloc in self._safe(lambda: self.ledger.expire_leases(now)) or ():
                self.log.warning("gpusched: lease of %s expired; devices released", alloc.key)
        if self._pool_syncer is not None and now - self._last_pool_check >= 10.0:
            self._last_pool_check = now
            self._safe(lambda: self._pool_syncer.maybe_sync(self.ledger.snapshot(now)))

    def _check_workers(self) -> None:
        # LocalExecutor reaps dead workers here; a dead worker was the supervisor of the task it
        # ran, so that task's result never arrives: release its devices now and fail the try
        # (Airflow retries it) instead of waiting for the task heartbeat timeout.
        died = any(not proc.is_alive() for proc in getattr(self, "workers", {}).values())
        super()._check_workers()
        if died and self.gpu_running:
            self._safe(self._fail_orphaned)

    def _fail_orphaned(self) -> None:
        # Judged by pid and start time (a respawned worker may reuse a dead one's pid); a task
        # whose worker has not picked it up yet has no worker record and is left alone.
        from gpusched.ledger.liveness import process_alive

        host = socket.gethostname()
        by_ledger_key = {v: k for k, v in self.gpu_running.items()}
        for alloc in self.ledger.active(self.holder):
            airflow_key = by_ledger_key.get(alloc.key)
            workers = [p for p in alloc.processes if p.role == "worker" and p.host == host]
            if airflow_key is None or not workers or process_alive(workers[-1]) is not False:
                continue
            reason = f"worker process {workers[-1].pid} died"
            self._release(airflow_key, reason)
            self.log.error("gpusched: %s: %s; failing the try so Airflow retries it", alloc.key, reason)
            self.fail(airflow_key, info=f"gpusched: {reason}")

    def _release(self, key: Any, reason: str) -> None:
        ledger_key = self.gpu_running.pop(key, None)
        if ledger_key is None:
            return
        if self._safe(lambda: self.ledger.release(ledger_key, reason=reason)) is not None:
            self.log.info("gpusched: released %s (%s)", ledger_key, reason)
        # else: the listener in the task process released it already

    # ---- helpers ---------------------------------------------------------------------------

    def _spawn_worker(self) -> None:
        import multiprocessing

        # LocalExecutor._spawn_worker with the worker loop that applies per-task environments.
        proc = multiprocessing.Process(
            target=run_gpu_worker,
            kwargs={
                "logger_name": self.log.name,
                "input": self.activity_queue,
                "output": self.result_queue,
                "unread_messages": self._unread_messages,
                "team_conf": self.conf,
            },
        )
        proc.start()
        assert proc.pid is not None
        self.workers[proc.pid] = proc

    @staticmethod
    def _is_gpu(workload: Any) -> bool:
        ti = getattr(workload, "ti", None)
        config = getattr(ti, "executor_config", None) if ti is not None else None
        return isinstance(config, dict) and "gpusched" in config

    def _ledger_usable(self) -> bool:
        return time.monotonic() >= self._ledger_down_until

    def _ledger_unavailable(self, exc: Exception) -> None:
        self._ledger_down_until = time.monotonic() + self.ledger_wait_s
        self.log.error("gpusched: ledger unavailable, GPU work paused for %.0f s: %s",
                       self.ledger_wait_s, exc)

    def _safe(self, action: Any) -> Any:
        if not self._ledger_usable():
            return None  # paused after a lock timeout or outage; reconcile catches up later
        try:
            return action()
        except LedgerUnavailableError as exc:
            self._ledger_unavailable(exc)
        except GpuschedError:
            self.log.exception("gpusched: ledger operation failed")
        except Exception:  # a database hiccup must not stop the scheduler
            self.log.exception("gpusched: unexpected error in a ledger operation")
        return None
