"""The shared local-Airflow helpers (gpusched/deploy/airflow_instance.py) on real processes and sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from gpusched.deploy.airflow_instance import (
    api_server,
    free_port,
    http_get,
    login_token,
    poll_until,
    wait_until,
)
from gpusched.errors import AirflowBootError


def _sleeper(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_free_port_can_be_bound_on_loopback() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert 0 < port < 65536


def test_wait_until_returns_the_first_truthy_result_and_treats_errors_as_not_yet(tmp_path: Path) -> None:
    proc = _sleeper(30)
    calls: list[int] = []

    def check() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not up yet")
        return "ready"

    try:
        assert wait_until("ready", check, 10, proc=proc, log=tmp_path / "log", interval=0.01) == "ready"
    finally:
        proc.kill()
        proc.wait()
    assert len(calls) == 3


def test_wait_until_reports_an_exited_process_with_its_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "standalone.log"
    log.write_text("line one\nImportError: no module named nope\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    expected = r"exited \(3\) while waiting for health(.|\n)*no module named nope"
    with pytest.raises(AirflowBootError, match=expected):
        wait_until("health", lambda: False, 10, proc=proc, log=log, interval=0.01)


def test_wait_until_times_out_naming_what_it_waited_for(tmp_path: Path) -> None:
    proc = _sleeper(30)
    try:
        with pytest.raises(AirflowBootError, match="timed out after 0 s waiting for the DAGs"):
            wait_until("the DAGs", lambda: None, 0.2, proc=proc, log=tmp_path / "missing.log", interval=0.05)
    finally:
        proc.kill()
        proc.wait()


def test_poll_until_stops_at_once_when_abort_gives_a_reason_and_reports_the_logs() -> None:
    checks: list[int] = []
    reasons = iter([None, None, "worker exited (9)"])
    expected = r"^worker exited \(9\) while waiting for the gang:\nlog tails"
    with pytest.raises(AirflowBootError, match=expected):
        poll_until("the gang", lambda: checks.append(1), timeout=10, abort=lambda: next(reasons),
                   logs=lambda: "log tails", interval=0.01)
    assert len(checks) == 2  # asked abort before every try


STAND_IN = """
import http.server, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
assert sys.argv[1] == "api-server", sys.argv
class Version(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(401 if self.path == "/api/v2/version" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Version)
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
print("serving", flush=True)
server.serve_forever()
"""


def test_api_server_yields_its_url_once_it_answers_and_stops_the_process_group(tmp_path: Path) -> None:
    """A stand-in ``airflow`` (a real process on a real port) answers /api/v2/version with 401."""
    script = tmp_path / "airflow_stand_in.py"
    script.write_text(STAND_IN)
    port = free_port()
    with api_server([sys.executable, str(script)], port=port, env={}, log=tmp_path / "api.log",
                    timeout=30) as base:
        assert base == f"http://127.0.0.1:{port}"
        assert http_get(base + "/api/v2/version")[0] == 401 and http_get(base + "/other")[0] == 404
    with pytest.raises(OSError):  # stopped: nothing listens any more
        http_get(base + "/api/v2/version", timeout=2)
    assert "serving" in (tmp_path / "api.log").read_text()


def test_api_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("print('ImportError: no module named nope'); raise SystemExit(2)\n")
    expected = r"Airflow exited \(2\) while waiting for the api-server(.|\n)*no module named nope"
    with pytest.raises(AirflowBootError, match=expected), api_server(
        [sys.executable, str(script)], port=free_port(), env={}, log=tmp_path / "api.log", timeout=30
    ):
        pytest.fail("the server never came up")


def test_login_token_reads_the_generated_passwords_and_says_empty_when_refused(tmp_path: Path) -> None:
    """A real HTTP server that refuses the login: the helper returns "" rather than raising."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        seen: ClassVar[list[bytes]] = []

        def do_POST(self) -> None:
            Refuse.seen.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    (tmp_path / "simple_auth_manager_passwords.json.generated").write_text('{"admin": "s3cret"}')
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert login_token(tmp_path, f"http://127.0.0.1:{server.server_address[1]}") == ""
    finally:
        server.shutdown()
        server.server_close()
    assert Refuse.seen == [b'{"username": "admin", "password": "s3cret"}']
