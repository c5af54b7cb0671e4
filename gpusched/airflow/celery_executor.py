"""GPUCeleryExecutor: Airflow's CeleryExecutor that routes each GPU task to the host owning its devices.

Configure with ``[core] executor = gpusched.airflow.celery_executor.GPUCeleryExecutor`` (alone
or beside others: ``[core] executor = GPUCeleryExecutor-path,LocalExecutor``). The scheduler
places each GPU task with the same cycle as :class:`gpusched.airflow.executor.GPUExecutor`
(:class:`gpusched.airflow.gpu_scheduling.GPUScheduling`), writes the allocation to the shared
ledger, and only then sends the task to the Celery queue of the GPU host that owns the devices,
``gpusched@<host>`` — so a task's devices are known before it is sent and it never waits on a
worker. Every other workload goes to its own ``queue`` exactly as under CeleryExecutor.

On each GPU host, ``gpusched agent --host-name H`` registers the host's devices under ``H`` and
heartbeats, and ``airflow celery worker --queues gpusched@H`` (environment ``GPUSCHED_HOST=H``)
runs the tasks; the task-side listener (:mod:`gpusched.airflow.listener`) reads the allocation
from the ledger, exports exactly its devices' variables and refuses to run on any other host.
A host whose heartbeat stops for ``[gpusched] host_timeout_seconds`` is lost: its allocations are
released and its tasks failed ("node lost"), so Airflow retries them on another host.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from airflow.providers.celery.executors.celery_executor import CeleryExecutor

from gpusched.airflow.authoring import is_gpu_task
from gpusched.airflow.executor_compat import celery_send, save_task_event
from gpusched.airflow.gpu_cycle import Launch
from gpusched.airflow.gpu_scheduling import GPUScheduling
from gpusched.airflow.keys import ti_key_of
from gpusched.errors import ConfigurationError
from gpusched.ledger.hosts import LAUNCH_EVENT, HostState, host_queue

if TYPE_CHECKING:
    from gpusched.ledger import Ledger

__all__ = ["GPUCeleryExecutor"]


class GPUCeleryExecutor(CeleryExecutor):
    """CeleryExecutor plus GPU placement, allocation, routing to the owning host's queue and release."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        team = f"/{self.team_name}" if self.team_name else ""
        holder = f"GPUCeleryExecutor@{socket.gethostname()}{team}"
        self.gpu = GPUScheduling(self, _CeleryDispatcher(self), holder=holder)

    @property
    def ledger(self) -> Ledger:
        """The shared allocation ledger."""
        return self.gpu.ledger

    @property
    def gpu_running(self) -> dict[Any, str]:
        """Airflow key -> ledger key of dispatched GPU work."""
        return self.gpu.gpu_running

    def start(self) -> None:
        """Check the broker and the ledger, then release allocations of tasks that are gone."""
        super().start()
        self.gpu.start_process()
        self.check_broker()
        self.check_ledger()
        self.gpu.reconcile()

    def check_ledger(self) -> None:
        """Migrate the shared ledger; ConfigurationError (one line) when it cannot be reached."""
        try:
            self.ledger.migrate()
        except Exception as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise ConfigurationError(
                f"GPUCeleryExecutor cannot open the gpusched ledger ({exc.__class__.__name__}: {first}); "
                "set GPUSCHED_DB_URL to the shared PostgreSQL database every GPU host's agent uses"
            ) from exc

    def check_broker(self) -> None:
        """Raise ConfigurationError when the Celery broker does not answer."""
        try:
            with self.celery_app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=2, interval_start=0.5, interval_step=0.5, timeout=5)
        except Exception as exc:
            url = self.celery_app.conf.broker_url or ""
            safe = url.split("@")[-1] if "@" in url else url
            raise ConfigurationError(
                f"GPUCeleryExecutor cannot reach the Celery broker {safe!r} ({exc.__class__.__name__}); "
                "start it or fix [celery] broker_url (AIRFLOW__CELERY__BROKER_URL)"
            ) from exc

    def end(self, *args: Any, **kwargs: Any) -> None:
        """End as CeleryExecutor does; forget the waiting records of what never started."""
        super().end(*args, **kwargs)
        self.gpu.end(list(self.queued_tasks.values()))

    def try_adopt_task_instances(self, tis: Any) -> Any:
        """Adopt as CeleryExecutor does; adopted GPU tasks keep their allocations (leases renewed)."""
        not_adopted = super().try_adopt_task_instances(tis)
        left = {ti.key for ti in not_adopted}
        for ti in tis:
            if ti.key in left:
                continue
            ledger_key = ti_key_of(ti)
            alloc = self.gpu._safe(lambda k=ledger_key: self.ledger.get(k))
            if alloc is not None and alloc.released_at is None:
                self.gpu.gpu_running[ti.key] = ledger_key
        return not_adopted

    def revoke_task(self, *, ti: Any, **kwargs: Any) -> None:
        """Revoke in Celery and release the task's devices."""
        super().revoke_task(ti=ti)
        self.gpu.revoke(ti)

    def queue_workload(self, workload: Any, session: Any, **kwargs: Any) -> None:
        """Queue as CeleryExecutor does, remembering when a GPU workload started to wait."""
        super().queue_workload(workload, session)
        self.gpu.queued(workload)

    def _process_workloads(self, workload_items: Any) -> None:
        plain = [w for w in workload_items if not is_gpu_task(w)]
        if plain:  # exactly as CeleryExecutor: each to its own queue
            celery_send(self, plain)
        self.gpu.schedule([w for w in workload_items if is_gpu_task(w)])

    def log_task_event(self, *, event: str, extra: str, ti_key: Any) -> None:
        """Write the event-log row (Audit Log, ``/api/v2/eventLogs``) now, in its own session."""
        save_task_event(self, event=event, extra=extra, ti_key=ti_key)

    def change_state(
        self, key: Any, state: Any, info: Any = None, remove_running: bool = True, **kwargs: Any
    ) -> None:
        """Record the state as CeleryExecutor does; release the devices once the task ended."""
        super().change_state(key, state, info, remove_running=remove_running)
        self.gpu.finished(key, state)

    def sync(self) -> None:
        """Poll Celery (releasing finished GPU tasks), renew leases, handle lost hosts."""
        super().sync()
        self.gpu.periodic()


class _CeleryDispatcher:
    """Sends a launch to the Celery queue of the GPU host that owns its devices."""

    def __init__(self, executor: GPUCeleryExecutor) -> None:
        self.executor = executor
        self._hosts: dict[str, tuple[str, str]] = {}

    def _host_of(self, node: str) -> tuple[str, str] | None:
        if node not in self._hosts:
            self._hosts = self.executor.ledger.node_hosts()
        return self._hosts.get(node)

    def refuse(self, launch: Launch) -> str | None:
        nodes = sorted({s.node for s in launch.shares})
        if len(nodes) > 1:
            return (f"placed across {len(nodes)} nodes ({', '.join(nodes)}); a task runs on one host: "
                    "write a request bigger than one node as a multi-node gang (gpusched.airflow.gang)")
        self._hosts = {}  # fresh host states for every launch
        found = self._host_of(nodes[0])
        if found is None:
            return (f"node {nodes[0]} has no GPU host agent; run `gpusched agent --host-name {nodes[0]}` "
                    "beside its Celery worker")
        if found[1] != HostState.LIVE:
            return f"GPU host {found[0]} is {found[1]}; waiting for its agent"
        return None

    def dispatch(self, workload: Any, launch: Launch) -> None:
        found = self._host_of(launch.shares[0].node)
        assert found is not None
        queue = host_queue(found[0])
        # The task side on that host reads its environment (devices, rendezvous) and host from here.
        self.executor.ledger.record_event(LAUNCH_EVENT, launch.key, env=dict(launch.env), host=found[0])
        routed = workload.model_copy(update={"ti": workload.ti.model_copy(update={"queue": queue})})
        celery_send(self.executor, [routed])
