"""The one error hierarchy of gpusched.

Every exception gpusched raises on purpose derives from :class:`GpuschedError`, so callers can
catch the whole family with one clause, and each message names the problem *and* the fix.

Hierarchy::

    GpuschedError
    ├── ConfigurationError          bad settings, environment, files or command-line arguments
    │   ├── FleetFileError          a fleet YAML that cannot be read or is inconsistent
    │   ├── TraceError              a trace file that cannot be read or has a bad row
    │   └── MissingExtraError       an optional dependency (the ``lab`` extra) is not installed
    ├── CatalogError                an accelerator model the catalog does not know
    ├── GPURequestError             a GPU request field that is invalid (raised at DAG parse time)
    ├── HardwareError               a vendor library failed (translated at the backend boundary)
    │   └── BackendUnavailableError the vendor library or its devices are absent
    ├── PlacementError              the placement engine was called wrongly
    ├── DispatchUnavailableError    the executor's way to its workers (the Celery broker) is down
    ├── LedgerError                 the allocation ledger refused or failed an operation
    │   ├── AllocationConflictError capacity was taken by someone else (retry next cycle)
    │   └── UnknownAllocationError  no such allocation / lease
    ├── TelemetryError              sampling, exporting or alerting failed
    ├── ForecastError               demand data failed validation or no model could be fitted
    └── ScalingError                a scaler provider could not apply a plan
"""

from __future__ import annotations

from collections.abc import Iterable

from gpusched.fields import safe_repr

__all__ = [
    "AllocationConflictError",
    "BackendUnavailableError",
    "CatalogError",
    "ConfigurationError",
    "DispatchUnavailableError",
    "FleetFileError",
    "ForecastError",
    "GPURequestError",
    "GpuschedError",
    "HardwareError",
    "HostConflictError",
    "LedgerError",
    "LedgerUnavailableError",
    "MissingExtraError",
    "PlacementError",
    "ScalingError",
    "TelemetryError",
    "TraceError",
    "UnknownAllocationError",
    "WrongHostError",
]


class GpuschedError(Exception):
    """Base of every error gpusched raises deliberately."""


class ConfigurationError(GpuschedError):
    """A setting, environment variable or configuration file is wrong."""


class FleetFileError(ConfigurationError):
    """A fleet description file cannot be read or describes an impossible fleet."""


class TraceError(ConfigurationError):
    """A job trace cannot be read, or one of its rows is invalid (the message names file, line, field)."""

    def __init__(self, path: object, problem: str, fix: str, *, line: int | None = None,
                 field: str | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        where = self.path + (f", line {line}" if line is not None else "")
        at = f", field {field!r}" if field is not None else ""
        super().__init__(f"trace file {where}{at}: {problem}; fix: {fix}")


class MissingExtraError(ConfigurationError):
    """An optional dependency is not installed; the message names the extra that brings it."""


class CatalogError(GpuschedError):
    """An accelerator model name that the catalog does not know."""


class GPURequestError(GpuschedError, ValueError):
    """One invalid field of a GPU request.

    Attributes:
        field: the request field at fault (for example ``"memory"``).
        value: the value that was given.
        accepted: a human description of what the field accepts.
    """

    def __init__(self, field: str, value: object, accepted: str, problem: str | None = None) -> None:
        self.field = field
        self.value = value
        self.accepted = accepted
        what = problem or f"{safe_repr(value)} is not valid"
        super().__init__(f"GPURequest.{field}: {what}; accepted: {accepted}")


class HardwareError(GpuschedError):
    """A vendor management library (NVML, AMD SMI, simulated) reported a failure."""


class BackendUnavailableError(HardwareError):
    """The vendor library is not installed or finds no device on this host."""


class PlacementError(GpuschedError):
    """The placement engine was called with inconsistent arguments."""


class DispatchUnavailableError(GpuschedError):
    """The executor's way to its workers (the Celery broker) did not answer; nothing was sent."""


class LedgerError(GpuschedError):
    """The allocation ledger refused or failed an operation."""


class LedgerUnavailableError(LedgerError):
    """The ledger database could not be reached, or stayed locked past the wait bound."""


class AllocationConflictError(LedgerError):
    """The capacity chosen was taken meanwhile; nothing was written. Re-plan and retry."""

    def __init__(self, message: str, devices: Iterable[str] = ()) -> None:
        self.devices = tuple(devices)
        super().__init__(message)


class UnknownAllocationError(LedgerError):
    """No allocation or lease exists under the given key."""


class HostConflictError(LedgerError):
    """A GPU host name is already registered, alive, with other devices."""


class WrongHostError(GpuschedError):
    """A task landed on a host that does not own its devices (misrouting, stale queue)."""


class TelemetryError(GpuschedError):
    """Sampling, exporting or evaluating alert rules failed."""


class ForecastError(GpuschedError):
    """Demand history failed validation, or no forecasting model could be fitted."""


class ScalingError(GpuschedError):
    """A scaler provider could not apply a pre-scaling plan."""


class AirflowBootError(GpuschedError):
    """A local Airflow (tests, benchmarks) exited or did not become ready in time; carries its log tail."""
