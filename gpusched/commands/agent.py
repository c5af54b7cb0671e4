"""``gpusched agent``: sample this host's devices, run the alert rules, serve ``/metrics``.

    gpusched agent [--interval S] [--once] [--port P] [--host ADDR] [--backend KIND] [--fleet FILE]
                   [--db-url URL] [--window S] [--memory-growth MB_PER_MIN]
                   [--temp-limit VENDOR=CELSIUS ...] [--no-stop]
                   [--host-name NAME] [--heartbeat S] [--host-timeout S]

With ``--host-name NAME`` (or ``GPUSCHED_HOST``) the agent serves one GPU host of a multi-host
fleet: it registers the host's devices in the shared ledger under NAME (a name registered by a
live host with other devices is refused), heartbeats every ``--heartbeat`` seconds from its own
thread, and the fleet snapshot counts the host's devices only while it does. Run it beside the
host's Celery worker (``airflow celery worker --queues gpusched@NAME``).

Every interval: release allocations whose lease ran out (so a crashed executor's devices come
back even while no executor runs), sync the inventory (each minute), read every device into the
ledger, evaluate the alert rules over the last ``--window`` seconds, apply the actions (cordon,
health, stop the task whose device memory keeps growing) and refresh the Prometheus text served on
``http://HOST:PORT/metrics`` (127.0.0.1:9400 by default; ``--port 0`` disables the server).
``--once`` runs one cycle, prints what it did and exits (no server).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from types import MappingProxyType
from typing import Any

from gpusched.catalog import Vendor
from gpusched.commands.args import finite_float, port
from gpusched.errors import ConfigurationError
from gpusched.faults.alerts import AlertConfig
from gpusched.faults.stopping import PidStopper
from gpusched.hardware.detect import detect_backend
from gpusched.hardware.host_slice import HostSlice
from gpusched.hardware.mig_provider import mig_provider_from_spec

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``agent`` command to the ``gpusched`` parser."""
    parser = subparsers.add_parser(
        "agent", help="sample devices into the ledger, apply alert rules, serve /metrics",
        description="Per-host telemetry agent: sampling, alert rules and a Prometheus endpoint "
                    "with DCGM-compatible metric names.",
    )

    parser.add_argument("--interval", type=finite_float(0.0, 86_400.0, strict_min=True), default=10.0,
                        help="seconds between cycles (default 10)")
    parser.add_argument("--once", action="store_true", help="run one cycle, print it and exit")
    parser.add_argument("--port", type=port, default=9400,
                        help="port of the /metrics endpoint (default 9400; 0 = no server)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address of /metrics (default 127.0.0.1; 0.0.0.0 to expose)")
    parser.add_argument("--backend", choices=("auto", "nvidia", "amd", "simulated"), default=None,
                        help="hardware backend (default $GPUSCHED_BACKEND or auto)")
    parser.add_argument("--fleet", help="fleet YAML for the simulated backend")
    parser.add_argument("--db-url", default=None, help="ledger URL (default $GPUSCHED_DB_URL or SQLite)")
    parser.add_argument("--window", type=finite_float(0.0, 86_400.0 * 31, strict_min=True), default=300.0,
                        help="seconds of samples the alert rules look at (default 300)")
    parser.add_argument("--memory-growth", type=finite_float(0.0, strict_min=True), default=100.0,
                        help="device memory growth that stops a task, MB/min (default 100)")
    parser.add_argument("--temp-limit", action="append", default=[], metavar="VENDOR=CELSIUS",
                        help="over-temperature limit per vendor, e.g. nvidia=85 amd=100 (repeatable)")
    parser.add_argument("--scale-after", type=finite_float(0.0, 86_400.0 * 7), default=300.0,
                        metavar="SECONDS",
                        help="switch on a standby node when tasks waited this long for capacity it "
                             "gives (default 300; 0 = at once)")
    parser.add_argument("--no-scale", action="store_true",
                        help="never switch standby nodes on for waiting tasks")
    parser.add_argument("--no-stop", action="store_true",
                        help="record stop-task alerts but do not signal the task")
    parser.add_argument("--host-name", default=None,
                        help="serve GPU host NAME of a multi-host fleet: register it and heartbeat "
                             "(default $GPUSCHED_HOST; unset = single-host agent)")
    parser.add_argument("--address", default=None,
                        help="address other hosts reach this one at (rendezvous of multi-node gangs; "
                             "default $GPUSCHED_HOST_ADDRESS or this host's resolved name)")
    parser.add_argument("--heartbeat", type=finite_float(0.0, 3600.0, strict_min=True), default=5.0,
                        help="seconds between host heartbeats (default 5)")
    parser.add_argument("--host-timeout", type=finite_float(0.0, 86_400.0, strict_min=True), default=30.0,
                        help="a host silent this long counts as gone when its name is claimed again "
                             "(default 30; match [gpusched] host_timeout_seconds)")
    parser.set_defaults(func=run)


def _config(args: argparse.Namespace) -> Any:
    limits = dict(AlertConfig().temperature_limits_mc)
    for item in args.temp_limit:
        vendor, _, value = item.partition("=")
        try:
            limits[Vendor(vendor.strip().lower())] = int(float(value) * 1000)
        except ValueError:
            raise ConfigurationError(
                f"--temp-limit {item!r} is not VENDOR=CELSIUS; vendors: {', '.join(v.value for v in Vendor)}"
            ) from None
    return AlertConfig(
        memory_growth_bytes_per_min=int(args.memory_growth * 1_000_000),
        temperature_limits_mc=MappingProxyType(limits),
    )


def run(args: argparse.Namespace) -> int:
    """Run the agent; returns the exit code."""
    import os

    # local: the ledger (sqlalchemy) and prometheus_client load when the agent runs, not at `gpusched --help`
    from gpusched.agent.prometheus import MetricsServer
    from gpusched.agent.telemetry import TelemetryAgent
    from gpusched.ledger import Ledger

    config = _config(args)
    kind = args.backend or ("simulated" if args.fleet else None)
    host = (args.host_name or os.environ.get("GPUSCHED_HOST") or "").strip()
    if host:
        os.environ.setdefault("GPUSCHED_NODE_NAME", host)  # a real host's node is named after it
    backend = detect_backend(kind, fleet=args.fleet)
    ledger = Ledger(args.db_url)
    ledger.migrate()
    heartbeat = None
    if host:
        backend = HostSlice(backend, host)
        ledger.register_host(host, backend.discover(), stale_after_s=args.host_timeout,
                             address=_address(args.address))
        print(f"gpusched agent: registered GPU host {host} (queue gpusched@{host})", flush=True)
        if not args.once:
            heartbeat = _Heartbeat(ledger, host, args.heartbeat)
            heartbeat.start()

    agent = TelemetryAgent(backend, ledger, config=config, window_s=args.window,
                           stopper=None if args.no_stop else PidStopper(),
                           scale_after_s=None if args.no_scale else args.scale_after,
                           mig_provider=mig_provider_from_spec())
    try:
        if args.once:
            result = agent.cycle()
            print(f"gpusched agent: {agent.source}: {len(result.samples)} device(s) sampled, "
                  f"{len(result.actions)} action(s)")
            for line in result.applied:
                print(f"  {line}")
            return 0
        return _loop(agent, args, MetricsServer)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        backend.close()
        ledger.close()


def _address(given: str | None) -> str:
    import os
    import socket

    if given or os.environ.get("GPUSCHED_HOST_ADDRESS"):
        return str(given or os.environ["GPUSCHED_HOST_ADDRESS"])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


class _Heartbeat(threading.Thread):
    """Heartbeats GPU host ``host`` every ``interval`` seconds, apart from the sampling cycle."""

    def __init__(self, ledger: Any, host: str, interval: float) -> None:
        super().__init__(name=f"gpusched-heartbeat-{host}", daemon=True)
        self.ledger, self.host, self.interval = ledger, host, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.ledger.heartbeat_host(self.host)
            except Exception as exc:  # the database may be briefly away; keep trying
                print(f"gpusched agent: heartbeat of {self.host} failed: {exc}", flush=True)

    def stop(self) -> None:
        self._stop_event.set()


def _loop(agent: Any, args: argparse.Namespace, server_cls: Any) -> int:
    stop = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server = None
    agent.cycle()
    if args.port:
        server = server_cls(agent.metric_families, host=args.host, port=args.port)
        server.start()
        print(f"gpusched agent: {agent.source}; metrics on http://{args.host}:{server.port}/metrics",
              flush=True)
    try:
        while not stop.wait(max(0.1, args.interval)):
            started = time.monotonic()
            try:
                result = agent.cycle()
            except Exception as exc:  # one bad cycle (DB locked, driver hiccup) must not end the agent
                print(f"gpusched agent: cycle failed: {exc}", flush=True)
                continue
            for line in result.applied:
                print(f"gpusched agent: {line}", flush=True)
            if time.monotonic() - started > args.interval:
                print("gpusched agent: a cycle took longer than --interval; raise it", flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0
