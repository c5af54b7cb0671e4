"""``gpusched agent``: sample this host's devices, run the alert rules, serve ``/metrics``.

    gpusched agent [--interval S] [--once] [--port P] [--host ADDR] [--backend KIND] [--fleet FILE]
                   [--db-url URL] [--window S] [--memory-growth MB_PER_MIN]
                   [--temp-limit VENDOR=CELSIUS ...] [--no-stop]
                   [--host-name NAME] [--heartbeat S] [--host-timeout S] [--no-worker-watch]
                   [--standby]

With ``--host-name NAME`` (or ``GPUSCHED_HOST``) the agent serves one GPU host of a multi-host
fleet: it registers the host's devices in the shared ledger under NAME (a name registered by a
live host with other devices is refused), heartbeats every ``--heartbeat`` seconds from its own
thread, and the fleet snapshot counts the host's devices only while it does. Run it beside the
host's Celery worker (``airflow celery worker --queues gpusched@NAME``). The host is registered at
``--address`` (or ``GPUSCHED_HOST_ADDRESS``), the address the other GPU hosts reach that worker at:
``MASTER_ADDR`` of a multi-node gang whose rank 0 runs there. Without one the host's name is
resolved, and a loopback result (127.0.0.0/8, ::1) is refused: the other hosts could not reach
it. A loopback address given explicitly is taken (every GPU host on one machine), with a warning
when other live hosts registered routable ones; a bind-everything address (0.0.0.0, ::) never is.

A GPU host is live only while its agent AND its Celery worker answer: with each heartbeat the
agent reports what it sees of the worker serving ``gpusched@NAME`` among this machine's processes
(running, stopped, missing; its slots), so a dead worker beside a live agent makes the host lost
within the host timeout. Before each heartbeat it also confirms the host's quarantined tries (a
lost host's, whose fate was unknown): a task process of such a try still running here is killed,
then its devices are released (``gpusched.agent.host_guard``). When the worker runs in another
container, share its PID namespace with the agent (compose: ``pid: service:<worker>``) and give
the worker container the host's name (``hostname: NAME``); ``--no-worker-watch`` counts the host
live on the agent's heartbeat alone.

``--host-name NAME --standby`` declares GPU host NAME a standby host and exits: its devices are
registered, its state is ``standby`` (its nodes are standby nodes the agents' standby scale-out
may switch on through ``GPUSCHED_SCALER``; the scheduler does not judge a standby host, so its
silence is no lost host). Run it once where the host's devices can be discovered, then power the
host off; switched on, its agent registers it live; released by the scale-in, it is standby again.

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
import sys
import threading
import time
from types import MappingProxyType
from typing import Any

from gpusched.catalog import Vendor
from gpusched.commands.args import finite_float, port
from gpusched.errors import ConfigurationError
from gpusched.faults.alerts import AlertConfig
from gpusched.faults.stopping import PidStopper
from gpusched.gang import is_loopback, is_unspecified
from gpusched.hardware.detect import detect_backend
from gpusched.hardware.host_slice import HostSlice
from gpusched.hardware.mig_provider import mig_provider_from_spec

__all__ = ["host_address", "register", "run"]


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
                        help="address other GPU hosts reach this one's worker at (MASTER_ADDR of "
                             "multi-node gangs; default $GPUSCHED_HOST_ADDRESS or this host's name "
                             "resolved, refused when that is loopback)")
    parser.add_argument("--heartbeat", type=finite_float(0.0, 3600.0, strict_min=True), default=5.0,
                        help="seconds between host heartbeats (default 5)")
    parser.add_argument("--host-timeout", type=finite_float(0.0, 86_400.0, strict_min=True), default=30.0,
                        help="a host silent this long counts as gone when its name is claimed again "
                             "(default 30; match [gpusched] host_timeout_seconds)")
    parser.add_argument("--no-worker-watch", action="store_true",
                        help="do not watch this host's Celery worker: the host counts live on the "
                             "agent's heartbeat alone (default: the worker serving gpusched@NAME must "
                             "run here too)")
    parser.add_argument("--standby", action="store_true",
                        help="with --host-name: declare the host standby (powered off, switched on by "
                             "the standby scale-out) and exit")
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

    # local: the ledger (sqlalchemy), psutil and prometheus_client load when the agent runs, not at
    # `gpusched --help`
    from gpusched.agent.host_guard import confirm_quarantined, watch_worker
    from gpusched.agent.prometheus import MetricsServer
    from gpusched.agent.telemetry import TelemetryAgent
    from gpusched.ledger import Ledger
    from gpusched.ledger.hosts import loopback_warning

    config = _config(args)
    kind = args.backend or ("simulated" if args.fleet else None)
    host = (args.host_name or os.environ.get("GPUSCHED_HOST") or "").strip()
    if host:
        os.environ.setdefault("GPUSCHED_NODE_NAME", host)  # a real host's node is named after it
    address = host_address(args.address) if host else ""
    backend = detect_backend(kind, fleet=args.fleet)
    ledger = Ledger(args.db_url)
    ledger.migrate()
    heartbeat = None
    if args.standby and not host:
        raise ConfigurationError("--standby declares one GPU host standby: give --host-name NAME too")
    if host:
        watch = None if args.no_worker_watch else watch_worker
        backend = HostSlice(backend, host)
        if args.standby:
            try:
                ledger.standby_host(host, backend.discover(), reason="declared standby")
            finally:
                backend.close()
                ledger.close()
            print(f"gpusched agent: GPU host {host} declared standby (switched on by the standby "
                  "scale-out through GPUSCHED_SCALER)", flush=True)
            return 0
        for line in confirm_quarantined(ledger, host):
            print(f"gpusched agent: {line}", flush=True)
        worker = watch(host) if watch else None
        record = ledger.register_host(host, backend.discover(), stale_after_s=args.host_timeout,
                                      address=address, worker=worker)
        print(f"gpusched agent: registered GPU host {host} at {address} (queue gpusched@{host})", flush=True)
        if record.state != "live":
            print(f"gpusched agent: {_worker_hint(host, worker)}", file=sys.stderr, flush=True)
        warning = loopback_warning(ledger.hosts())
        if warning:
            print(f"gpusched agent: warning: {warning}", file=sys.stderr, flush=True)
        if not args.once:
            heartbeat = _Heartbeat(ledger, host, args.heartbeat, watch, confirm_quarantined)
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


def host_address(given: str | None) -> str:
    """The address to register this GPU host at: ``given`` (``--address``), else
    ``$GPUSCHED_HOST_ADDRESS``, else this host's name resolved.

    Raises:
        ConfigurationError: the address is a bind-everything one (0.0.0.0, ::), or none was given
            and the name resolves to loopback (the line names a routable address of this host
            when its default route shows one).
    """
    import os

    explicit = (given or os.environ.get("GPUSCHED_HOST_ADDRESS") or "").strip()
    if explicit:
        if is_unspecified(explicit):
            raise ConfigurationError(
                f"--address {explicit} is a bind address, not one other hosts can connect to; give "
                "this host's routable address (--address or GPUSCHED_HOST_ADDRESS)")
        return explicit
    name, resolved = _resolved_name()
    if is_loopback(resolved):
        route = _route_address()
        example = f", e.g. --address {route} (this host's address on its default route)" if route else ""
        raise ConfigurationError(
            f"this host's name {name!r} resolves to the loopback address {resolved}, which the other "
            f"GPU hosts cannot reach as MASTER_ADDR of a multi-node gang; give its routable address "
            f"with --address or GPUSCHED_HOST_ADDRESS{example} (--address 127.0.0.1 only when every "
            "GPU host runs on this one machine)")
    return resolved


def _resolved_name() -> tuple[str, str]:
    import socket

    name = socket.gethostname()
    try:
        return name, socket.gethostbyname(name)
    except OSError:
        return name, name


def _route_address() -> str | None:
    """This host's source address towards the outside, or None (no default route)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            # connect() of a UDP socket sends nothing: it only picks the route and its source
            # address (192.0.2.1 is TEST-NET-1, never a real peer).
            probe.connect(("192.0.2.1", 9))
            address = str(probe.getsockname()[0])
    except OSError:
        return None
    return None if is_loopback(address) or is_unspecified(address) else address


def _worker_hint(host: str, worker: Any) -> str:
    state = worker.state if worker is not None else "unknown"
    return (f"GPU host {host} takes no work yet: its Celery worker (queue gpusched@{host}) is {state} "
            f"on this machine; start `airflow celery worker --queues gpusched@{host},default` here (in "
            "another container: share its PID namespace with the agent), or run the agent with "
            "--no-worker-watch")


class _Heartbeat(threading.Thread):
    """Every ``interval`` seconds, apart from the sampling cycle: confirm the host's quarantined
    tries (killing leftovers), look at its Celery worker (``watch``; None: not watched) and
    heartbeat with what it saw."""

    def __init__(self, ledger: Any, host: str, interval: float, watch: Any, confirm: Any) -> None:
        super().__init__(name=f"gpusched-heartbeat-{host}", daemon=True)
        self.ledger, self.host, self.interval, self.watch = ledger, host, interval, watch
        self.confirm = confirm  # host_guard.confirm_quarantined
        self._stop_event = threading.Event()
        self._worker_state: str | None = None

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                for line in self.confirm(self.ledger, self.host):
                    print(f"gpusched agent: {line}", flush=True)
                worker = self.watch(self.host) if self.watch is not None else None
                if worker is not None and worker.state != self._worker_state:
                    if self._worker_state is not None or worker.state != "running":
                        print(f"gpusched agent: the Celery worker of {self.host} is {worker.state}",
                              flush=True)
                    self._worker_state = worker.state
                self.ledger.heartbeat_host(self.host, worker=worker)
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
