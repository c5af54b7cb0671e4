"""The Airflow executor hooks that GPUExecutor and GPUCeleryExecutor share.

Both executors hand every GPU decision to :class:`gpusched.airflow.gpu_scheduling.GPUScheduling`
(``self.gpu``); this mixin is the one place where Airflow's executor calls reach it. A concrete
executor lists it before its Airflow base class and adds only :meth:`send_plain` (how a workload
without a GPU request is sent) and its own dispatcher.

It also keeps the partition pools (``gpu_training`` / ``gpu_burst`` / ``gpu_dev``) sized to the
ledger's fleet when ``[gpusched] pool_sync`` is on (default: ``GPUSCHED_POOL_SYNC``), for every
executor alike: the fleet is the ledger's snapshot — on several GPU hosts the nodes of live
hosts only, so a lost host's GPUs leave the pools until its agent is back
(:mod:`gpusched.airflow.pool_sync`).

Both start the scheduler's Prometheus endpoint in ``start()`` when ``[gpusched] metrics_port`` is
set (:mod:`gpusched.airflow.scheduler_metrics`) and stop it in ``end()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpusched import settings
from gpusched.airflow.authoring import POOL_SYNC_VAR, is_gpu_task
from gpusched.airflow.executor_compat import save_task_event
from gpusched.airflow.pool_sync import PoolSyncer
from gpusched.airflow.scheduler_metrics import serve, stop_serving

if TYPE_CHECKING:
    from airflow.executors.base_executor import BaseExecutor

    from gpusched.airflow.gpu_scheduling import GPUScheduling
    from gpusched.ledger import Ledger

    _ExecutorBase = BaseExecutor
else:
    _ExecutorBase = object

__all__ = ["GPUExecutorHooks"]


class GPUExecutorHooks(_ExecutorBase):
    """Queueing, dispatch split, completion and event-log hooks routed to ``self.gpu``."""

    gpu: GPUScheduling

    pool_check_seconds = 10.0
    """How often :meth:`sync` offers the fleet to the pool syncer (which writes only when its
    interval passed or the usable GPU count changed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool_syncer: PoolSyncer | None = None
        self._last_pool_check = float("-inf")
        if settings.get_bool("pool_sync", self.conf, empty=settings.env_bool(POOL_SYNC_VAR)):
            self._pool_syncer = PoolSyncer()

    def start(self) -> None:
        """Start as the base executor does, then serve the scheduler's metrics (``[gpusched]
        metrics_port``; 0, the default, serves none)."""
        super().start()
        serve(self.gpu.metrics, self.conf, self.log)

    def sync(self) -> None:
        """Sync as the base executor does, then keep the partition pools sized to the fleet."""
        super().sync()
        self.sync_pools()

    def sync_pools(self, now: float | None = None) -> bool:
        """Offer the ledger's fleet to the pool syncer, at most every :attr:`pool_check_seconds`
        (never while the ledger is unusable); True when a pool sync ran."""
        syncer = self._pool_syncer
        now = self.gpu.clock() if now is None else now
        if syncer is None or now - self._last_pool_check < self.pool_check_seconds:
            return False
        self._last_pool_check = now
        return bool(self.gpu._safe(lambda: syncer.maybe_sync(self.ledger.snapshot(now))))

    @property
    def ledger(self) -> Ledger:
        """The allocation ledger."""
        return self.gpu.ledger

    @property
    def gpu_running(self) -> dict[Any, str]:
        """Airflow key -> ledger key of dispatched GPU work."""
        return self.gpu.gpu_running

    def send_plain(self, workloads: list[Any]) -> None:
        """Send workloads without a GPU request exactly as the Airflow base executor would."""
        raise NotImplementedError

    def queue_workload(self, workload: Any, session: Any, **kwargs: Any) -> None:
        """Queue as the base executor does, remembering when a GPU workload started to wait."""
        super().queue_workload(workload, session)
        self.gpu.queued(workload)

    def _process_workloads(self, workloads: Any) -> None:
        plain = [w for w in workloads if not is_gpu_task(w)]
        if plain:
            self.send_plain(plain)
        self.gpu.schedule([w for w in workloads if is_gpu_task(w)])

    def log_task_event(self, *, event: str, extra: str, ti_key: Any) -> None:
        """Write the event-log row (Audit Log, ``/api/v2/eventLogs``) now, in its own session."""
        save_task_event(self, event=event, extra=extra, ti_key=ti_key)

    def change_state(
        self, key: Any, state: Any, info: Any = None, remove_running: bool = True, **kwargs: Any
    ) -> None:
        """Record the state as the base executor does; release the devices once the task ended."""
        super().change_state(key, state, info, remove_running=remove_running)
        self.gpu.finished(key, state)

    tasks_outlive_executor = False
    """True where the tasks run in other processes that go on when the executor ends (Celery
    workers): their allocations then stay held for the executor that adopts them."""

    def end(self, *args: Any, **kwargs: Any) -> None:
        """End as the base executor does, then forget what waits and release what is still held
        (unless :attr:`tasks_outlive_executor`)."""
        super().end(*args, **kwargs)
        stop_serving(self.gpu.metrics)
        self.gpu.end(list(self.queued_tasks.values()), release_running=not self.tasks_outlive_executor)
