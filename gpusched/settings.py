"""gpusched's settings: the ``[gpusched]`` options and the ``GPUSCHED_*`` variables, declared once.

:data:`OPTIONS` declares every ``[gpusched]`` option the way Airflow providers declare theirs
(description, type, default, example); the provider info's ``config`` section
(:func:`gpusched.provider_info.get_provider_info`, shown by ``airflow config list --section
gpusched``) is generated from it, and the readers below use it for defaults and types. Values come
from the config the caller passes: the team-scoped config of the executor that reads them
(``self.conf``); ``AIRFLOW__GPUSCHED__<OPTION>`` overrides the file as for any Airflow option.
This module imports no Airflow: code outside ``gpusched/airflow`` reads its ``GPUSCHED_*``
variables (:data:`ENV_VARS`) and its own defaults instead.

:data:`ENV_VARS` lists every ``GPUSCHED_*`` environment variable gpusched or its scripts read.
:func:`parse_bool` is the one parser for boolean settings and switches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from gpusched.errors import ConfigurationError

__all__ = [
    "ENV_VARS", "OPTIONS", "SECTION", "EnvVar", "Option", "default", "env_bool", "get_bool", "get_float",
    "get_int", "get_str", "parse_bool", "provider_config",
]

SECTION = "gpusched"

OptionType = Literal["string", "integer", "float", "boolean"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True)
class Option:
    """One ``[gpusched]`` option: its type, default (as Airflow stores it: a string) and docs."""

    name: str
    type: OptionType
    default: str
    description: str
    example: str | None = None


@dataclass(frozen=True)
class EnvVar:
    """One ``GPUSCHED_*`` environment variable, who reads it and what it does."""

    name: str
    read_by: str
    description: str


OPTIONS: tuple[Option, ...] = (
    Option("policy", "string", "gpusched",
           "Placement policy of the GPU executor: gpusched (topology- and heterogeneity-aware), "
           "fgd, fgd-full, fgd-lookahead, fgd-memory (fragmentation only; see docs/benchmarks.md), "
           "first-fit, best-fit or random.", "best-fit"),
    Option("policy_parts", "string", "",
           "Changes to the parts of the chosen policy's profile (docs/placement.md, Profiles and "
           "parts), comma-separated: swap a part (queue=fifo, chooser=exact, tiebreak=earliest), set "
           "a parameter (queue.halving_s=43200, chooser.levels=100, tiebreak.ties=8), a score's weight "
           "(score.locality=0.5; on = its default weight, off leaves it out) or switch an optional "
           "filter (filter.reservations=off, filter.reservations.critical_priority=50). Empty: the "
           "profile as it is.", "score.locality=0.5, tiebreak=earliest"),
    Option("lease_seconds", "integer", "600",
           "Seconds an allocation's lease lasts without a heartbeat renewing it; an expired lease "
           "is released (a crashed scheduler never holds devices forever).", "300"),
    Option("fail_unschedulable", "boolean", "True",
           "Fail a GPU task at once when its request can never fit this fleet, instead of letting "
           "it wait.", "False"),
    Option("over_budget", "string", "finish",
           "What happens to running GPU work whose tenant crosses its hard GPU-hour budget (the "
           "quota file's budgets), as Slurm's GrpTRESMins: finish (let it finish; the tenant's new "
           "tasks wait for the next period) or stop (fail the task now with the reason).", "stop"),
    Option("preemption", "string", "off",
           "Whether a waiting GPU task may stop running ones to get devices: off; priority (stop "
           "running tasks of strictly lower priority); partitions (also take back capacity another "
           "partition borrowed beyond its share); service (Tiresias-style: also running tasks of "
           "the same priority whose Gittins index, from the run-time distribution of similar "
           "finished tasks and the GPU-time they have had, is less than half the waiting task's; "
           "the queue is ordered by the same index); migrate (move running single-GPU tasks to a "
           "faster GPU model when the gain beats the restart cost: the simulator's migration rule, "
           "with the throughput_file). Victims and movers get a notice, then SIGTERM, and are "
           "requeued without losing a try.", "priority"),
    Option("preemption_grace_seconds", "float", "30",
           "Seconds a preempted task has, after its notice (gpusched.airflow.checkpoint.preempted()), to "
           "checkpoint before it is stopped; Airflow then sends SIGTERM and SIGKILL 5 s later. A "
           "task that reports a checkpoint after the notice is stopped at once.", "120"),
    Option("preemption_min_runtime_seconds", "float", "300",
           "A GPU task that has run for less than this is never preempted (no thrashing of fresh "
           "work). A try requeued by a preemption is also not preempted again until it reports a "
           "checkpoint.", "600"),
    Option("preemption_max_unsaved_seconds", "float", "600",
           "A GPU task that has run for more than this since its last reported checkpoint (or its "
           "start) is not preempted, so a preemption throws away at most this much run time per GPU; "
           "a task that never checkpoints is preemptible only in its first this-many seconds. "
           "0: no limit.", "900"),
    Option("preemption_min_rerun_seconds", "float", "7200",
           "A try requeued by a preemption is not preempted again before it has run this long since "
           "its restart (besides reporting a checkpoint): a stopped wide task waits long to get its "
           "devices back. 0: the checkpoint alone.", "3600"),
    Option("throughput_file", "string", "",
           "JSON table of each job type's speed per GPU model (job type -> model -> steps/s, or "
           "Gavel's simulation_throughputs.json). A task names its row with gpu(job_type=...); "
           "placement prefers its fastest models and preemption = migrate moves it. Empty: the "
           "catalog's A100-equivalent speed for every task.", "/etc/gpusched/throughputs.json"),
    Option("migration_interval_seconds", "float", "360",
           "preemption = migrate: how often the executor runs the migration rule over its running "
           "single-GPU tasks; also the horizon over which a move must pay back its restart.", "600"),
    Option("migration_restart_seconds", "float", "60",
           "preemption = migrate: what one move costs (checkpoint, stop, restart and restore on the "
           "new device); a move is taken only when its throughput gain over the horizon exceeds "
           "it.", "120"),
    Option("migration_horizon", "string", "round",
           "preemption = migrate: round (a move must pay back within migration_interval_seconds) "
           "or age (a task that has run longer is credited its run time: for slow restarts).", "age"),
    Option("visible_devices_by_uuid", "boolean", "False",
           "Hand devices to tasks by UUID (CUDA_VISIBLE_DEVICES=GPU-...) instead of by index.", "True"),
    Option("replan_budget_ms", "float", "100",
           "Milliseconds per scheduling cycle for the genetic re-planner (DEAP) to improve the "
           "greedy placement of the pending batch (two or more tasks, some room free; never worse "
           "than greedy, never past the quota); 0 keeps the greedy plan.", "50"),
    Option("replan_weights", "string", "1,1,0.1",
           "Weights of the re-planner's objectives: latency (hours), fragmentation (stranded "
           "GPUs), energy (kWh), three comma-separated numbers.", "1,2,0.5"),
    Option("workload_drift", "float", "0.1",
           "How far the estimated mix of request shapes (what the fragmentation measure expects, "
           "estimated from the pending and running GPU tasks) may drift, as a total variation "
           "distance 0..1, before the executor re-estimates it and rebuilds its placement engine; "
           "0 re-estimates every cycle.", "0.05"),
    Option("pool_sync", "boolean", "",
           "Keep the Airflow pools gpu_training / gpu_burst / gpu_dev sized to the usable GPUs "
           "(70/20/10). Empty: follow the GPUSCHED_POOL_SYNC variable.", "True"),
    Option("sync_inventory_on_start", "boolean", "True",
           "Discover the hardware (or the simulated fleet) into the ledger when the executor "
           "starts.", "False"),
    Option("wait_for_api_seconds", "float", "90",
           "On start, wait this long for Airflow's execution API to answer before dispatching "
           "anything; 0 does not wait.", "30"),
    Option("ledger_wait_seconds", "float", "5",
           "The most one ledger operation of the executor waits for a lock; a ledger stuck longer "
           "is left alone that long and the GPU workloads stay queued, so the scheduler loop never "
           "stalls.", "10"),
    Option("host_timeout_seconds", "float", "30",
           "Several GPU hosts (GPUCeleryExecutor): a host whose agent has not heartbeated for this "
           "long is lost; its allocations are released and its tasks failed so that Airflow retries "
           "them on another host. 0 never marks a host lost.", "60"),
    Option("dispatch_start_timeout_seconds", "float", "30",
           "Several GPU hosts (GPUCeleryExecutor): a GPU task sent to its host's queue that has not "
           "started after this long is checked; when its message is gone from the broker (a broker "
           "restarted without persistence) or its host is lost while the message still waits, the "
           "message is revoked, the devices released and the task placed again without spending a "
           "retry. 0 turns the check off.", "60"),
    Option("worker_prefetch_multiplier", "integer", "1",
           "Several GPU hosts (GPUCeleryExecutor): a host whose Celery worker slots are all busy may "
           "still be sent up to this many GPU tasks per slot that no host with a free slot can take, "
           "one for each of its running tries predicted to end within worker_prefetch_seconds: the "
           "task waits in the host's queue holding its devices and starts as soon as a slot frees, "
           "as the messages a plain Celery worker reserves ([celery] worker_prefetch_multiplier) do. "
           "1 (the default) shortened queued → running in the multi-host benchmark; 0 sends nothing "
           "to a host without a free slot.", "0"),
    Option("worker_prefetch_seconds", "float", "30",
           "Several GPU hosts (GPUCeleryExecutor): a host with busy slots takes prefetched tasks "
           "(worker_prefetch_multiplier) only for its running tries predicted to end within this "
           "many seconds (run times learnt from history, duration_history_days); keep it well below "
           "[scheduler] task_queued_timeout.", "10"),
    Option("reconcile_seconds", "float", "5",
           "How often the executor looks for allocations of gone or superseded task tries and "
           "releases them.", "30"),
    Option("duration_history_days", "float", "30",
           "Days of finished GPU tasks the executor learns run times from: a task without "
           "expected_duration is placed with the duration predicted from similar finished tasks "
           "(same DAG task, then tenant and GPU count, tenant, fleet; median of the 50 most recent, "
           "from 3 runs on). 0 turns prediction off.", "14"),
    Option("duration_refresh_seconds", "float", "60",
           "How often the executor reads the tasks finished since its last read to update its "
           "duration predictions.", "300"),
    Option("metrics_port", "integer", "0",
           "Port of the scheduler's Prometheus metrics (GET /metrics: decision latency, waiting "
           "tasks by reason kind, holds, preemptions, migrations, lost hosts, GPU-hours per tenant "
           "and partition; docs/metrics.md), served by the GPU executor in the scheduler process. "
           "0 serves none.", "9401"),
    Option("metrics_host", "string", "127.0.0.1",
           "Address the scheduler's metrics server binds (loopback by default; 0.0.0.0 to let a "
           "Prometheus on another host or container scrape it).", "0.0.0.0"),
)
_BY_NAME = {option.name: option for option in OPTIONS}

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("GPUSCHED_DB_URL", "ledger", "SQLAlchemy URL of the allocation ledger "
           "(default: SQLite under $AIRFLOW_HOME/gpusched)."),
    EnvVar("GPUSCHED_BACKEND", "hardware", "Hardware backend: auto, nvidia, amd, ascend or simulated "
           "(default auto)."),
    EnvVar("GPUSCHED_FLEET", "hardware", "Fleet YAML of the simulated backend "
           "(default: the fleet shipped in the package, gpusched/include/fleets/default.yaml)."),
    EnvVar("GPUSCHED_INCLUDE_DIR", "paths", "Folder to read the catalog, fleets and expectation "
           "suites from instead of the package's include/."),
    EnvVar("GPUSCHED_NODE_NAME", "hardware", "This host's node name (default: the host name)."),
    EnvVar("GPUSCHED_RACK", "hardware", "This host's rack (topology-aware placement)."),
    EnvVar("GPUSCHED_NODE_LABELS", "hardware", "This host's labels, k=v,k2=v2."),
    EnvVar("GPUSCHED_POOL_SYNC", "executor, authoring", "Boolean: size the gpu_<partition> pools "
           "to the fleet and assign them to GPU tasks."),
    EnvVar("GPUSCHED_QUOTA_FILE", "quota", "Tenant GPU-hour budget file "
           "(default $AIRFLOW_HOME/gpusched/quota.yaml)."),
    EnvVar("GPUSCHED_RECOVERY_INLINE", "fault listener", "Boolean (default true): the failure "
           "listener runs the fault chain at once; 0 leaves it to the fault-recovery DAG."),
    EnvVar("GPUSCHED_SCALER", "remediation, agent, capacity_forecast DAG", "Scaler that switches standby "
           "nodes on and back to standby: local (default), command:<command line> or webhook:<url>."),
    EnvVar("GPUSCHED_SCALE_IN_AFTER_S", "agent", "Seconds a standby node the scaler switched on stays "
           "idle before the agent sends it back to standby (default 1800; off = never)."),
    EnvVar("GPUSCHED_DYNAMIC_MIG", "agent", "Dynamic MIG provider: off (default), local (the simulated "
           "fleet), nvml (GPUs already in MIG mode) or amdsmi (AMD compute partition modes); "
           "re-partitions idle GPUs for waiting hard requests."),
    EnvVar("GPUSCHED_PROVISIONING_DELAY_S", "capacity_forecast DAG, agent", "Seconds a new node needs "
           "to come up (default 900); the agent asks again for a node switched on that is not up "
           "after twice that."),
    EnvVar("GPUSCHED_DEMAND_SOURCE", "capacity_forecast DAG", "Demand history: trace:<path> or synthetic."),
    EnvVar("GPUSCHED_FORECAST_CAPACITY", "capacity_forecast DAG", "Override of the fleet capacity."),
    EnvVar("GPUSCHED_FORECAST_FILE", "API", "Where the forecast JSON is written and read."),
    EnvVar("GPUSCHED_FORECAST_MODELS", "capacity_forecast DAG", "Comma-separated forecast models to try."),
    EnvVar("GPUSCHED_FORECAST_ORIGINS", "capacity_forecast DAG", "Number of backtest origins."),
    EnvVar("GPUSCHED_TRACES", "simulator", "Folder with the openb/, gavel/, philly/ traces."),
    EnvVar("GPUSCHED_AIRFLOW_API_URL", "REST client", "Airflow API base URL (default [api] base_url)."),
    EnvVar("GPUSCHED_AIRFLOW_API_USER", "REST client", "Airflow API user."),
    EnvVar("GPUSCHED_AIRFLOW_API_PASSWORD", "REST client", "Airflow API password."),
    EnvVar("GPUSCHED_ALLOCATION", "set for tasks", "JSON of the task's allocation (host view)."),
    EnvVar("GPUSCHED_PREEMPTED", "set for tasks", "1 once the task has been told it is preempted "
           "(set in the task process by gpusched.airflow.checkpoint.preempted() or its SIGTERM handler)."),
    EnvVar("GPUSCHED_MEMORY_LIMIT_BYTES", "set for tasks", "Device memory the task may use (fractions)."),
    EnvVar("GPUSCHED_MEMORY_FRACTION", "set for tasks", "Fraction of the device's memory (fractions)."),
    EnvVar("GPUSCHED_ISOLATION", "set for tasks", "hard when the task runs on a MIG instance or AMD "
           "partition of its own."),
    EnvVar("GPUSCHED_DEV_ROOT", "docker", "Root of the device files for container tasks (default /dev)."),
    EnvVar("GPUSCHED_EXAMPLE_STEPS", "example DAGs", "Training steps of the example DAG."),
    EnvVar("GPUSCHED_EXAMPLE_STEP_SECONDS", "example DAGs", "Pause per step of the example DAG."),
    EnvVar("GPUSCHED_AIRFLOW_HOME", "scripts/run.sh", "AIRFLOW_HOME of the local run (default .airflow)."),
    EnvVar("GPUSCHED_DAGS_FOLDER", "scripts/run.sh", "DAGs folder of the local run (default dags/)."),
    EnvVar("GPUSCHED_PORT", "scripts/run.sh", "UI port of the local run (default 8080)."),
    EnvVar("GPUSCHED_LISTEN", "scripts/run.sh", "Listen address of the local UI and API "
           "(default 127.0.0.1; 0.0.0.0 exposes them)."),
    EnvVar("GPUSCHED_VENV", "scripts/run.sh", "Virtual environment of the local run (default .venv)."),
    EnvVar("GPUSCHED_AGENT", "scripts/run.sh", "0 leaves the telemetry agent out."),
    EnvVar("GPUSCHED_AGENT_INTERVAL", "scripts/run.sh", "Seconds between agent cycles (default 10)."),
    EnvVar("GPUSCHED_METRICS_PORT", "scripts/run.sh, scripts/gpu_host.sh",
           "Port of the agent's /metrics (default 9400; 0 = none)."),
    EnvVar("GPUSCHED_METRICS_HOST", "scripts/gpu_host.sh",
           "Bind address of the agent's /metrics (default 127.0.0.1; the host's address or 0.0.0.0 "
           "lets Prometheus scrape it from another machine)."),
    EnvVar("GPUSCHED_STOP_TIMEOUT", "scripts/run.sh", "Seconds to wait for Airflow to stop (default 90)."),
    EnvVar("GPUSCHED_METADB", "scripts/run.sh", "Airflow's database when none is configured: postgres "
           "(default; a PostgreSQL run.sh starts and stops itself, SQLite when the server binaries are "
           "absent) or sqlite."),
    EnvVar("GPUSCHED_PGDATA", "scripts/run.sh", "Folder of that PostgreSQL (default $AIRFLOW_HOME/postgres; "
           "run as root, the postgres user's home when it cannot reach AIRFLOW_HOME)."),
    EnvVar("GPUSCHED_RUN_SIGINT_RESTORED", "scripts/run.sh", "Internal: set when the script has re-run "
           "itself with SIGINT restored (a background job starts with it ignored)."),
    EnvVar("GPUSCHED_DOCKERD_DIR", "scripts/start_dockerd.sh", "State folder of the test Docker engine."),
    EnvVar("GPUSCHED_IMAGE", "docker-compose.yaml", "Image of the Airflow services."),
    EnvVar("GPUSCHED_TEST_PG_URL", "tests, benchmarks", "PostgreSQL URL for the PostgreSQL tests."),
    EnvVar("GPUSCHED_HOST", "agent, Celery worker, task side",
           "On a GPU host of a multi-host fleet: its name; the agent registers the host under it, its "
           "Celery worker serves the queue gpusched@<name>, and a task refuses to run when its "
           "allocation is on another host."),
    EnvVar("GPUSCHED_HOST_ADDRESS", "agent, scripts/gpu_host.sh",
           "Address the other GPU hosts reach this one's Celery worker at (MASTER_ADDR of a multi-node "
           "gang whose rank 0 runs here). Default: the host name resolved (gpu_host.sh: the first "
           "address of hostname -I); a loopback result is refused, a loopback address set on purpose "
           "is taken (every GPU host on one machine)."),
    EnvVar("GPUSCHED_GANG", "task environment",
           "Set by the executor in a multi-node gang member's environment: the gang's id (with "
           "MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK, NNODES, LOCAL_WORLD_SIZE)."),
    EnvVar("GPUSCHED_TEST_OUT", "multihost test and benchmark DAGs",
           "Folder the tasks of the local multi-host deployment write their records to."),
    EnvVar("GPUSCHED_BENCH_TASKS", "scripts/bench_multihost.py DAGs",
           "Tasks per run of the multi-host benchmark DAGs."),
)


def parse_bool(value: str | bool, *, where: str = "setting") -> bool:
    """``1/true/yes/on`` → True, ``0/false/no/off`` or empty → False (any case); else a ConfigurationError."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigurationError(f"{where} = {value!r} is not a boolean; use true or false")


def env_bool(name: str, default: bool = False) -> bool:
    """The boolean environment switch ``name`` (unset → ``default``)."""
    raw = os.environ.get(name)
    return default if raw is None else parse_bool(raw, where=name)


def _option(name: str) -> Option:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigurationError(
            f"[{SECTION}] {name} is not a gpusched option; options: {', '.join(_BY_NAME)}"
        ) from None


def default(name: str) -> str:
    """The declared default of ``[gpusched] name`` (as Airflow stores it: a string); code outside
    ``gpusched/airflow`` (the simulator) starts from it."""
    return _option(name).default


def get_str(name: str, conf: Any) -> str:
    """The raw value of ``[gpusched] name`` from ``conf`` (an executor's team-scoped ``self.conf``,
    or anything with Airflow's ``conf.get(section, key, fallback=...)``), or the declared default."""
    option = _option(name)
    return str(conf.get(SECTION, name, fallback=option.default))


def _convert(name: str, conf: Any, kind: type[int] | type[float]) -> Any:
    raw = get_str(name, conf)
    try:
        return kind(raw.strip())
    except ValueError:
        raise ConfigurationError(
            f"[{SECTION}] {name} = {raw!r} is not {'an integer' if kind is int else 'a number'}; "
            f"e.g. {name} = {_option(name).example or _option(name).default}"
        ) from None


def get_int(name: str, conf: Any) -> int:
    """``[gpusched] name`` as an integer (a clear ConfigurationError when it is not one)."""
    return int(_convert(name, conf, int))


def get_float(name: str, conf: Any) -> float:
    """``[gpusched] name`` as a float (a clear ConfigurationError when it is not one)."""
    return float(_convert(name, conf, float))


def get_bool(name: str, conf: Any, *, empty: bool | None = None) -> bool:
    """``[gpusched] name`` as a boolean; ``empty`` is the value of an empty setting (default False)."""
    raw = get_str(name, conf)
    if not raw.strip() and empty is not None:
        return empty
    return parse_bool(raw, where=f"[{SECTION}] {name}")


def provider_config() -> dict[str, Any]:
    """The ``config`` part of the provider info: the ``[gpusched]`` section as Airflow declares it."""
    return {
        SECTION: {
            "description": "GPU-aware scheduling: placement policy, leases, re-planning and pools "
                           "of the gpusched executor.",
            "options": {
                option.name: {
                    "description": option.description,
                    "version_added": "0.1.0",
                    "type": option.type,
                    "example": option.example,
                    "default": option.default,
                }
                for option in OPTIONS
            },
        }
    }
