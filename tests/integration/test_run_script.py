"""scripts/run.sh's signal handling and Airflow database, with a stand-in for ``airflow
standalone`` (no Airflow boot).

A background job of a non-interactive shell starts with SIGINT ignored; the main job must still
stop on SIGINT, as the README promises, not only on SIGTERM. Airflow's database is a PostgreSQL
run.sh starts and stops itself (where the server binaries are installed), kept across restarts.
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _run_sh_support import postgres_installed

REPO = Path(__file__).resolve().parents[2]

FAKE_AIRFLOW = """#!{python}
import os, signal, sys, time
home = os.environ["GPUSCHED_AIRFLOW_HOME"]
open(os.path.join(home, "fake.pid"), "w").write(str(os.getpid()))
open(os.path.join(home, "parallelism"), "w").write(os.environ.get("AIRFLOW__CORE__PARALLELISM", ""))
open(os.path.join(home, "db_url"), "w").write(os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", ""))
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
print("fake standalone up", flush=True)
while True:
    time.sleep(0.2)
"""


def _fake_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """run.sh's environment with the stand-in ``airflow`` in a virtual environment of its own."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        (venv / "bin" / "python").symlink_to(sys.executable)
    fake = venv / "bin" / "airflow"
    fake.write_text(FAKE_AIRFLOW.format(python=sys.executable))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
    # The symlinked interpreter is outside its virtual environment: give it the packages too.
    path = os.pathsep.join([str(REPO), *site.getsitepackages()])
    env.update({"GPUSCHED_VENV": str(venv), "GPUSCHED_AIRFLOW_HOME": str(tmp_path / "home"),
                "GPUSCHED_AGENT": "0", "GPUSCHED_BACKEND": "simulated", "PYTHONPATH": path, **extra})
    return env


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_run_sh_in_the_background_stops_on_sigint_and_sigterm(tmp_path: Path, sig: int) -> None:
    env = _fake_env(tmp_path, GPUSCHED_METADB="sqlite")  # the database: the tests below
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


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """run.sh with the stand-in ``airflow``, once the stand-in is up."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(["bash", str(REPO / "scripts" / "run.sh")], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "fake standalone up" not in log.read_text() and time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"run.sh exited ({proc.returncode}):\n{log.read_text()}")
        time.sleep(0.2)
    assert "fake standalone up" in log.read_text(), log.read_text()
    return proc


def _stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"run.sh did not stop on SIGINT:\n{log.read_text()}")
    assert "gpusched: stopped" in log.read_text()


@pytest.fixture
def pgdata() -> Iterator[Path]:
    """A folder for run.sh's PostgreSQL that the server's user can reach (pytest's folders are
    closed to it when the tests run as root); stopped and removed afterwards."""
    if not postgres_installed():
        pytest.skip("the PostgreSQL server binaries are not installed; run scripts/setup.sh (apt postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="gpusched-pg-"))  # in /tmp: reachable by the server user
    yield folder
    subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), "--halt", str(folder)], check=False,
                   timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


def test_run_sh_runs_airflow_on_a_postgresql_of_its_own_kept_across_restarts(tmp_path: Path,
                                                                             pgdata: Path) -> None:
    """Before: the main job ran on SQLite, where its API server stalled for 60 s under load
    (docs/reliability.md). Now run.sh starts a PostgreSQL (Unix socket only), hands Airflow its URL
    (sync and async), stops it with Airflow, and finds the same data on the next start."""
    import sqlalchemy as sa

    env = _fake_env(tmp_path, GPUSCHED_PGDATA=str(pgdata))
    log = tmp_path / "run.log"
    urls = []
    for start in (1, 2):
        proc = _start(env, log)
        try:
            url = (tmp_path / "home" / "db_url").read_text()
            urls.append(url)
            assert url == f"postgresql+psycopg://postgres@/airflow?host={pgdata}", url
            assert f"gpusched: Airflow database: PostgreSQL, data in {pgdata}" in log.read_text()
            engine = sa.create_engine(url)
            try:
                with engine.begin() as conn:
                    assert conn.execute(sa.text("SELECT current_database()")).scalar() == "airflow"
                    if start == 1:
                        conn.execute(sa.text("CREATE TABLE kept (n integer)"))
                        conn.execute(sa.text("INSERT INTO kept VALUES (42)"))
                    else:  # the first start's data is still there
                        assert conn.execute(sa.text("SELECT n FROM kept")).scalar() == 42
            finally:
                engine.dispose()
            assert (pgdata / "data" / "postmaster.pid").is_file()
            assert (pgdata / ".s.PGSQL.5432").is_socket()  # a Unix socket in its 0700 folder, no TCP
        finally:
            _stop(proc, log)
        assert not (pgdata / "data" / "postmaster.pid").exists(), "run.sh left its PostgreSQL running"
    assert urls[0] == urls[1]


def test_a_database_the_user_configured_is_left_as_configured(tmp_path: Path) -> None:
    configured = f"sqlite:///{tmp_path / 'mine.db'}"
    env = _fake_env(tmp_path, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=configured)
    log = tmp_path / "run.log"
    proc = _start(env, log)
    try:
        assert (tmp_path / "home" / "db_url").read_text() == configured
        assert "gpusched: Airflow database: SQLite (WAL, 60 s lock wait)" in log.read_text()
        assert not (tmp_path / "home" / "postgres").exists()
    finally:
        _stop(proc, log)


def test_an_unknown_gpusched_metadb_is_refused_in_one_line(tmp_path: Path) -> None:
    env = _fake_env(tmp_path, GPUSCHED_METADB="mysql")
    done = subprocess.run(["bash", str(REPO / "scripts" / "run.sh")], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "run.sh: GPUSCHED_METADB='mysql' is not valid; accepted: postgres (default), sqlite"), done.stderr


def test_without_the_postgresql_binaries_run_sh_falls_back_to_sqlite_and_says_so(tmp_path: Path) -> None:
    """run.sh copied beside a start_postgres.sh that finds no server binaries (exit 2, as the real
    one does then): Airflow runs on SQLite with WAL and the 60 s lock wait, and run.sh says why."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run.sh", repo / "scripts" / "run.sh")
    (repo / "scripts" / "start_postgres.sh").write_text(
        "echo 'PostgreSQL server binaries not found; apt-get install -y postgresql' >&2\nexit 2\n")
    env = _fake_env(tmp_path)
    log = tmp_path / "run.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(["bash", str(repo / "scripts" / "run.sh")], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "fake standalone up" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    try:
        text = log.read_text()
        assert "fake standalone up" in text, text
        home = tmp_path / "home"
        assert (home / "db_url").read_text() == ""  # Airflow's default: $AIRFLOW_HOME/airflow.db
        said = [line for line in text.splitlines() if line.startswith("gpusched: Airflow database: ")]
        assert said == [
            f"gpusched: Airflow database: SQLite ({home}/airflow.db): no PostgreSQL to start (PostgreSQL "
            "server binaries not found; apt-get install -y postgresql; scripts/setup.sh installs it); the "
            "API server may stall for a minute under load"], said
        with sqlite3.connect(home / "airflow.db") as db:  # the fallback still gets WAL
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        _stop(proc, log)
