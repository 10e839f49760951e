"""A project-local Prefect server shared by every stage of `dvc repro`.

Each DVC stage is its own process; with Prefect's ephemeral mode each would start (and stop) a
temporary server, ~10 s apiece, and their runs would land in a database nobody can browse while
they run. Instead the first stage starts `prefect server start` on 127.0.0.1 with the project's
PREFECT_HOME (`.prefect/`), records its URLs, pid and that PREFECT_HOME in `.prefect/server.json`,
and every later stage reuses it; the Prefect UI at `lensemble server url` shows the runs live.
`lensemble server stop` ends it. An explicit `PREFECT_API_URL` always wins;
`LENSEMBLE_PREFECT=ephemeral` keeps Prefect's own mode.

A record belongs to the PREFECT_HOME it names: a `server.json` that travelled with a copied project
names the original's home, so the copy starts its own server rather than writing into the original's
database, and `lensemble server stop` in the copy never signals the original's server. Stopping also
checks that the recorded pid is still a `prefect server` process of this home (`/proc`), so a pid
reused after the server died is never signalled. Prefect's own `prefect server stop` is not used: it
reads `server.pid` from PREFECT_HOME with neither check, so it has the same copied-project hazard.
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
from dataclasses import asdict, dataclass
from pathlib import Path

from lensemble.errors import LensembleError


@dataclass(frozen=True)
class ServerRecord:
    """What `.prefect/server.json` holds about the project's server."""

    api_url: str  # http://127.0.0.1:PORT/api, what PREFECT_API_URL is set to
    ui_url: str  # http://127.0.0.1:PORT, the Prefect UI
    pid: int  # the `prefect server start` process, leader of its own process group
    prefect_home: str | None  # the resolved PREFECT_HOME it serves (None: written before homes were recorded)

    @classmethod
    def read(cls, home: Path) -> ServerRecord | None:
        """The record in `home`, or None if there is none or it is unreadable."""
        try:
            raw = json.loads(state_file(home).read_text())
            return cls(str(raw["api_url"]), str(raw["ui_url"]), int(raw["pid"]), raw.get("prefect_home"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def belongs_to(self, home: Path) -> bool:
        """Whether the record was written for `home` (not copied in with a project from elsewhere)."""
        return self.prefect_home == str(home.resolve())


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


def ui_url(api_url: str) -> str:
    """The Prefect UI's address for an API URL (the UI is served at the API's origin)."""
    return api_url.rstrip("/").removesuffix("/api")


def serves_home(pid: int, home: Path) -> bool:
    """Whether `pid` is a running `prefect server start` whose PREFECT_HOME is `home`.

    Reads /proc/PID/cmdline and /proc/PID/environ (the environment it was started with, which
    `ensure_server` sets); where /proc is not there, whether the pid is alive is all that can be told.
    """
    proc = Path("/proc") / str(pid)
    if not Path("/proc/self").is_dir():
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    try:
        argv = proc.joinpath("cmdline").read_bytes().split(b"\0")
        environ = proc.joinpath("environ").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's
        return False
    is_server = b"prefect" in argv and b"server" in argv and b"start" in argv
    return is_server and f"PREFECT_HOME={home.resolve()}".encode() in environ


def reusable_url(home: Path) -> str | None:
    """The API URL of this home's recorded server if it is answering, else None (start a new one)."""
    record = ServerRecord.read(home)
    if record is None or not record.belongs_to(home) or not serves_home(record.pid, home):
        return None
    return record.api_url if _healthy(record.api_url) else None


def ensure_server(home: Path, timeout: float = 90.0) -> str | None:
    """The API URL stages should use, starting the project server if none is healthy; None = ephemeral."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if os.environ.get("LENSEMBLE_PREFECT", "server") == "ephemeral":
        return None
    home.mkdir(parents=True, exist_ok=True)
    url = reusable_url(home)
    if url is not None:
        os.environ["PREFECT_API_URL"] = url
        return url
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = (home / "server.log").open("ab")
    env = {**os.environ, "PREFECT_HOME": str(home.resolve()), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LensembleError(f"prefect server exited with code {proc.returncode}; see {home / 'server.log'}")
        if _healthy(url):
            record = ServerRecord(url, ui_url(url), proc.pid, str(home.resolve()))
            state_file(home).write_text(json.dumps(asdict(record)) + "\n")
            os.environ["PREFECT_API_URL"] = url
            return url
        time.sleep(0.5)
    proc.terminate()
    raise LensembleError(f"prefect server did not answer on {url} within {timeout:.0f} s; see {home / 'server.log'}")


def stop_server(home: Path) -> bool:
    """Stop this home's recorded server; True if one was stopped.

    A record of another home (a copied project) or whose pid is no longer this home's server is
    removed without signalling anything.
    """
    record = ServerRecord.read(home)
    state_file(home).unlink(missing_ok=True)
    if record is None or not serves_home(record.pid, home):
        return False
    # an older record names no home: only the process's own environment (/proc) can vouch for it
    if not (record.belongs_to(home) or (record.prefect_home is None and Path("/proc/self").is_dir())):
        return False
    try:
        os.killpg(record.pid, signal.SIGTERM)  # the server and the workers it forked: it leads its own session
    except ProcessLookupError:
        return False
    return True
