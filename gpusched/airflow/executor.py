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
fgd, fgd-full, fgd-lookahead, fgd-memory, first-fit, best-fit, random), ``lease_seconds`` (600),
``fail_unschedulable`` (True: a request that can never fit this fleet fails at once instead of
waiting), ``visible_devices_by_uuid`` (False), ``sync_inventory_on_start`` (True: discover the
hardware or simulated fleet on start),
``pool_sync`` (default: the ``GPUSCHED_POOL_SYNC`` variable; keeps the ``gpu_<partition>`` pools
sized to the fleet, see :mod:`gpusched.airflow.pool_sync`; done by the hooks both executors
share, :mod:`gpusched.airflow.gpu_executor_hooks`), ``wait_for_api_seconds`` (90: on start,
wait this long for the execution API to answer before dispatching anything; 0 = do not wait),
``ledger_wait_seconds`` (5: the most one ledger operation waits for a lock), ``reconcile_seconds``
(5: how often allocations of gone or superseded tries are looked for).

The GPU logic is :class:`gpusched.airflow.gpu_scheduling.GPUScheduling`, shared with
:class:`gpusched.airflow.celery_executor.GPUCeleryExecutor`; this class adds only how a launch is
dispatched (a local worker with the devices' environment).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

from airflow.executors.local_executor import LocalExecutor

from gpusched import settings
from gpusched.airflow.dispatch import run_gpu_worker
from gpusched.airflow.executor_compat import (
    local_any_worker_dead,
    local_put,
    local_spawn_worker,
)
from gpusched.airflow.gpu_executor_hooks import GPUExecutorHooks
from gpusched.airflow.gpu_scheduling import GPUScheduling
from gpusched.hardware.detect import detect_backend
from gpusched.scheduler.cycle import Launch

__all__ = ["GPUExecutor", "wait_for_execution_api"]


class GPUExecutor(GPUExecutorHooks, LocalExecutor):
    """LocalExecutor plus GPU placement, allocation, per-task device environment and release."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        holder = f"GPUExecutor@{socket.gethostname()}" + (f"/{self.team_name}" if self.team_name else "")
        self.gpu = GPUScheduling(self, _LocalDispatcher(self), holder=holder)

    @property
    def holder(self) -> str:
        """Who this executor's allocations belong to in the ledger."""
        return self.gpu.holder

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, open the ledger, sync the inventory and reconcile after a restart."""
        super().start()
        self.gpu.start_process()
        ledger = self.ledger
        ledger.migrate()
        if settings.get_bool("sync_inventory_on_start", self.conf):
            backend = detect_backend()
            try:
                ledger.sync_inventory(backend.discover(), source=backend.name)
            finally:
                backend.close()
            self.log.info("gpusched: fleet inventory from the %s backend", backend.name)
        self.reconcile()
        wait_for_execution_api(self)

    def reconcile(self) -> list[str]:
        """Release this holder's allocations whose task instance is not queued or running any more."""
        return self.gpu.reconcile()

    def revoke_task(self, *, ti: Any, **kwargs: Any) -> None:
        """Forget a task stuck in queued: drop it from the GPU queue and release its devices.

        The scheduler then sets it back to scheduled (and fails it after
        ``[scheduler] num_stuck_in_queued_retries``). Never raises.
        """
        self.gpu.revoke(ti)

    # ---- queueing and dispatch ---------------------------------------------------------------

    def send_plain(self, workloads: list[Any]) -> None:
        """Run workloads without a GPU request in LocalExecutor's workers."""
        LocalExecutor._process_workloads(self, workloads)

    # ---- completion, leases --------------------------------------------------------------------

    def sync(self) -> None:
        """Read results (releasing finished GPU tasks; pools kept by the shared hooks), then renew
        leases now and then."""
        super().sync()
        self.gpu.periodic(time.time())

    def _spawn_worker(self) -> None:
        local_spawn_worker(self, run_gpu_worker)

    def _check_workers(self) -> None:
        # LocalExecutor reaps dead workers here; a dead worker was the supervisor of the task it
        # ran, so that task's result never arrives: release its devices now and fail the try
        # (Airflow retries it) instead of waiting for the task heartbeat timeout.
        died = local_any_worker_dead(self)
        super()._check_workers()
        if died and self.gpu_running:
            self.gpu._safe(self.gpu.fail_orphaned)


class _LocalDispatcher:
    """Runs a launch in one of this host's LocalExecutor workers, with the devices' environment."""

    def __init__(self, executor: GPUExecutor) -> None:
        self.executor = executor

    def refuse(self, launch: Launch, *, prefetch: bool = False) -> str | None:
        return None

    def available(self) -> bool:
        return True  # its workers are this process's children

    def full_nodes(self, active: Sequence[Any]) -> dict[str, str]:
        return {}  # LocalExecutor's parallelism is Airflow's own slot limit

    def prefetch_nodes(self, running: Sequence[Any], now: float) -> frozenset[str]:
        return frozenset()

    def dispatch(self, workload: Any, launch: Launch) -> None:
        local_put(self.executor, workload, launch.env)


def wait_for_execution_api(executor: Any) -> None:
    """Wait up to ``[gpusched] wait_for_api_seconds`` for the execution API to answer.

    `airflow standalone` starts the scheduler and the api-server together; a task dispatched
    before the execution API listens fails at once (connection refused).
    """
    timeout = settings.get_float("wait_for_api_seconds", executor.conf)
    if timeout <= 0:
        return
    import httpx
    from airflow.executors.base_executor import get_execution_api_server_url

    url = get_execution_api_server_url(executor.conf).rstrip("/") + "/health"
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.TransportError:
            if time.monotonic() >= deadline:
                executor.log.warning("gpusched: execution API %s not reachable after %.0f s", url, timeout)
                return
            time.sleep(1.0)
