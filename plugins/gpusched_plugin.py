"""Plugins-folder shim: ``[core] plugins_folder = plugins/`` loads the gpusched plugin from here,
for a gpusched that is importable but not installed (no ``airflow.plugins`` entry point).

An installed gpusched (``pip install``, the editable install of ``scripts/setup.sh``, the Docker
image) registers the plugin through its entry point. Airflow loads the plugins folder first and
reports the entry point's second registration of the same name as a plugin import error (the red
"1 Plugin Import Error" on the Home page). So the class is bound at module level, where Airflow's
folder loader looks for plugins, only when no entry point registers it; ``GpuschedPlugin`` stays
importable from this module either way (module ``__getattr__``).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

__all__ = ["GpuschedPlugin"]

_PLUGIN_MODULE = "gpusched.airflow.plugin"


def _registered_by_entry_point() -> bool:
    """Whether an installed distribution registers the gpusched plugin (``airflow.plugins``)."""
    return any(ep.value.split(":")[0].strip() == _PLUGIN_MODULE
               for ep in entry_points(group="airflow.plugins"))


if not _registered_by_entry_point():
    from gpusched.airflow.plugin import GpuschedPlugin
else:
    def __getattr__(name: str) -> Any:
        if name == "GpuschedPlugin":
            # Bound on access only: bound at import, Airflow's folder loader would register it too.
            from gpusched.airflow.plugin import GpuschedPlugin as plugin

            return plugin
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
