"""The local fleet's standby power state: which standby nodes are switched on (``scaling.json``).

:class:`~gpusched.capacity.scaling.LocalFleetScaler` writes it (the standby nodes a scale-out
switched on, the burst reserve, the last plan); :class:`~gpusched.hardware.simulated.SimulatedBackend`
reads it and reports those nodes as active, which is how the simulated fleet "provisions" a node.
Like ``mig_layouts.json`` (:mod:`gpusched.hardware.mig_provider`) it lives in ``state_dir()``, so
every process with the same ``AIRFLOW_HOME`` agrees.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpusched.errors import ScalingError
from gpusched.paths import state_dir

__all__ = ["STATE_FILE", "powered_standby", "read_state", "state_file", "write_state"]

STATE_FILE = "scaling.json"
"""Name of the state file inside the state folder."""


def state_file(folder: Path | None = None) -> Path:
    """The state file in ``folder`` (default :func:`gpusched.paths.state_dir`)."""
    return (folder or state_dir()) / STATE_FILE


def read_state(path: Path) -> dict[str, Any]:
    """The persisted state (``{"active_standby": [], "burst_reserve_gpus": 0, "last_plan": None}``
    when there is none); ScalingError when the file cannot be read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"active_standby": [], "burst_reserve_gpus": 0, "last_plan": None}
    except (OSError, ValueError) as exc:
        raise ScalingError(f"cannot read scaling state {path}: {exc}; delete it to reset") from exc
    return dict(data)


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    """Replace the state file with ``state`` (written aside, then renamed: readers never see half)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(state), indent=2), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise ScalingError(f"cannot write scaling state {path}: {exc}; "
                           "check that AIRFLOW_HOME is writable") from exc


def powered_standby(path: Path) -> frozenset[str]:
    """Names of the standby nodes switched on."""
    return frozenset(str(name) for name in read_state(path).get("active_standby", []))
