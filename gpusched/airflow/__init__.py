"""The Airflow face of gpusched: executor, listener, authoring helpers and plugin parts.

Import the sub-module you need (``gpusched.airflow.authoring`` in DAG files); this package
imports nothing itself so DAG parsing stays light.
"""

__all__: list[str] = []
