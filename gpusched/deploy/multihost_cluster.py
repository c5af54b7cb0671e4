"""A multi-host Airflow deployment on one machine, for the multi-host test, benchmark and demo.

Real processes only, all on 127.0.0.1: ``redis-server`` (Celery broker), a throwaway PostgreSQL
(``scripts/start_postgres.sh``: Airflow's metadata, the Celery result backend and the gpusched
ledger), ``airflow scheduler`` (with :class:`gpusched.airflow.celery_executor.GPUCeleryExecutor`
or any executor list), ``airflow api-server`` and ``airflow dag-processor``; and per GPU host one
``airflow celery worker --queues gpusched@<host>`` plus one ``gpusched agent --host-name <host>
--address 127.0.0.1`` (every host is this machine), each host's processes found by their environment so that
:meth:`LocalCluster.kill_host` can SIGKILL them all like a machine dying (task processes
included), :meth:`LocalCluster.kill_worker` kill only the worker, :meth:`LocalCluster.freeze_host`
/ :meth:`LocalCluster.thaw_host` stop and continue a host, and
:meth:`LocalCluster.stop_broker` / :meth:`LocalCluster.start_broker` take Redis down and bring it
back on the same port. The hosts' slices of the simulated fleet are the
nodes of the fleet file named after them.

Standby hosts (``standby=``) are declared standby at start (``gpusched agent --host-name H
--standby``) and their worker and agent are not started: :meth:`LocalCluster.serve_power_requests`
stands in for the machines' power controllers (IPMI, Redfish, a cloud API), carrying out the
requests a ``GPUSCHED_SCALER`` command leaves in a folder — ``activate`` starts the named hosts
(:meth:`LocalCluster.start_host`), ``release`` stops them (:meth:`LocalCluster.stop_host`).

``LocalCluster(..., role_env=compose_environments())`` boots it with the environment that
``docker-compose.yaml``'s ``celery`` profile gives each of those processes (read from the YAML,
anchors and merges resolved), keeping only this machine's addresses, paths and hardware
(:data:`LOCATION_VARS`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpusched.deploy.airflow_instance import free_port, poll_until
from gpusched.errors import ConfigurationError
from gpusched.paths import include_dir

__all__ = ["COMPOSE_CELERY_SERVICES", "COMPOSE_FILE", "LOCATION_VARS", "LocalCluster", "compose_environment",
           "compose_environments", "free_port", "processes_with"]

REPO = Path(__file__).resolve().parents[2]  # gpusched/deploy/ → the repository

COMPOSE_FILE = REPO / "docker-compose.yaml"

COMPOSE_CELERY_SERVICES: Mapping[str, str] = {
    "api-server": "airflow-apiserver",
    "dag-processor": "airflow-dag-processor",
    "scheduler": "airflow-scheduler-celery",
    "worker": "airflow-worker-gpu-host-a",
    "agent": "gpusched-agent-gpu-host-a",
}
"""The compose service (``celery`` profile) whose environment each role of the cluster takes
(every GPU host's worker and agent take the first host's; the host name is the cluster's)."""

LOCATION_VARS: frozenset[str] = frozenset({
    "AIRFLOW_CONFIG",
    "AIRFLOW__CELERY__BROKER_URL",
    "AIRFLOW__CELERY__RESULT_BACKEND",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC",
    "GPUSCHED_BACKEND",
    "GPUSCHED_DB_URL",
    "GPUSCHED_FLEET",
    "GPUSCHED_HOST",
    "GPUSCHED_HOST_ADDRESS",
})
"""Variables that say where things are in a compose deployment (container host names, mounted
paths, which machine, its GPUs): :func:`compose_environments` leaves them out, the cluster sets
its own. Every other variable is taken as compose gives it."""

_COMPOSE_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def compose_environment(service: str, path: Path = COMPOSE_FILE) -> dict[str, str]:
    """The environment ``service`` of compose file ``path`` declares, as compose resolves it.

    YAML anchors, aliases and ``<<`` merges are resolved by the loader; the list form
    (``KEY=VALUE``) is read too; ``${NAME:-default}`` / ``${NAME-default}`` take their default and
    ``${NAME}`` is empty (the operator's shell and ``.env`` are not this machine's), ``$$`` is ``$``.

    Raises:
        ConfigurationError: the file cannot be read, or has no such service.
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text())  # the safe loader resolves ``<<`` merges
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigurationError(f"cannot read compose file {path}: {exc}") from exc
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not isinstance(services.get(service), dict):
        raise ConfigurationError(f"compose file {path} has no service {service!r}; name one of its services")
    raw = services[service].get("environment") or {}
    if isinstance(raw, list):
        raw = dict(str(item).partition("=")[::2] for item in raw)

    def interpolate(match: re.Match[str]) -> str:
        return "$" if match.group(0) == "$$" else (match.group(3) or "")

    return {str(k): _COMPOSE_VAR.sub(interpolate, "" if v is None else str(v)) for k, v in raw.items()}


def compose_environments(
    path: Path = COMPOSE_FILE, services: Mapping[str, str] = COMPOSE_CELERY_SERVICES
) -> dict[str, dict[str, str]]:
    """Role (``scheduler``, ``worker`` …) → the environment compose gives its service in ``path``,
    without :data:`LOCATION_VARS`: the ``role_env`` of a :class:`LocalCluster`."""
    return {role: {k: v for k, v in compose_environment(service, path).items() if k not in LOCATION_VARS}
            for role, service in services.items()}


def processes_with(marks: Mapping[str, str]) -> list[int]:
    """The pids of this machine's processes whose environment holds every ``name=value`` of
    ``marks`` (read from ``/proc``; processes of other users are skipped)."""
    wanted = {f"{k}={v}".encode() for k, v in marks.items()}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ:
            pids.append(int(entry.name))
    return sorted(pids)


class LocalCluster:
    """Control host + GPU hosts as local processes; ``stop()`` (or ``with``) ends every one of them.

    Args:
        base: an empty folder for homes, logs and the PostgreSQL cluster.
        dags: DAG files to copy into the DAGs folder (name -> source).
        hosts: GPU host names (nodes of ``fleet``).
        fleet: the simulated fleet file (default: the package's ``fleets/multihost.yaml``).
        executor: ``[core] executor``.
        env: extra environment for every process (``AIRFLOW__…`` settings).
        worker_concurrency: Celery worker slots per host.
        scheduler_env: extra environment for the scheduler only (see :meth:`restart_scheduler`).
        role_env: environment per role (``api-server``, ``dag-processor``, ``scheduler``,
            ``worker``, ``agent``) over the cluster's defaults, e.g. :func:`compose_environments`;
            the cluster's addresses and paths, ``env`` and ``scheduler_env`` still win.
        broker_appendonly: run Redis with its append-only file (what it holds survives a
            restart, as in ``docker-compose.yaml``); default off, so a restart loses it.
        standby: GPU hosts (of ``hosts``) that start powered off: declared standby in the ledger,
            their worker and agent not started (see :meth:`serve_power_requests`).
        agent_args: extra ``gpusched agent`` arguments for every host's agent (e.g.
            ``--scale-after 0``).
    """

    def __init__(
        self,
        base: Path,
        dags: Mapping[str, str],
        *,
        hosts: Sequence[str] = ("host-a", "host-b"),
        fleet: Path | None = None,
        executor: str = "gpusched.airflow.celery_executor.GPUCeleryExecutor",
        env: Mapping[str, str] | None = None,
        worker_concurrency: int = 2,
        scheduler_env: Mapping[str, str] | None = None,
        role_env: Mapping[str, Mapping[str, str]] | None = None,
        broker_appendonly: bool = False,
        standby: Sequence[str] = (),
        agent_args: Sequence[str] = (),
    ) -> None:
        self.base = base
        self.hosts = tuple(hosts)
        self.logs = base / "logs"
        self.out = base / "out"
        self.home = base / "home"
        self.dags = base / "dags"
        for folder in (self.logs, self.out, self.home, self.dags):
            folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.out, 0o777)
        for name, source in dags.items():
            (self.dags / name).write_text(source)
        self.worker_concurrency = worker_concurrency
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._pgdir: Path | None = None
        self.api_port = free_port()
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.db_url = ""
        self._left: list[Any] = []  # psutil.Process of what a kill_worker left running
        self._executor = executor
        self._fleet = fleet or include_dir() / "fleets" / "multihost.yaml"
        self._extra = dict(env or {})
        self.scheduler_env: dict[str, str] = dict(scheduler_env or {})
        self.role_env: dict[str, dict[str, str]] = {role: dict(e) for role, e in (role_env or {}).items()}
        self.env: dict[str, str] = {}
        self._locations: dict[str, str] = {}
        self.broker_appendonly = broker_appendonly
        self.redis_port = 0
        self._stopped: set[str] = set()  # control-host processes stopped on purpose (the broker)
        unknown = sorted(set(standby) - set(self.hosts))
        if unknown:
            raise ConfigurationError(f"standby host(s) {', '.join(unknown)} are not among hosts {self.hosts}")
        self.standby = tuple(standby)
        self.agent_args = list(agent_args)
        self._power: threading.Thread | None = None
        self._power_stop = threading.Event()
        self._power_lock = threading.Lock()

    # ---- start / stop ----------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Start PostgreSQL, Redis, migrate, then api-server, dag-processor, hosts and scheduler."""
        if shutil.which("redis-server") is None:
            raise ConfigurationError("redis-server is not installed; run scripts/setup.sh (apt redis-server)")
        self._pgdir = Path(tempfile.mkdtemp(prefix="gpusched-pg-"))
        os.chmod(self._pgdir, 0o755)
        started = subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), str(self._pgdir)],
                                 capture_output=True, text=True, timeout=120)
        if started.returncode != 0:
            raise ConfigurationError(f"PostgreSQL did not start: {started.stderr.strip()[-500:]}")
        self.db_url = started.stdout.strip()
        self.redis_port = redis_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
        env.update({  # defaults: a role_env (the compose file's) replaces them
            "AIRFLOW__CORE__EXECUTOR": self._executor,
            "AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE": "2",
            "AIRFLOW__CELERY__SYNC_PARALLELISM": "1",
            "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "gpusched.airflow.celery_config.CELERY_CONFIG",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__API_AUTH__JWT_SECRET": "gpusched-local-cluster",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__GPUSCHED__HOST_TIMEOUT_SECONDS": "10",
        })
        self._locations = {  # where things are on this machine: always the cluster's
            "PYTHONPATH": str(REPO),
            "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW_CONFIG": str(self.home / "airflow.cfg"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.db_url,
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": self.db_url,  # psycopg 3 is async too
            "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{redis_port}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.db_url,
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__API__PORT": str(self.api_port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_HOST": "127.0.0.1",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(free_port()),
            "GPUSCHED_DB_URL": self.db_url,
            "GPUSCHED_BACKEND": "simulated",
            "GPUSCHED_FLEET": str(self._fleet),
            "GPUSCHED_TEST_OUT": str(self.out),
        }
        env.update(self._locations)
        env.update(self._extra)
        self.env = env
        self.start_broker()
        migrated = subprocess.run([*self._airflow, "db", "migrate"], env=env, cwd=REPO, capture_output=True,
                                  text=True, timeout=600)
        if migrated.returncode != 0:
            raise ConfigurationError(f"airflow db migrate failed: {migrated.stderr.strip()[-800:]}")
        self._spawn("api-server", [*self._airflow, "api-server", "--port", str(self.api_port)],
                    self._role("api-server"))
        self._spawn("dag-processor", [*self._airflow, "dag-processor"], self._role("dag-processor"))
        for host in self.hosts:
            if host in self.standby:
                self.declare_standby(host)
            else:
                self.start_host(host)
        self._spawn("scheduler", [*self._airflow, "scheduler"], self._role("scheduler", self.scheduler_env))
        return self

    def start_host(self, host: str) -> None:
        """Start (or restart) GPU host ``host``: its agent and its Celery worker."""
        host_env = {"GPUSCHED_HOST": host, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port())}
        # Every "host" is this machine: loopback reaches each gang member, so say it explicitly
        # (an agent refuses a loopback address it only resolved).
        self._spawn(f"{host}-agent", [sys.executable, "-m", "gpusched.cli", "agent", "--host-name", host,
                                      "--address", "127.0.0.1", "--port", "0", "--interval", "30",
                                      "--heartbeat", "2", "--host-timeout", "10", *self.agent_args],
                    self._role("agent", host_env))
        self.start_worker(host, host_env)

    def declare_standby(self, host: str) -> None:
        """Declare GPU host ``host`` standby in the ledger (``gpusched agent --host-name H
        --standby``: its devices registered, powered off), as an operator does before powering
        the machine down."""
        env = {**self.env, **self._role("agent", {"GPUSCHED_HOST": host})}
        done = subprocess.run([sys.executable, "-m", "gpusched.cli", "agent", "--host-name", host,
                               "--address", "127.0.0.1", "--standby"], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env=env)
        if done.returncode != 0:
            raise ConfigurationError(f"declaring {host} standby failed: {done.stderr.strip()[-500:]}")

    def running(self, host: str) -> bool:
        """Whether the agent or the worker of GPU host ``host`` runs (a started host)."""
        return any(name in self.procs and self.procs[name].poll() is None
                   for name in (f"{host}-agent", f"{host}-worker"))

    def stop_host(self, host: str, timeout: float = 30.0) -> None:
        """Power GPU host ``host`` off in order: SIGTERM its worker and agent (each process
        group), SIGKILL what is left after ``timeout`` s. Its idle host's processes end; the
        ledger's view of it is the scale-in's (:meth:`gpusched.ledger.Ledger.standby_host`)."""
        procs = [self.procs[name] for name in (f"{host}-worker", f"{host}-agent") if name in self.procs]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group: celery's pool children too
            proc.wait(timeout=10)

    def serve_power_requests(self, folder: Path, interval: float = 0.5) -> None:
        """Act as the standby hosts' power controllers: every ``interval`` s, carry out each
        ``*.json`` request in ``folder`` (oldest first; what a ``GPUSCHED_SCALER`` command got on
        stdin): ``{"action": "activate", "activate": [hosts]}`` starts each named standby host not
        running (:meth:`start_host`), ``{"action": "release", "release": [hosts]}`` stops each
        named host (:meth:`stop_host`). A request done is renamed ``*.done``; one that failed
        ``*.failed`` (the reason in ``power.log``). Runs until :meth:`stop`."""
        folder.mkdir(parents=True, exist_ok=True)

        def serve() -> None:
            import json

            while not self._power_stop.wait(interval):
                for request in sorted(folder.glob("*.json")):
                    try:
                        payload = json.loads(request.read_text())
                        with self._power_lock:
                            self._power_request(payload)
                        request.rename(request.with_suffix(".done"))
                    except Exception as exc:  # keep serving; the test reads power.log
                        with (self.logs / "power.log").open("a") as sink:
                            sink.write(f"{request.name}: {exc!r}\n")
                        request.rename(request.with_suffix(".failed"))

        self._power = threading.Thread(target=serve, name="gpusched-power", daemon=True)
        self._power.start()

    def _power_request(self, payload: Mapping[str, Any]) -> None:
        action = payload.get("action")
        names = [str(n) for n in payload.get(str(action), []) or []]
        with (self.logs / "power.log").open("a") as sink:
            sink.write(f"{time.time():.1f} {action} {', '.join(names)}\n")
        for name in names:
            if name not in self.hosts:
                raise ConfigurationError(f"no GPU host {name!r} in this cluster")
            if action == "activate" and not self.running(name):
                self.start_host(name)
            elif action == "release":
                self.stop_host(name)

    def start_worker(self, host: str, host_env: Mapping[str, str] | None = None) -> None:
        """Start (or restart, after :meth:`kill_worker`) the Celery worker of GPU host ``host``."""
        env = dict(host_env or {"GPUSCHED_HOST": host,
                                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port())})
        self._spawn(f"{host}-worker", [*self._airflow, "celery", "worker", "--queues",
                                       f"gpusched@{host},default", "--celery-hostname", f"{host}@%h",
                                       "--concurrency", str(self.worker_concurrency), "--without-mingle",
                                       "--without-gossip"], self._role("worker", env))

    def restart_scheduler(self, env: Mapping[str, str] | None = None) -> None:
        """Stop the scheduler (SIGTERM, SIGKILL of its group after 30 s) and start it again with
        ``env`` (it becomes :attr:`scheduler_env`) on top of the cluster's environment, e.g. another
        ``[gpusched] preemption``; the other processes keep running. Call it with no GPU task in
        flight: the executor forgets what it was doing (its allocations are reconciled at start)."""
        proc = self.procs["scheduler"]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # children left in its group
        self.scheduler_env = dict(env or {})
        self._spawn("scheduler", [*self._airflow, "scheduler"], self._role("scheduler", self.scheduler_env))

    def start_broker(self) -> None:
        """Start Redis (again, on the same port and folder) and wait until it answers PING."""
        folder = self.base / "redis"
        folder.mkdir(exist_ok=True)
        self._spawn("redis", ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save",
                              "", "--dir", str(folder), "--appendonly",
                              "yes" if self.broker_appendonly else "no"])
        self._stopped.discard("redis")
        poll_until("Redis to answer", self._broker_answers, timeout=30, interval=0.2)

    def stop_broker(self) -> None:
        """SIGKILL Redis, as a broker crash (without ``broker_appendonly`` what it held is lost)."""
        proc = self.procs["redis"]
        self._stopped.add("redis")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def _broker_answers(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def host_pids(self, host: str) -> list[int]:
        """Every live process of GPU host ``host`` in this cluster: its worker and agent, those
        found by the environment they inherit, and everything they started, in any process group
        or session (Airflow's task supervisor and task process start one of their own, with an
        environment of their own)."""
        import psutil

        # The processes this cluster started for the host, and those marked by their environment
        # (a process that sets its title, as Celery's do, may lose its environment's record).
        pids = set(processes_with({"GPUSCHED_HOST": host, "GPUSCHED_DB_URL": self.db_url}))
        pids.update(proc.pid for name, proc in self.procs.items()
                    if name in (f"{host}-worker", f"{host}-agent") and proc.poll() is None)
        for pid in list(pids):
            with contextlib.suppress(psutil.Error):
                pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        return sorted(pids)

    def kill_host(self, host: str) -> None:
        """SIGKILL every process of GPU host ``host`` — worker, agent and the task processes they
        started — at once, as a machine dying takes them all."""
        pids = self.host_pids(host)  # before any dies: an orphan leaves the worker's process tree
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for role in ("worker", "agent"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[f"{host}-{role}"].pid, signal.SIGKILL)
        for role in ("worker", "agent"):
            self.procs[f"{host}-{role}"].wait(timeout=30)

    def kill_worker(self, host: str) -> None:
        """SIGKILL only the Celery worker of ``host`` and its pool: its agent and the task
        processes it started live on (as when the worker alone crashes or is OOM-killed)."""
        proc = self.procs[f"{host}-worker"]
        import psutil

        for pid in self.host_pids(host):  # the survivors, for stop()
            with contextlib.suppress(psutil.Error):
                self._left.append(psutil.Process(pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def freeze_host(self, host: str) -> list[int]:
        """SIGSTOP every process of ``host`` (a hung machine, or one behind a network partition that
        keeps running nothing further); returns the pids, for :meth:`thaw_host`."""
        pids = self.host_pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return pids

    def thaw_host(self, host: str, pids: Sequence[int] | None = None) -> None:
        """SIGCONT the processes :meth:`freeze_host` stopped (default: every process of ``host``)."""
        for pid in self.host_pids(host) if pids is None else pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL of each process group) and PostgreSQL; the
        hosts' task processes, and those a :meth:`kill_worker` left behind, are SIGKILLed first
        (they run in sessions of their own)."""
        import psutil

        self._power_stop.set()
        if self._power is not None:
            self._power.join(timeout=60)
        left = [p for p in self._left if p.is_running()]  # is_running: the same process, not a reused pid
        if self.db_url:
            for pid in (pid for host in self.hosts for pid in self.host_pids(host)):
                with contextlib.suppress(psutil.Error):
                    left.append(psutil.Process(pid))
        started = {proc.pid for proc in self.procs.values()}
        for process in left:
            if process.pid not in started:
                with contextlib.suppress(psutil.Error):
                    process.kill()
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group: celery's pool children too
            proc.wait(timeout=10)
        if self._pgdir is not None:
            subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), "--stop", str(self._pgdir)],
                           capture_output=True, timeout=120)
            self._pgdir = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- talking to it -------------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call the REST API (``/api/v2`` + path); raise AssertionError on an error status."""
        import httpx

        response = httpx.request(method, f"{self.url}/api/v2{path}", timeout=30, **kwargs)
        assert response.status_code < 300, f"{method} {path}: {response.status_code} {response.text}"
        return response.json()

    def healthy(self) -> bool:
        """Scheduler and dag-processor report healthy."""
        import httpx

        health = httpx.get(f"{self.url}/api/v2/monitor/health", timeout=5).json()
        return bool(health["scheduler"]["status"] == "healthy"
                    and health["dag_processor"]["status"] == "healthy")

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None) -> str:
        """Start a run of ``dag_id`` (with ``conf`` as its run configuration); its run id."""
        body: dict[str, Any] = {"logical_date": None}
        if conf is not None:
            body["conf"] = dict(conf)
        return str(self.api("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"])

    def unpause(self, dag_id: str) -> None:
        """Unpause ``dag_id`` (as an operator does where DAGs are paused at creation)."""
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def pools(self) -> dict[str, int]:
        """Airflow pool name → slots."""
        return {p["name"]: int(p["slots"]) for p in self.api("GET", "/pools", params={"limit": 100})["pools"]}

    def run_state(self, dag_id: str, run_id: str) -> str:
        """The state of one DAG run."""
        return str(self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"])

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """Every task instance of one run (mapped ones included)."""
        found: list[dict[str, Any]] = []
        while True:
            body = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances",
                            params={"limit": 100, "offset": len(found)})
            found.extend(body["task_instances"])
            if len(found) >= body["total_entries"] or not body["task_instances"]:
                return found

    def tail(self, chars: int = 2500) -> str:
        """The end of every process's log."""
        parts = []
        for name in self.procs:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
            parts.append(f"----- {name} -----\n{text[-chars:]}")
        return "\n".join(parts)

    def wait(self, what: str, check: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
        """:func:`~gpusched.deploy.airflow_instance.poll_until` ``check`` while the control-host
        processes live (a GPU host's may die: tests kill them on purpose; so may a stopped broker).

        Raises:
            AirflowBootError: a control-host process exited, or ``timeout`` s passed (with the
                logs' tails).
        """

        def exited() -> str | None:
            for name, proc in self.procs.items():
                if proc.poll() is not None and not name.startswith(self.hosts) and name not in self._stopped:
                    return f"{name} exited ({proc.returncode})"
            return None

        return poll_until(what, check, timeout=timeout, abort=exited, logs=self.tail, interval=interval)

    # ---- helpers -------------------------------------------------------------------------------

    def _role(self, role: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of one role's process over :attr:`env`: its ``role_env``, then the
        cluster's locations, ``env`` and ``extra`` (which win)."""
        return {**self.role_env.get(role, {}), **self._locations, **self._extra, **(extra or {})}

    @property
    def _airflow(self) -> list[str]:
        return [sys.executable, "-m", "airflow"]

    def _spawn(self, name: str, argv: list[str], extra: Mapping[str, str] | None = None) -> None:
        with (self.logs / f"{name}.log").open("ab") as sink:
            self.procs[name] = subprocess.Popen(argv, cwd=REPO, env={**self.env, **(extra or {})},
                                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
