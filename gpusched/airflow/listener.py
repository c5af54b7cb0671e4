"""Task-side listener: exports the assigned devices into the task process and releases them.

``on_task_instance_running`` runs in the task process after template rendering and before
``execute()``. Under the GPU executor the devices' variables are already in the environment
(``GPUSCHED_ALLOCATION`` and ``CUDA_VISIBLE_DEVICES`` …); under any other executor the
listener looks the allocation up in the ledger by task-instance key and exports it into
``os.environ``. Either way it writes the devices to the task log and records the task process
as a holder of the allocation (so crash recovery can tell whether it still runs).

``on_task_instance_success`` / ``_failed`` / ``_skipped`` release the allocation (idempotent with
the executor's own release), so the devices are free as soon as the task's work is done.

A GPU task that gpusched's executor did not place — ``airflow dags test``, ``airflow tasks test``,
``dag.test()``, or a plain executor — is a **test run** (:func:`place_test_run`): it is placed by
the scheduler's cycle against the ledger and fleet the main job uses, allocated under the holder
``test-run@<host>`` with a lease its process renews, recorded as a ``test_run`` ledger event,
its devices exported, and released (its environment restored) when it ends. When it cannot be
placed (no ledger, no fleet, nothing free) it runs with no device visible and one warning says
why — never with every GPU of the machine. The fault chain ignores test runs
(:func:`is_test_run`).

On a GPU host of a multi-host fleet (``GPUSCHED_HOST`` set, as for a Celery worker beside
``gpusched agent``) the allocation must be on that host's nodes: a task that landed anywhere
else (misrouting, a stale queue) refuses to run — it logs why and its process exits before
``execute()``, so the try fails and is retried through the executor.

Registered by ``plugins/gpusched_plugin.py``. Light at import: Airflow's hook marker and the
standard library; the ledger is imported only for GPU tasks.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from airflow.listeners import hookimpl

from gpusched import settings
from gpusched.airflow.authoring import is_gpu_task, request_from_executor_config
from gpusched.errors import AllocationConflictError, WrongHostError
from gpusched.hardware.envexport import ALLOCATION_VAR, allocation_from_env, devices_env
from gpusched.records import AllocationStatus
from gpusched.scheduler.keys import ti_key_of

__all__ = [
    "HIDDEN",
    "HOST_VAR",
    "LAUNCH_WAIT_S",
    "TEST_RUN_HOLDER",
    "TEST_RUN_LEASE_S",
    "check_host",
    "export_devices",
    "is_test_run",
    "on_task_instance_failed",
    "on_task_instance_running",
    "on_task_instance_skipped",
    "on_task_instance_success",
    "place_test_run",
    "record_task_process",
    "release_devices",
    "warm_ledger",
]

_log = logging.getLogger("gpusched.listener")

HOST_VAR = "GPUSCHED_HOST"
"""Names the GPU host a Celery worker (and its agent) serve; set on every GPU host."""


def check_host(host: str, shares: Any, host_nodes: Any) -> None:
    """Raise WrongHostError unless every share is on one of ``host_nodes`` (the nodes of ``host``)."""
    nodes = sorted({s.node for s in shares})
    if not set(nodes) <= set(host_nodes):
        raise WrongHostError(
            f"this task's devices are on {', '.join(nodes)} but it landed on GPU host {host} "
            f"(nodes: {', '.join(sorted(host_nodes)) or 'none registered'}); refusing to run on "
            f"devices it does not own — misrouted or stale queue; it is retried on its own host"
        )


_LEDGERS: dict[str, Any] = {}


def _ledger() -> Any:
    """One ledger per task process (export and release share its connection pool)."""
    # local (also below): the ledger's SQL tables load on use; the plugin loads this in every Airflow process
    from gpusched.ledger import Ledger
    from gpusched.ledger.engine import default_url

    url = default_url()
    if url not in _LEDGERS:
        _LEDGERS[url] = Ledger(url, lock_wait_s=10.0)
    return _LEDGERS[url]


def warm_ledger() -> None:
    """Open this process's ledger and connect to it once (PostgreSQL only), then close the
    connection: processes forked from here — a Celery worker's pool and the task processes it
    forks — inherit the ledger with its SQL dialect already initialised and only open their own
    connection, instead of each learning the server anew (a few ms of every GPU task's start)."""
    ledger = _ledger()
    if ledger.engine.dialect.name != "postgresql":
        return  # SQLite has nothing to learn, and the worker must not create a ledger file
    with ledger.engine.connect():
        pass
    ledger.engine.dispose()


def _logger(task_instance: Any) -> Any:
    return getattr(task_instance, "log", None) or _log


def export_devices(task_instance: Any, environ: Any = None) -> dict[str, Any] | None:
    """Make sure the task's devices are in ``environ`` (default ``os.environ``); return the allocation.

    Returns None for a task that asked for no GPU, or when no allocation is found. On a GPU host
    (``GPUSCHED_HOST``) the allocation must be on that host (else WrongHostError), and this
    process is recorded as its ``task`` holder in the same ledger transaction that read it.
    """
    return _export(task_instance, environ)[0]


def _export(task_instance: Any, environ: Any = None) -> tuple[dict[str, Any] | None, bool]:
    """:func:`export_devices`, and whether this process was recorded as the allocation's holder."""
    env = os.environ if environ is None else environ
    key = ti_key_of(task_instance)
    recorded = False
    allocation = allocation_from_env(env)
    if allocation is not None and allocation.get("key") not in (None, key):
        allocation = None  # left over from another task: never trust it
    if allocation is None:
        if not is_gpu_task(task_instance):
            return None, False
        host = os.environ.get(HOST_VAR, "").strip()
        if host:
            variables, recorded = _host_variables(key, host)
        else:
            try:
                ledger = _ledger()
                found = ledger.get(key)
            except Exception:
                return place_test_run(task_instance, env), False  # no ledger here: one warning says so
            if found is None or found.released_at is not None or found.status == AllocationStatus.QUARANTINED:
                return place_test_run(task_instance, env), False
            from gpusched.ledger.hosts import LAUNCH_EVENT  # local: the ledger package, as in _ledger()

            launched = ledger.events(1, kinds=[LAUNCH_EVENT], subject=key)
            if launched:  # the Celery executor recorded the environment at dispatch
                variables = _launch_env(launched[0])
            else:
                variables = devices_env(found.shares, ledger.snapshot(), key=key)
        env.update(variables)
        allocation = allocation_from_env(env)
    visible = {
        name: env[name]
        for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                     "ASCEND_RT_VISIBLE_DEVICES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                     "GPUSCHED_MEMORY_LIMIT_BYTES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
                     "NODE_RANK", "NNODES", "LOCAL_WORLD_SIZE")
        if name in env
    }
    assert allocation is not None
    _logger(task_instance).info(
        "gpusched: devices for %s on node %s: %s (%s)",
        key, allocation.get("node"), " ".join(f"{k}={v}" for k, v in visible.items()),
        ", ".join(allocation.get("models") or []),
    )
    return allocation, recorded


def _host_variables(key: str, host: str) -> tuple[dict[str, str], bool]:
    """The environment of try ``key`` on GPU host ``host``, and whether this process was recorded
    as its holder; WrongHostError when it has no active allocation or its devices are elsewhere."""
    ledger = _ledger()
    start = ledger.start_on_host(key, host, _this_task_process())
    found = start.allocation
    if found is None:
        raise WrongHostError(
            f"no active GPU allocation for {key} (released or quarantined: host lost or "
            f"revoked); host {host} will not run it without devices"
        )
    launched = [start.launch] if start.launch is not None else _await_launch(ledger, key)
    if not launched or launched[0].detail.get("host") != host:
        check_host(host, found.shares, ledger.host_nodes(host))
    if launched:  # the Celery executor recorded the environment and the host at dispatch
        return _launch_env(launched[0]), start.recorded
    return devices_env(found.shares, ledger.snapshot(), key=key), False


def _launch_env(launch: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in dict(launch.detail.get("env") or {}).items()}


HIDDEN = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
"""The variables that show a process its GPUs; a test run that could not be placed sees none."""

TEST_RUN_HOLDER = "test-run"
"""Holder of a test run's allocation (``test-run@<host>``), as the fleet page shows it."""

TEST_RUN_LEASE_S = 300
"""Lease of a test run's allocation; its process renews it every fifth of that while the task
runs, so a test run killed without its release frees its devices within this time."""

# Per process: the test runs placed here (key -> what to undo at their end). dag.test() runs
# every task in one process, so the variables a test run exported are restored when it ends.
_TEST_RUNS: dict[str, dict[str, Any]] = {}


def is_test_run(key: str) -> bool:
    """Whether try ``key`` runs in this process as a test run (the fault chain ignores it)."""
    return key in _TEST_RUNS


def place_test_run(task_instance: Any, environ: Any = None) -> dict[str, Any] | None:
    """Place a GPU task that gpusched's executor did not place (see the module docstring) and
    export its devices into ``environ``; return the allocation, or None when it runs with no
    device visible (one warning says why)."""
    import socket
    import time

    env = os.environ if environ is None else environ
    key = ti_key_of(task_instance)
    previous = {name: env.get(name) for name in {*HIDDEN, ALLOCATION_VAR}}
    _TEST_RUNS[key] = {"environ": env, "previous": previous, "stop": None}
    try:
        shares, snapshot, ledger = _test_placement(task_instance, key, time.time())
    except _NotPlaced as why:
        env.update({name: "" for name in HIDDEN})
        env.pop(ALLOCATION_VAR, None)
        _logger(task_instance).warning(
            "gpusched: %s is a test run (not placed by gpusched's executor) and %s; it runs with no GPU "
            "visible. %s", key, why.reason, why.fix)
        return None
    host = socket.gethostname()
    variables = devices_env(shares, snapshot, key=key)
    previous.update({name: env.get(name) for name in variables if name not in previous})
    env.update(variables)
    _TEST_RUNS[key]["stop"] = _renew_in_background(ledger, key)
    devices = ", ".join(f"{s.node}:{s.index}" for s in shares)
    ledger.record_event("test_run", key, devices=[f"{s.node}:{s.index}" for s in shares], host=host)
    _logger(task_instance).info(
        "gpusched: test run of %s placed by the scheduler on %s (holder %s@%s; released when the task "
        "ends)", key, devices, TEST_RUN_HOLDER, host)
    return allocation_from_env(env)


class _NotPlaced(Exception):
    """Why a test run gets no devices, and what would give it some."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def _test_placement(task_instance: Any, key: str, now: float) -> tuple[Any, Any, Any]:
    """The shares the scheduler's cycle gives test run ``key`` on the ledger's fleet now, already
    allocated; raises _NotPlaced."""
    import socket

    from airflow.configuration import conf

    # local: the ledger and the scheduler's cycle load SQL tables, only for a test run's placement
    from gpusched.ledger.liveness import current_process
    from gpusched.placement import Policy
    from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide, running_tasks
    from gpusched.scheduler.quota import cycle_quota

    task = getattr(task_instance, "task", None)
    config = getattr(task, "executor_config", None) if task is not None else None
    request = request_from_executor_config(config if config is not None
                                           else getattr(task_instance, "executor_config", None))
    if request is None:
        raise _NotPlaced("its GPU request cannot be read", "Check its gpu(...) arguments.")
    fix = ("Start the main job once (scripts/run.sh: it creates the ledger and records the fleet), or "
           "set GPUSCHED_DB_URL to the ledger the executor uses.")
    try:
        ledger = _ledger()
        snapshot, active = ledger.cycle_view(now)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise _NotPlaced(f"the gpusched ledger cannot be read ({exc.__class__.__name__}: {first})",
                         fix) from None
    if not any(True for _ in snapshot.devices()):
        raise _NotPlaced("the gpusched ledger knows no GPU fleet", fix)
    policy = Policy.configured(settings.get_str("policy", conf), settings.get_str("policy_parts", conf))
    reply = decide(CycleRequest((PendingWork(key, request, now),), snapshot, policy,
                                tuple(running_tasks(active)), now, cycle_quota(ledger, snapshot, now)))
    if not reply.launches:
        reason = reply.holds[0].reason if reply.holds else "the scheduler did not place it"
        raise _NotPlaced(f"the scheduler cannot place it now: {reason}",
                         "Wait for devices to free up, or run it through the executor.")
    shares = reply.launches[0].shares
    holder = f"{TEST_RUN_HOLDER}@{socket.gethostname()}"
    try:
        ledger.allocate(key, request, shares, holder=holder, lease_s=TEST_RUN_LEASE_S, now=now,
                        process=current_process("task"))
    except AllocationConflictError as exc:
        raise _NotPlaced(f"its devices were taken meanwhile ({exc})", "Run it again.") from None
    return shares, snapshot, ledger


def _renew_in_background(ledger: Any, key: str) -> Any:
    """Renew ``key``'s lease every fifth of :data:`TEST_RUN_LEASE_S` until the returned event is set."""
    import threading

    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(TEST_RUN_LEASE_S / 5):
            try:
                ledger.renew(key, TEST_RUN_LEASE_S)
            except Exception:  # released, or the ledger is away for a moment: the lease decides
                _log.debug("gpusched: could not renew the lease of test run %s", key, exc_info=True)

    threading.Thread(target=renew, name=f"gpusched-test-run-{key}", daemon=True).start()
    return stop


def _end_test_run(key: str) -> None:
    """Stop renewing test run ``key``'s lease and restore the variables it changed."""
    run = _TEST_RUNS.get(key)
    if run is None or run.get("ended"):
        return
    run["ended"] = True
    if run["stop"] is not None:
        run["stop"].set()
    env = run["environ"]
    for name, value in run["previous"].items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value


LAUNCH_WAIT_S = 10.0
"""How long a task on a GPU host waits for its ``launch`` event: the Celery executor records it
just after the send succeeded, so a fast worker may start the task first."""


def _await_launch(ledger: Any, key: str) -> list[Any]:
    import time

    from gpusched.ledger.hosts import LAUNCH_EVENT  # local: the ledger package, as in _ledger()

    deadline = time.monotonic() + LAUNCH_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.25)
        launched = ledger.events(1, kinds=[LAUNCH_EVENT], subject=key)
        if launched:
            return list(launched)
    return []


def release_devices(task_instance: Any, reason: str, *, succeeded: bool = False) -> bool:
    """Release the task's allocation in the ledger (``succeeded``: the task did); True when one
    was active."""

    key = ti_key_of(task_instance)
    allocation = allocation_from_env(os.environ)
    if not is_gpu_task(task_instance) and (allocation is None or allocation.get("key") != key):
        return False
    released = _ledger().release(key, reason=reason, succeeded=succeeded)
    if released is not None:
        _logger(task_instance).info("gpusched: released the devices of %s (%s)", key, reason)
    return released is not None


@hookimpl
def on_task_instance_running(previous_state: Any, task_instance: Any) -> None:
    """Export (or confirm) the task's devices and log them."""
    if ALLOCATION_VAR not in os.environ and not is_gpu_task(task_instance):
        return
    try:
        allocation, recorded = _export(task_instance)
    except WrongHostError as exc:
        _logger(task_instance).error("gpusched: %s", exc)
        # Airflow swallows listener exceptions; leaving the process is the only way not to run.
        raise SystemExit(f"gpusched: {exc}") from None
    except Exception:
        _logger(task_instance).exception("gpusched: could not export the task's devices")
        return
    if allocation is not None and not recorded:
        try:
            record_task_process(task_instance)
        except Exception:
            _logger(task_instance).exception("gpusched: could not record the task process")


def record_task_process(task_instance: Any) -> bool:
    """Record this process as the ``task`` holder of the task's active allocation."""
    return bool(_ledger().attach_process(ti_key_of(task_instance), _this_task_process()))


def _this_task_process() -> Any:
    from gpusched.ledger.liveness import current_process  # local: the ledger package, as in _ledger()

    return current_process("task")


@hookimpl
def on_task_instance_success(previous_state: Any, task_instance: Any) -> None:
    """Release the devices of a task that succeeded."""
    _release_quietly(task_instance, "task succeeded", succeeded=True)


@hookimpl
def on_task_instance_failed(previous_state: Any, task_instance: Any, error: Any) -> None:
    """Release the devices of a task that failed (or will be retried)."""
    _release_quietly(task_instance, "task failed")


@hookimpl
def on_task_instance_skipped(previous_state: Any, task_instance: Any) -> None:
    """Release the devices of a task that skipped itself."""
    _release_quietly(task_instance, "task skipped")


def _release_quietly(task_instance: Any, reason: str, *, succeeded: bool = False) -> None:
    if ALLOCATION_VAR not in os.environ and not is_gpu_task(task_instance):
        return
    key = ti_key_of(task_instance)
    try:
        if is_test_run(key):
            _end_test_run(key)
            if _TEST_RUNS[key]["stop"] is None:
                return  # it ran with no device visible: nothing was allocated
        release_devices(task_instance, reason, succeeded=succeeded)
    except Exception:
        _logger(task_instance).exception("gpusched: could not release the task's devices")
    finally:
        close_ledgers()


def close_ledgers() -> None:
    """Close this task process's ledger connections once its devices are released.

    The task's last ledger write is behind it. A connection still open when the process exits
    is closed by the kernel between the end of the task's output and the moment the process can
    be reaped, and Airflow's supervisor, woken by that end of output and finding the process not
    yet reaped, sleeps until its next heartbeat (``[workers] min_heartbeat_interval``, 5 s)
    before it notices: the Celery slot stays busy for it.
    """
    while _LEDGERS:
        _, ledger = _LEDGERS.popitem()
        try:
            ledger.close()
        except Exception:  # the release is done; a connection that will not close is the kernel's
            _log.debug("gpusched: closing the task's ledger connection failed", exc_info=True)
