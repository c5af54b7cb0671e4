"""GPUExecutor: Airflow's LocalExecutor that starts a GPU task only once devices are allocated.

Configure with ``[core] executor = gpusched.airflow.executor.GPUExecutor``
(``AIRFLOW__CORE__EXECUTOR``). Tasks whose ``executor_config`` carries a ``gpusched`` request
(see :mod:`gpusched.airflow.authoring`) wait in ``queued_tasks`` until the placement engine
finds devices on the ledger's fleet snapshot; then the allocation is written to the ledger in
one transaction, the workload gets a fresh token and goes to a worker with the devices'
environment. Every other workload runs exactly as under LocalExecutor.

Lifecycle of an allocation: written at dispatch, lease renewed on heartbeats, released when the
task process ends (``change_state``), when the task is revoked, when the executor ends, or —
after a crash — on the next start (``reconcile``) or when its lease expires.

Settings (``[gpusched]`` section of the executor's team-scoped config, or
``AIRFLOW__GPUSCHED__<NAME>``; declared with types and defaults in :mod:`gpusched.settings`):
``policy`` (gpusched,
first-fit, best-fit, random), ``lease_seconds`` (600), ``fail_unschedulable`` (True: a request
that can never fit this fleet fails at once instead of waiting), ``visible_devices_by_uuid``
(False), ``sync_inventory_on_start`` (True: discover the hardware or simulated fleet on start),
``pool_sync`` (default: the ``GPUSCHED_POOL_SYNC`` variable; keeps the ``gpu_<partition>`` pools
sized to the fleet, see :mod:`gpusched.airflow.pool_sync`), ``wait_for_api_seconds`` (90: on start,
wait this long for the execution API to answer before dispatching anything; 0 = do not wait).
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
from gpusched.airflow.keys import KEY_PREFIX, ti_key, ti_key_of
from gpusched.errors import AllocationConflictError, GPURequestError, GpuschedError
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
        pool_default = settings.env_bool("GPUSCHED_POOL_SYNC")
        self._pool_syncer: Any = None
        if settings.get_bool("pool_sync", self.conf, empty=pool_default):
            from gpusched.airflow.pool_sync import PoolSyncer

            self._pool_syncer = PoolSyncer()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, open the ledger, sync the inventory and reconcile after a restart."""
        super().start()
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

            self._ledger = Ledger()
        return self._ledger

    @property
    def policy(self) -> Policy:
        """The placement policy named by ``[gpusched] policy``."""
        if self._policy is None:
            from gpusched.placement import Policy

            self._policy = Policy.named(settings.get_str("policy", self.conf))
        return self._policy

    def reconcile(self) -> list[str]:
        """Release this holder's allocations whose task instance is not queued or running any more."""
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from airflow.utils.state import TaskInstanceState
        from sqlalchemy import select

        live_states = [TaskInstanceState.QUEUED, TaskInstanceState.RUNNING, TaskInstanceState.RESTARTING]
        ti = TaskInstance
        with create_session() as session:
            rows = session.execute(
                select(ti.dag_id, ti.task_id, ti.run_id, ti.try_number, ti.map_index).where(
                    ti.state.in_(live_states)
                )
            ).all()
        live = {ti_key(r[0], r[1], r[2], r[3], r[4]) for r in rows}
        released = self.ledger.reconcile(live, holder=self.holder)
        for alloc in released:
            self.log.info("gpusched: released stale allocation %s after restart", alloc.key)
        for entry in self.ledger.queue():  # waiting records of tasks that are gone
            if entry.key.startswith(KEY_PREFIX) and entry.key not in live:
                self.ledger.clear_queue(entry.key)
        return [a.key for a in released]

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
        if gpu_work:
            try:
                self._schedule_gpu(gpu_work)
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
        for launch in decision.launches:
            self._launch(by_key[launch.key], launch, now)
        for hold in decision.holds:
            self._hold(by_key[hold.key], hold, now)

    def _launch(self, workload: Any, launch: Launch, now: float) -> None:
        if not launch.reused:
            try:
                self.ledger.allocate(
                    launch.key, launch.request, launch.shares, holder=self.holder,
                    lease_s=self.lease_s, now=now,
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

    def _reject(self, workload: Any, key: str, reason: str) -> None:
        self.queued_tasks.pop(workload.key, None)
        self._submitted.pop(workload.key, None)
        self._seen.discard(workload.key)
        self._queue_reason.pop(key, None)
        self._safe(lambda: self.ledger.clear_queue(key))
        self.log.error("gpusched: failing %s: %s", key, reason)
        self.log_task_event(event="gpusched.unschedulable", extra=reason, ti_key=workload.key)
        self.fail(workload.key, info=reason)

    # ---- completion, leases --------------------------------------------------------------------

    def change_state(self, key: Any, state: Any, info: Any = None, remove_running: bool = True) -> None:
        """Record the state as LocalExecutor does; release the devices once the process ended."""
        super().change_state(key, state, info, remove_running=remove_running)
        if key in self.gpu_running and str(state) not in _NOT_FINISHED:
            self._release(key, f"task process ended ({state})")

    def sync(self) -> None:
        """Read results (releasing finished GPU tasks), then renew leases now and then."""
        super().sync()
        now = time.time()
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

    def _safe(self, action: Any) -> Any:
        try:
            return action()
        except GpuschedError:
            self.log.exception("gpusched: ledger operation failed")
        except Exception:  # a database hiccup must not stop the scheduler
            self.log.exception("gpusched: unexpected error in a ledger operation")
        return None
