"""A project-local Prefect server shared by every stage of `dvc repro`.

Each DVC stage is its own process; with Prefect's ephemeral mode each would start (and stop) a
temporary server, ~10 s apiece, and their runs would land in a database nobody can browse while
they run. Instead the first stage starts `prefect server start` on 127.0.0.1 with the project's
PREFECT_HOME (`.prefect/`), records its URL and pid in `.prefect/server.json`, and every later
stage reuses it; the Prefect UI at that URL shows the runs live. `lensemble server stop` ends it.
An explicit `PREFECT_API_URL` always wins; `LENSEMBLE_PREFECT=ephemeral` keeps Prefect's own mode.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lensemble.errors import LensembleError


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state_file(home: Path) -> Path:
    return home / "server.json"


def ensure_server(home: Path, timeout: float = 90.0) -> str | None:
    """The API URL stages should use, starting the project server if none is healthy; None = ephemeral."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if os.environ.get("LENSEMBLE_PREFECT", "server") == "ephemeral":
        return None
    home.mkdir(parents=True, exist_ok=True)
    state = state_file(home)
    if state.is_file():
        url = json.loads(state.read_text())["api_url"]
        if _healthy(url):
            os.environ["PREFECT_API_URL"] = url
            return url
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = (home / "server.log").open("ab")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LensembleError(f"prefect server exited with code {proc.returncode}; see {home / 'server.log'}")
        if _healthy(url):
            state.write_text(json.dumps({"api_url": url, "ui_url": url.removesuffix("/api"), "pid": proc.pid}))
            os.environ["PREFECT_API_URL"] = url
            return url
        time.sleep(0.5)
    proc.terminate()
    raise LensembleError(f"prefect server did not answer on {url} within {timeout:.0f} s; see {home / 'server.log'}")


def stop_server(home: Path) -> bool:
    """Stop the project server if one is recorded; True if one was stopped."""
    state = state_file(home)
    if not state.is_file():
        return False
    pid = json.loads(state.read_text())["pid"]
    state.unlink()
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True
