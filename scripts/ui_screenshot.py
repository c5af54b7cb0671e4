"""Screenshot the "GPU fleet" page of a running Airflow api-server with headless Chromium.

Signs in like the Airflow UI does (a JWT from ``POST /auth/token`` stored in the ``_token``
cookie), then loads the page — ``/plugin/gpusched`` (inside the Airflow UI, default) or
``/gpusched/ui`` (the page alone) — and writes a PNG. Used for ``docs/img/``:

    PW=$(jq -r .admin $AIRFLOW_HOME/simple_auth_manager_passwords.json.generated)
    python scripts/ui_screenshot.py --password "$PW" --out docs/img/ui-fleet.png
    python scripts/ui_screenshot.py --password "$PW" --path /gpusched/ui --size 1400,1800 \
        --out docs/img/ui-fleet-page.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import threading
import urllib.parse
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8080", help="api-server URL")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password", required=True)
    parser.add_argument("--path", default="/plugin/gpusched", help="page to capture")
    parser.add_argument("--size", default="1400,1000", help="window size W,H")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args()

    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        parser.error("no Chromium found: apt-get install -y chromium")
    body = json.dumps({"username": args.user, "password": args.password}).encode()
    request = urllib.request.Request(args.base.rstrip("/") + "/auth/token", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        token = json.loads(response.read())["access_token"]
    host = urllib.parse.urlsplit(args.base).hostname
    with tempfile.TemporaryDirectory() as folder:
        # Cookies are per host, not per port: this page (another local port) sets the cookie.
        (Path(folder) / "login.html").write_text(
            f'<script>document.cookie = "_token={token}; path=/";'
            f'location.href = "{args.base.rstrip("/")}{args.path}";</script>'
        )
        httpd = ThreadingHTTPServer((host or "127.0.0.1", 0),
                                    partial(SimpleHTTPRequestHandler, directory=folder))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={args.size}", "--virtual-time-budget=15000",
                 f"--screenshot={Path(args.out).resolve()}",
                 f"http://{host}:{httpd.server_address[1]}/login.html"],
                check=True, capture_output=True, timeout=180,
            )
        finally:
            httpd.shutdown()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
