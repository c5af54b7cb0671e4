"""Prometheus text exposition of device telemetry, with DCGM-exporter-compatible names.

:func:`render_metrics` (pure) turns the latest sample of each device, the fleet snapshot and the
active allocations into the Prometheus text format 0.0.4. Device metrics carry the names and
labels of NVIDIA's dcgm-exporter (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``), so
existing Grafana dashboards work unchanged — for AMD and Ascend devices too. gpusched's own
metrics are prefixed ``gpusched_``.

:class:`MetricsServer` serves ``GET /metrics`` with the standard library's threading HTTP server,
bound to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpusched.alerts import HasShares
from gpusched.model import DeviceSample, FleetSnapshot, Health

__all__ = ["CONTENT_TYPE", "MetricsServer", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MIB = 2**20

# name, type, help, value(sample) — the DCGM field names dcgm-exporter publishes.
_DCGM: tuple[tuple[str, str, str, Callable[[DeviceSample], float]], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda s: s.utilization_pct),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
     lambda s: s.memory_used_bytes // _MIB),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
     lambda s: max(0, s.memory_total_bytes - s.memory_used_bytes) // _MIB),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda s: s.temperature_mc / 1000),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda s: s.power_mw / 1000),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.",
     lambda s: s.ecc_uncorrected),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
     lambda s: s.xid_errors[-1] if s.xid_errors else 0),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


def _number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def render_metrics(
    samples: Iterable[DeviceSample],
    snapshot: FleetSnapshot,
    allocations: Sequence[HasShares] = (),
    *,
    counters: Mapping[tuple[str, str], int] | None = None,
    source: str | None = None,
) -> str:
    """The Prometheus text for the newest sample of each device plus gpusched's own gauges.

    Args:
        samples: readings (any number per device; the newest one counts).
        snapshot: the fleet (model, node, health, cordon of each device).
        allocations: active allocations (``gpusched_allocations`` and per-device share).
        counters: alert actions taken so far, keyed by (rule, action kind).
        source: backend name for ``gpusched_fleet_info`` (e.g. "simulated").
    """
    latest: dict[str, DeviceSample] = {}
    for sample in samples:
        old = latest.get(sample.uuid)
        if old is None or sample.taken_at >= old.taken_at:
            latest[sample.uuid] = sample
    device_labels: dict[str, str] = {}
    for device in snapshot.devices():
        device_labels[device.uuid] = _labels((
            ("gpu", str(device.index)), ("UUID", device.uuid),
            ("device", f"{device.vendor}{device.index}"), ("modelName", device.model),
            ("Hostname", device.node),
        ))
    out: list[str] = []
    for name, kind, help_text, value in _DCGM:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for uuid in sorted(latest):
            labels = device_labels.get(uuid) or _labels((("gpu", ""), ("UUID", uuid)))
            out.append(f"{name}{labels} {_number(value(latest[uuid]))}")
    milli: dict[str, int] = {}
    memory: dict[str, int] = {}
    for alloc in allocations:
        for share in alloc.shares:
            milli[share.uuid] = milli.get(share.uuid, 0) + share.milli
            memory[share.uuid] = memory.get(share.uuid, 0) + share.memory_bytes
    out += ["# HELP gpusched_allocations Active GPU allocations in the ledger.",
            "# TYPE gpusched_allocations gauge", f"gpusched_allocations {len(allocations)}"]
    out += ["# HELP gpusched_device_allocated_milli Compute share allocated on the device (1000 = whole).",
            "# TYPE gpusched_device_allocated_milli gauge"]
    out += [f"gpusched_device_allocated_milli{lab} {milli.get(u, 0)}" for u, lab in device_labels.items()]
    out += ["# HELP gpusched_device_allocated_memory_bytes Device memory allocated to tasks (bytes).",
            "# TYPE gpusched_device_allocated_memory_bytes gauge"]
    out += [f"gpusched_device_allocated_memory_bytes{lab} {memory.get(u, 0)}"
            for u, lab in device_labels.items()]
    health_lines: list[str] = []
    cordon_lines: list[str] = []
    for node in snapshot.nodes:
        for device in node.devices:
            lab = device_labels[device.uuid]
            for state in Health:
                health_lines.append(
                    f'gpusched_device_health{lab[:-1]},state="{state}"}} {int(device.health is state)}'
                )
            cordon_lines.append(f"gpusched_device_cordoned{lab} {int(device.cordoned or node.cordoned)}")
    out += ["# HELP gpusched_device_health Device health (1 for the current state).",
            "# TYPE gpusched_device_health gauge", *health_lines]
    out += ["# HELP gpusched_device_cordoned Whether the device (or its node) is cordoned.",
            "# TYPE gpusched_device_cordoned gauge", *cordon_lines]
    out += ["# HELP gpusched_alert_actions_total Alert actions applied by this agent.",
            "# TYPE gpusched_alert_actions_total counter"]
    out += [f"gpusched_alert_actions_total{_labels((('rule', r), ('action', k)))} {n}"
            for (r, k), n in sorted((counters or {}).items())]
    out += ["# HELP gpusched_fleet_info Where the fleet comes from (simulated fleets say so).",
            "# TYPE gpusched_fleet_info gauge",
            f"gpusched_fleet_info{_labels((('source', source or snapshot.source),))} 1"]
    return "\n".join(out) + "\n"


class MetricsServer:
    """``GET /metrics`` over HTTP on a daemon thread; ``render`` is called for every scrape.

    Bind address defaults to 127.0.0.1 (loopback only); ``port=0`` picks a free port, readable
    from :attr:`port` after :meth:`start`.
    """

    def __init__(self, render: Callable[[], str], host: str = "127.0.0.1", port: int = 9400) -> None:
        self._render = render
        self._host = host
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the requested one until started)."""
        return self._server.server_address[1] if self._server else self._port

    def start(self) -> None:
        """Bind and serve in the background (OSError if the port is taken)."""
        render = self._render

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = render().encode("utf-8")
                except Exception as exc:  # a scrape must answer, never kill the agent
                    self.send_error(500, f"rendering metrics failed: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds would flood the agent's output

        self._server = ThreadingHTTPServer((self._host, self._port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpusched-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
