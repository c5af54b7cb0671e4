"""Plugins-folder shim: ``[core] plugins_folder = plugins/`` loads the gpusched plugin from here.

An installed gpusched registers the same plugin through its ``airflow.plugins`` entry point; Airflow
skips the second registration of a plugin name, so both ways may be active at once.
"""

from gpusched.airflow.plugin import GpuschedPlugin

__all__ = ["GpuschedPlugin"]
