"""gpusched fault recovery: classify failed GPU tasks and retry them elsewhere.

Runs every two minutes (and on demand: trigger it from the UI after a failure). The work is in
``gpusched.airflow.recovery_task.run_recovery``: classify each recorded failure (CUDA OOM,
NCCL/communication, hardware Xid/ECC, code error), cordon faulty devices, write a request
override for the retry, record scale-out requests, and clear failed task instances that Airflow
will not retry by itself. See docs/fault-recovery.md.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task


@dag(
    dag_id="gpusched_fault_recovery",
    schedule=timedelta(minutes=2),
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["gpusched", "operations"],
    doc_md=__doc__,
)
def gpusched_fault_recovery() -> None:
    @task(retries=0)
    def recover() -> dict:
        from gpusched.airflow.recovery_task import run_recovery

        return run_recovery()

    recover()


gpusched_fault_recovery()
