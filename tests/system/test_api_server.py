"""The fleet API and page inside a REAL `airflow api-server` with the gpusched plugin.

Boots the api-server (simple auth manager) on a fresh SQLite metadata DB and a demo ledger, then:
unauthenticated → 401, a JWT from ``POST /auth/token`` as Bearer → 200, the UI's ``_token``
cookie → 200, the plugin and its nav view listed by ``/api/v2/plugins``; and, when Chromium is
installed, the page rendered by a headless browser (JS run, cookie auth) shows device tiles.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import check_plugin_routes

from gpusched.deploy.airflow_instance import api_server, free_port, http_get, login_token

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("apiserver_home")
    (home / "dags").mkdir()
    port = free_port()
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
    }
    env.pop("GPUSCHED_DB_URL", None)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True,
                   capture_output=True, timeout=300)
    subprocess.run([sys.executable, str(REPO / "scripts" / "ui_demo.py"), "--no-forecast"], env=env,
                   check=True, capture_output=True, timeout=300)
    airflow = [sys.executable, "-m", "airflow"]
    with api_server(airflow, port=port, env=env, log=home / "api-server.log") as base:
        token = login_token(home, base)
        assert token, "the simple auth manager refused its own generated password"
        yield {"base": base, "token": token, "port": port}


def test_unauthenticated_is_refused(server: dict[str, Any]) -> None:
    for route in ("/gpusched/fleet", "/gpusched/queue", "/gpusched/quotas", "/gpusched/ui"):
        assert http_get(server["base"] + route)[0] == 401, route
    assert http_get(server["base"] + "/gpusched/fleet", {"Authorization": "Bearer not-a-jwt"})[0] == 403
    # No unauthenticated schema or docs pages (the schema used to answer 500, the docs 200).
    auth = {"Authorization": f"Bearer {server['token']}"}
    for route in ("/gpusched/openapi.json", "/gpusched/docs", "/gpusched/redoc"):
        assert http_get(server["base"] + route)[0] == 404, route
        assert http_get(server["base"] + route, auth)[0] == 404, route


def test_bearer_token_ui_cookie_plugin_and_nav_view(server: dict[str, Any]) -> None:
    fleet, _ = check_plugin_routes(server["base"], server["token"])
    assert fleet["summary"]["states"]["allocated"] > 0  # the demo ledger's allocations
    status, body = http_get(server["base"] + "/gpusched/queue", {"Cookie": f"_token={server['token']}"})
    assert status == 200 and all(entry["reason"] for entry in json.loads(body))


def test_headless_browser_renders_the_page_with_the_session_cookie(
    server: dict[str, Any], tmp_path: Path
) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless browser (apt-get install -y chromium)")
    # Cookies are per host, not per port: a page on another local port sets the UI's `_token`
    # cookie, as the Airflow login page does, then opens the fleet page.
    (tmp_path / "login.html").write_text(
        f'<script>document.cookie = "_token={server["token"]}; path=/";'
        f'location.href = "http://127.0.0.1:{server["port"]}/gpusched/ui";</script>'
    )
    httpd = ThreadingHTTPServer(("127.0.0.1", 0),
                                partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        result = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
             "--dump-dom", f"http://127.0.0.1:{httpd.server_address[1]}/login.html"],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        httpd.shutdown()
    dom = result.stdout
    assert "SIMULATED FLEET" in dom, dom[-2000:]
    assert dom.count('class="dev allocated') > 0 and dom.count('class="dev free') > 0
    assert "a-h100-1" in dom and "Why it waits" in dom
    assert 'id="status" class="badge err"' not in dom  # no fetch failed (401/403 would show here)
    assert "updated " in dom
