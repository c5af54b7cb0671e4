"""Helpers of the fault-injection tests: a private PostgreSQL server that can be killed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parent.parent


def _find_bin(name: str) -> str:
    import shutil

    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if not candidates:
        raise FileNotFoundError(f"{name} not found; apt-get install -y postgresql")
    return str(candidates[-1])


def postgres_binaries() -> bool:
    """True when the PostgreSQL server binaries are installed."""
    try:
        _find_bin("initdb")
    except FileNotFoundError:
        return False
    return True


class PrivatePostgres:
    """A throwaway PostgreSQL cluster (scripts/start_postgres.sh) this test may kill and restart.

    Lives in a fresh folder under the system temp dir (the server's user must reach it, which
    pytest's private tmp_path does not allow when the tests run as root).
    """

    def __init__(self) -> None:
        self.folder = Path()
        self.url = ""
        self.port = 0

    def __enter__(self) -> PrivatePostgres:
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="gpusched-faults-pg-"))
        os.chmod(self.folder, 0o755)
        out = subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), str(self.folder)],
                             capture_output=True, text=True, timeout=120, check=True)
        self.url = out.stdout.strip().splitlines()[-1]
        self.port = int(self.url.rsplit(":", 1)[1].split("/", 1)[0])
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), "--stop", str(self.folder)],
                       capture_output=True, timeout=120)

    def _as_owner(self, *command: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *command] if os.getuid() == 0 else list(command)

    def postmaster_pid(self) -> int | None:
        pid_file = self.folder / "data" / "postmaster.pid"
        try:
            return int(pid_file.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """SIGKILL the postmaster; its backends notice and exit."""
        import psutil

        pid = self.postmaster_pid()
        assert pid is not None, "the server is not running"
        family = psutil.Process(pid).children(recursive=True)
        os.kill(pid, signal.SIGKILL)
        psutil.wait_procs(family, timeout=20)
        deadline = time.monotonic() + 20
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def start(self) -> None:
        """Start the server again on the same data directory and port."""
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off "
                   "-c max_connections=100")
        subprocess.run(
            self._as_owner(_find_bin("pg_ctl"), "-D", str(self.folder / "data"), "-l",
                           str(self.folder / "server.log"), "-w", "-t", "60", "-o", options, "start"),
            capture_output=True, timeout=120, check=True,
        )
