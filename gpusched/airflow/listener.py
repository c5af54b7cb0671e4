"""Task-side listener: exports the assigned devices into the task process and releases them.

``on_task_instance_running`` runs in the task process after template rendering and before
``execute()``. Under the GPU executor the devices' variables are already in the environment
(``GPUSCHED_ALLOCATION`` and ``CUDA_VISIBLE_DEVICES`` …); under any other executor the
listener looks the allocation up in the ledger by task-instance key and exports it into
``os.environ``. Either way it writes the devices to the task log and records the task process
as a holder of the allocation (so crash recovery can tell whether it still runs).

``on_task_instance_success`` / ``_failed`` / ``_skipped`` release the allocation (idempotent with
the executor's own release), so the devices are free as soon as the task's work is done.

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

from gpusched.airflow.authoring import is_gpu_task
from gpusched.errors import WrongHostError
from gpusched.hardware.envexport import ALLOCATION_VAR, allocation_from_env, devices_env
from gpusched.scheduler.keys import ti_key_of

__all__ = [
    "HOST_VAR",
    "LAUNCH_WAIT_S",
    "check_host",
    "export_devices",
    "on_task_instance_failed",
    "on_task_instance_running",
    "on_task_instance_skipped",
    "on_task_instance_success",
    "record_task_process",
    "release_devices",
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


def _logger(task_instance: Any) -> Any:
    return getattr(task_instance, "log", None) or _log


def export_devices(task_instance: Any, environ: Any = None) -> dict[str, Any] | None:
    """Make sure the task's devices are in ``environ`` (default ``os.environ``); return the allocation.

    Returns None for a task that asked for no GPU, or when no allocation is found.
    """

    env = os.environ if environ is None else environ
    key = ti_key_of(task_instance)
    allocation = allocation_from_env(env)
    if allocation is not None and allocation.get("key") not in (None, key):
        allocation = None  # left over from another task: never trust it
    if allocation is None:
        if not is_gpu_task(task_instance):
            return None

        host = os.environ.get(HOST_VAR, "").strip()
        ledger = _ledger()
        found = ledger.get(key)
        if found is None or found.released_at is not None:
            if host:
                raise WrongHostError(
                    f"no active GPU allocation for {key} (released: host lost or revoked); "
                    f"host {host} will not run it without devices"
                )
            _logger(task_instance).warning(
                "gpusched: no active GPU allocation for %s; the task runs without device "
                "restriction. Run it under gpusched.airflow.executor.GPUExecutor.", key,
            )
            return None
        from gpusched.ledger.hosts import LAUNCH_EVENT  # local: the ledger package, as in _ledger()

        launched = ledger.events(1, kinds=[LAUNCH_EVENT], subject=key)
        if not launched and host:
            launched = _await_launch(ledger, key)
        if launched:  # the Celery executor recorded the environment and the host at dispatch
            detail = launched[0].detail
            if host and detail.get("host") != host:
                check_host(host, found.shares, ledger.host_nodes(host))
            variables = {str(k): str(v) for k, v in dict(detail.get("env") or {}).items()}
        else:
            if host:
                check_host(host, found.shares, ledger.host_nodes(host))
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
    return allocation


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


def release_devices(task_instance: Any, reason: str) -> bool:
    """Release the task's allocation in the ledger; True when one was active."""

    key = ti_key_of(task_instance)
    allocation = allocation_from_env(os.environ)
    if not is_gpu_task(task_instance) and (allocation is None or allocation.get("key") != key):
        return False
    released = _ledger().release(key, reason=reason)
    if released is not None:
        _logger(task_instance).info("gpusched: released the devices of %s (%s)", key, reason)
    return released is not None


@hookimpl
def on_task_instance_running(previous_state: Any, task_instance: Any) -> None:
    """Export (or confirm) the task's devices and log them."""
    if ALLOCATION_VAR not in os.environ and not is_gpu_task(task_instance):
        return
    try:
        allocation = export_devices(task_instance)
    except WrongHostError as exc:
        _logger(task_instance).error("gpusched: %s", exc)
        # Airflow swallows listener exceptions; leaving the process is the only way not to run.
        raise SystemExit(f"gpusched: {exc}") from None
    except Exception:
        _logger(task_instance).exception("gpusched: could not export the task's devices")
        return
    if allocation is not None:
        try:
            record_task_process(task_instance)
        except Exception:
            _logger(task_instance).exception("gpusched: could not record the task process")


def record_task_process(task_instance: Any) -> bool:
    """Record this process as the ``task`` holder of the task's active allocation."""
    from gpusched.ledger.liveness import current_process  # local: the ledger package, as in _ledger()

    return bool(_ledger().attach_process(ti_key_of(task_instance), current_process("task")))


@hookimpl
def on_task_instance_success(previous_state: Any, task_instance: Any) -> None:
    """Release the devices of a task that succeeded."""
    _release_quietly(task_instance, "task succeeded")


@hookimpl
def on_task_instance_failed(previous_state: Any, task_instance: Any, error: Any) -> None:
    """Release the devices of a task that failed (or will be retried)."""
    _release_quietly(task_instance, "task failed")


@hookimpl
def on_task_instance_skipped(previous_state: Any, task_instance: Any) -> None:
    """Release the devices of a task that skipped itself."""
    _release_quietly(task_instance, "task skipped")


def _release_quietly(task_instance: Any, reason: str) -> None:
    if ALLOCATION_VAR not in os.environ and not is_gpu_task(task_instance):
        return
    try:
        release_devices(task_instance, reason)
    except Exception:
        _logger(task_instance).exception("gpusched: could not release the task's devices")
