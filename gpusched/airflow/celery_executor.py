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

Infrastructure failures are not task failures. A send the broker does not answer (refused, reset,
timed out) leaves the task queued — CeleryExecutor would fail the try — with its devices released,
and pauses GPU dispatch with one log line until the broker answers again
(:class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`); the fault chain never sees it and no
retry is spent. "Dispatched" is logged, and the ``launch`` event (the environment the task side
reads) recorded, only once the send succeeded. What was sent is watched
(:mod:`gpusched.airflow.dispatch_watch`): a task not started ``[gpusched]
dispatch_start_timeout_seconds`` after its send, whose message is gone from the broker (a Redis
restarted without persistence) or waits in a lost host's queue, is revoked, its devices released
and placed again, same try.

With ``[gpusched] pool_sync`` (default: ``GPUSCHED_POOL_SYNC``, on in the compose files) the
``gpu_<partition>`` pools that :func:`gpusched.airflow.authoring.gpu` assigns are created and
sized to the live hosts' GPUs exactly as under GPUExecutor (the shared hooks,
:mod:`gpusched.airflow.gpu_executor_hooks`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from airflow.providers.celery.executors.celery_executor import CeleryExecutor

from gpusched import settings
from gpusched.airflow.authoring import is_gpu_task
from gpusched.airflow.dispatch_watch import DispatchWatch
from gpusched.airflow.executor_compat import celery_send, celery_task_id
from gpusched.airflow.gpu_executor_hooks import GPUExecutorHooks
from gpusched.airflow.gpu_scheduling import GPUScheduling
from gpusched.errors import ConfigurationError, DispatchUnavailableError
from gpusched.ledger.hosts import LAUNCH_EVENT, HostState, host_queue
from gpusched.scheduler.cycle import Launch
from gpusched.scheduler.hosts import prefetch_room, slot_full_reason, worker_slot_use
from gpusched.scheduler.keys import ti_key_of

__all__ = ["GPUCeleryExecutor"]


class GPUCeleryExecutor(GPUExecutorHooks, CeleryExecutor):
    """CeleryExecutor plus GPU placement, allocation, routing to the owning host's queue and release."""

    tasks_outlive_executor = True  # Celery workers keep running them; the next scheduler adopts them

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        team = f"/{self.team_name}" if self.team_name else ""
        holder = f"GPUCeleryExecutor@{socket.gethostname()}{team}"
        self.gpu = GPUScheduling(self, _CeleryDispatcher(self), holder=holder)
        start_timeout = settings.get_float("dispatch_start_timeout_seconds", self.conf)
        self.watch = DispatchWatch(self, self.gpu, start_timeout)
        self.gpu.unstarted_hook = self.watch.host_lost

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
            self.ping_broker(retries=2, timeout=5)
        except Exception as exc:
            raise ConfigurationError(
                f"GPUCeleryExecutor cannot reach the Celery broker {self.broker_name!r} "
                f"({exc.__class__.__name__}); start it or fix [celery] broker_url "
                "(AIRFLOW__CELERY__BROKER_URL)"
            ) from exc

    @property
    def broker_name(self) -> str:
        """The broker URL without its credentials."""
        url = str(self.celery_app.conf.broker_url or "")
        return url.split("@")[-1] if "@" in url else url

    def ping_broker(self, *, retries: int = 1, timeout: float = 2.0) -> None:
        """Connect to the broker (raise what the connection raised when it does not answer)."""
        with self.celery_app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=retries, interval_start=0.5, interval_step=0.5,
                                         timeout=timeout)

    def try_adopt_task_instances(self, tis: Any) -> Any:
        """Adopt as CeleryExecutor does; adopted GPU tasks keep their allocations (leases renewed).

        A GPU task the previous executor never sent to Celery (still waiting for devices: no
        ``launch`` event in the ledger) is not adopted: Airflow pre-assigns its Celery id when it
        queues it, so CeleryExecutor would watch a Celery task that does not exist until
        ``task_queued_timeout``. Returned as not adopted, it is reset and queued to this executor.
        """
        never_sent = [ti for ti in tis if is_gpu_task(ti) and self._never_sent(ti)]
        if never_sent:
            self.log.info("gpusched: GPU tasks still waiting for devices (never sent to Celery), queued "
                          "again: %s", ", ".join(str(ti.key) for ti in never_sent))
        sent = [ti for ti in tis if all(ti is not n for n in never_sent)]
        not_adopted = [*never_sent, *super().try_adopt_task_instances(sent)]
        left = {ti.key for ti in not_adopted}
        for ti in tis:
            if ti.key in left:
                continue
            ledger_key = ti_key_of(ti)
            alloc = self.gpu._safe(lambda k=ledger_key: self.ledger.get(k))
            if alloc is not None and alloc.released_at is None:
                self.gpu.gpu_running[ti.key] = ledger_key
                self.watch.adopt(ti, self._workload_of)
        return not_adopted

    def _workload_of(self, ti: Any) -> Any:
        """The workload an adopted try is queued again as, should its dispatch be lost."""
        from airflow.executors.workloads import ExecuteTask

        return ExecuteTask.make(ti, generator=self.jwt_generator)

    def _never_sent(self, ti: Any) -> bool:
        """True when the ledger has no ``launch`` of ``ti``'s try (False when it cannot be read)."""
        key = ti_key_of(ti)
        launched = self.gpu._safe(lambda: bool(self.ledger.events(1, kinds=[LAUNCH_EVENT], subject=key)))
        return launched is False

    def revoke_task(self, *, ti: Any, **kwargs: Any) -> None:
        """Revoke in Celery and release the task's devices."""
        super().revoke_task(ti=ti)
        self.gpu.revoke(ti)

    def send_plain(self, workloads: list[Any]) -> None:
        """Send workloads without a GPU request to their own queue, exactly as CeleryExecutor."""
        celery_send(self, workloads)

    def sync(self) -> None:
        """Poll Celery (releasing finished GPU tasks; pools kept by the shared hooks), renew
        leases, handle lost hosts, re-place sent GPU tasks that will never start."""
        super().sync()
        self.gpu.periodic()
        if self.gpu.dispatch_down is None:  # a broker that does not answer cannot be looked into
            self.watch.check()


class _CeleryDispatcher:
    """Sends a launch to the Celery queue of the GPU host that owns its devices."""

    def __init__(self, executor: GPUCeleryExecutor) -> None:
        self.executor = executor
        self._hosts: dict[str, tuple[str, str]] = {}
        self._slot_use: dict[str, tuple[int, int]] = {}  # host -> (busy, slots), this cycle
        self._node_host: dict[str, str] = {}  # node -> host, this cycle
        self._room: dict[str, int] = {}  # host -> tasks it may hold beyond its slots, this cycle
        self._started: frozenset[str] = frozenset()  # tries whose task process runs, this cycle
        self.prefetch = settings.get_int("worker_prefetch_multiplier", executor.conf)
        self.prefetch_s = settings.get_float("worker_prefetch_seconds", executor.conf)

    def full_nodes(self, active: Sequence[Any]) -> dict[str, str]:
        """Nodes of live hosts whose Celery worker slots are all taken (node -> why), from the
        hosts' reported slots and the cycle's ``active`` allocations; :meth:`refuse` then counts
        this cycle's launches on top."""
        hosts = self.executor.ledger.hosts()
        self._hosts = self.executor.ledger.node_hosts()  # the cycle's host states (see refuse)
        self._room = {}
        if self.prefetch > 0:  # a try sent and still waiting in its queue frees no slot
            self._started = frozenset(a.key for a in active if any(p.role == "task" for p in a.processes))
        if not any(h.worker_slots for h in hosts):
            self._slot_use = {}
            return {}
        node_host = {node: host for node, (host, _) in self._hosts.items()}
        self._node_host = node_host
        use = self._slot_use = worker_slot_use(hosts, node_host, active)
        return {node: slot_full_reason(host, *use[host]) for node, host in node_host.items()
                if host in use and use[host][0] >= use[host][1]}

    def prefetch_nodes(self, running: Sequence[Any], now: float) -> frozenset[str]:
        if self.prefetch <= 0:
            return frozenset()
        started = [task for task in running if task.key in self._started]
        self._room = prefetch_room(self._slot_use, self._node_host, started, now,
                                   multiplier=self.prefetch, within_s=self.prefetch_s)
        return frozenset(node for node, host in self._node_host.items() if host in self._room)

    def _host_of(self, node: str) -> tuple[str, str] | None:
        if node not in self._hosts:
            self._hosts = self.executor.ledger.node_hosts()
        return self._hosts.get(node)

    def refuse(self, launch: Launch, *, prefetch: bool = False) -> str | None:
        nodes = sorted({s.node for s in launch.shares})
        if len(nodes) > 1:
            return (f"placed across {len(nodes)} nodes ({', '.join(nodes)}); a task runs on one host: "
                    "write a request bigger than one node as a multi-node gang (gpusched.airflow.gang)")
        # Host states as the cycle read them with its snapshot: a host lost since then is caught
        # by the dispatch watch (its queue's tries are placed again), so one read serves every launch.
        found = self._host_of(nodes[0])
        if found is None:
            return (f"node {nodes[0]} has no GPU host agent; run `gpusched agent --host-name {nodes[0]}` "
                    "beside its Celery worker")
        if found[1] != HostState.LIVE:
            return f"GPU host {found[0]} is {found[1]}; waiting for its agent"
        use = self._slot_use.get(found[0])
        if use is not None:
            busy, slots = use
            # A gang's members were placed together on hosts with free slots at the cycle's start;
            # refusing one now would break the gang, so they are only counted.
            room = self._room.get(found[0], 0) if prefetch else 0
            if busy >= slots + room and not launch.env.get("GPUSCHED_GANG"):
                return slot_full_reason(found[0], busy, slots)
            self._slot_use[found[0]] = (busy + 1, slots)
        return None

    def available(self) -> bool:
        try:
            self.executor.ping_broker()
        except Exception:
            return False
        return True

    def dispatch(self, workload: Any, launch: Launch) -> None:
        found = self._host_of(launch.shares[0].node)
        assert found is not None
        queue = host_queue(found[0])
        routed = workload.model_copy(update={"ti": workload.ti.model_copy(update={"queue": queue})})
        unsent = celery_send(self.executor, [routed], keep_unsent=True)
        if unsent:
            exc = next(iter(unsent.values()))
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise DispatchUnavailableError(f"the Celery broker {self.executor.broker_name!r} did not take "
                                           f"{launch.key} ({exc.__class__.__name__}: {first})")
        event = self.executor.event_buffer.get(workload.key)
        if event is not None and str(event[0]) == "failed":  # a send error that is not the broker's
            self.executor.gpu.release(workload.key, "the send to Celery failed; the try failed")
            raise RuntimeError(f"sending {launch.key} to Celery failed; CeleryExecutor failed the try")
        # The task side on that host reads its environment (devices, rendezvous) and host from here
        # (and waits a moment for it: the send came first).
        self.executor.ledger.record_event(LAUNCH_EVENT, launch.key, env=dict(launch.env), host=found[0])
        task_id = celery_task_id(self.executor, workload.key)
        if task_id is not None:
            self.executor.watch.sent(workload, ledger_key=launch.key, task_id=task_id, queue=queue,
                                     host=found[0], gang=launch.env.get("GPUSCHED_GANG"))
