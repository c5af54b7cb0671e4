"""A stand-in for the executors' shared GPU core (``GPUScheduling``), as far as the preemption
and migration cycles read it: the executor, its ``[gpusched]`` settings, running tasks, gangs, a
log and the ledger. Shared by the cycle tests that drive those parts without Airflow."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gpusched.ledger import Ledger
from gpusched.scheduler.attained import AttainedService


class SilentLog:
    """A logger that drops everything."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class GpuschedConf:
    """The executor's team-scoped config: only ``[gpusched]`` is read, from ``values``."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = dict(values)

    def get(self, section: str, key: str, fallback: str | None = None) -> str | None:
        assert section == "gpusched"
        return self.values.get(key, fallback)


class StubCore:
    """The core's attributes the preemptor and migrator use, with ``settings`` as ``[gpusched]``."""

    def __init__(self, ledger: Ledger, settings: Mapping[str, str]) -> None:
        self.executor = object()
        self.conf = GpuschedConf(settings)
        self.gpu_running: dict[Any, str] = {}
        self.gangs: dict[str, set[Any]] = {}
        self.log = SilentLog()
        self.ledger = ledger
        self.attained = AttainedService()
        self.clock = time.time
