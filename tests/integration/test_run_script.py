"""scripts/run.sh's signal handling, with a stand-in for ``airflow standalone`` (no Airflow boot).

A background job of a non-interactive shell starts with SIGINT ignored; the main job must still
stop on SIGINT, as the README promises, not only on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_AIRFLOW = """#!{python}
import os, signal, sys, time
home = os.environ["GPUSCHED_AIRFLOW_HOME"]
open(os.path.join(home, "fake.pid"), "w").write(str(os.getpid()))
open(os.path.join(home, "parallelism"), "w").write(os.environ.get("AIRFLOW__CORE__PARALLELISM", ""))
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
print("fake standalone up", flush=True)
while True:
    time.sleep(0.2)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_run_sh_in_the_background_stops_on_sigint_and_sigterm(tmp_path: Path, sig: int) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    fake = venv / "bin" / "airflow"
    fake.write_text(FAKE_AIRFLOW.format(python=sys.executable))
    fake.chmod(0o755)
    env = {**os.environ, "GPUSCHED_VENV": str(venv), "GPUSCHED_AIRFLOW_HOME": str(tmp_path / "home"),
           "GPUSCHED_AGENT": "0", "GPUSCHED_BACKEND": "simulated", "PYTHONPATH": str(REPO)}
    env.pop("GPUSCHED_RUN_SIGINT_RESTORED", None)
    env.pop("AIRFLOW__CORE__PARALLELISM", None)
    # `sh -c '… &'`: the non-interactive shell starts run.sh with SIGINT ignored.
    log = tmp_path / "run.log"
    launcher = subprocess.run(
        ["sh", "-c", f'bash "{REPO}/scripts/run.sh" >"{log}" 2>&1 & echo $!'],
        env=env, capture_output=True, text=True, check=True, timeout=30,
    )
    pid = int(launcher.stdout.strip())
    stopped = False
    try:
        deadline = time.monotonic() + 60
        while "fake standalone up" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "fake standalone up" in log.read_text(), log.read_text()
        assert "using the simulated fleet (" in log.read_text()
        # Task slots sized to the machine, not Airflow's 32 on any host.
        assert (tmp_path / "home" / "parallelism").read_text() == str(4 * len(os.sched_getaffinity(0)))
        os.kill(pid, sig)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"run.sh ignored {signal.Signals(sig).name}:\n{log.read_text()}")
        assert "gpusched: stopped" in log.read_text()
        stopped = True
    finally:  # a failed run leaves no process behind
        fake_pid = tmp_path / "home" / "fake.pid"
        for leftover in (pid, int(fake_pid.read_text()) if fake_pid.is_file() else 0):
            try:
                if leftover and not stopped:
                    os.kill(leftover, signal.SIGKILL)
            except ProcessLookupError:
                pass
