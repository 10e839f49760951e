"""The CLI's rough edges: YAML errors with their place, duplicated keys, missing inputs before Prefect,
every command in --help, `check-params` and `server url` output, and a copied project's server.json."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.server import ServerRecord, reusable_url, serves_home, state_file, stop_server, ui_url
from lensemble.config import load_params
from lensemble.errors import ConfigError
from tests.conftest import REPO, make_project, micro_params


def _cli(root: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`lensemble --root ROOT ARGS` in a fresh process: its own PREFECT_HOME and server unless `env` names them."""
    base = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
    return subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=root, env={**base, "PYTHONPATH": str(REPO), **env})


# ------------------------------------------------------------ YAML


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path):
    text = yaml.safe_dump(micro_params(), sort_keys=False).splitlines()
    row = next(i for i, line in enumerate(text) if line.startswith("  seed:"))
    text[row] = "  seed: 0: 1"  # a second `:` on the line: PyYAML stops at it
    path = tmp_path / "params.yaml"
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    column = text[row].rindex(":") + 1  # 1-based, as editors count
    assert str(err.value) == (f"params file {path} is not valid YAML at line {row + 1}, column {column}: "
                              "mapping values are not allowed here")


def test_a_tab_indent_is_reported_at_its_own_line_and_column(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("run:\n  seed: 0\n\thardware_class: auto\n")
    with pytest.raises(ConfigError, match=r"at line 3, column 1: found character '\\t' that cannot start any token"):
        load_params(path)


@pytest.mark.parametrize("nested", [False, True])
def test_a_duplicated_key_is_refused_with_both_lines(tmp_path, nested):
    text = yaml.safe_dump(micro_params(), sort_keys=False)
    if nested:  # `federate.rounds` given twice inside its section
        text = text.replace("federate:\n", "federate:\n  rounds: 99\n", 1)
        key = "rounds"
    else:  # a whole `train:` section given a second time at the end
        text += "train:\n  lr: 0.5\n"
        key = "train"
    lines = text.splitlines()
    first, second = [i + 1 for i, line in enumerate(lines) if line.strip().startswith(f"{key}:")][:2]
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == f"params file {path}: key '{key}' is given twice, at line {first} and at line {second}; keep one"


def test_merge_keys_may_be_overridden_and_are_not_duplicates(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  y: 3\n")
    from lensemble.config import load_yaml

    assert load_yaml(path) == {"base": {"x": 1, "y": 2}, "d": {"x": 1, "y": 3}}


# ------------------------------------------------------------ the CLI


def test_help_lists_every_command():
    from flows.cli import COMMANDS, SUITES, build_parser

    text = build_parser().format_help()
    for name in (*COMMANDS, *SUITES):
        assert f"\n    {name} " in text, name


def test_check_params_says_the_file_is_valid(tmp_path):
    root = make_project(tmp_path / "proj", micro_params())
    proc = _cli(root, "check-params")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{root / 'params.yaml'} is valid (params hash {load_params(root / 'params.yaml').hash()})\n"


PREPARED = ("data/sites/site_a/episodes.parquet", "data/sites/site_b/episodes.parquet", "data/probe/grid_point.parquet",
            "data/probe/grid_thruster.parquet")


@pytest.mark.parametrize("stage, present, message", [
    ("evaluate", PREPARED,
     "missing models/centralized.pt, models/federated.pt, models/sites/site_a.pt, models/sites/site_b.pt and 2 more; "
     "run `lensemble run centralized` and `lensemble run federate` first (or `dvc repro evaluate`)"),
    ("report", ("reports/centralized.json", "reports/federate.json", "reports/gauge.json", "reports/plots/centralized_loss.json"),
     "missing reports/eval.json; run `lensemble run evaluate` first (or `dvc repro report`)"),
    ("federate", PREPARED[:3],
     "missing data/probe/grid_thruster.parquet; run `lensemble run prepare` first (or `dvc repro federate`)"),
])
def test_a_missing_input_is_one_line_before_any_server_starts(tmp_path, stage, present, message):
    root = make_project(tmp_path / "proj", micro_params())
    for rel in present:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    t0 = time.monotonic()
    proc = _cli(root, "run", stage, timeout=60)
    seconds = time.monotonic() - t0
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr == f"lensemble: error: stage {stage} cannot start: {message}\n"
    assert not (root / ".prefect").exists()  # no Prefect home, so no server was started or even looked for
    assert seconds < 15, seconds  # ~2 s here; the ceiling is for a loaded CI machine (Prefect alone starts in ~30 s)


def test_run_reports_a_bad_params_file_with_its_place(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    (root / "params.yaml").write_text("run:\n  seed: 0\nrun:\n  seed: 1\n")
    proc = _cli(root, "run", "prepare", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == (f"lensemble: error: params file {root / 'params.yaml'}: key 'run' is given twice, "
                           "at line 1 and at line 3; keep one\n")


def test_server_url_prints_the_ui_address():
    assert ui_url("http://127.0.0.1:4200/api") == "http://127.0.0.1:4200"
    assert ui_url("http://127.0.0.1:4200/api/") == "http://127.0.0.1:4200"


def test_server_url_with_an_exported_api_url(tmp_path):
    api = "http://127.0.0.1:4321/api"
    assert _cli(tmp_path, "server", "url", timeout=60, PREFECT_API_URL=api).stdout == "http://127.0.0.1:4321\n"
    assert _cli(tmp_path, "server", "url", "--api", timeout=60, PREFECT_API_URL=api).stdout == f"{api}\n"


# ------------------------------------------------------------ a copied project's server.json

# a stand-in for `prefect server start`: answers /api/health, and its argv reads like the real command's
FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/api/health" else 404); self.end_headers(); self.wfile.write(b"true")
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


@pytest.fixture
def original(tmp_path):
    """A project whose .prefect/server.json records a (fake) running server of its own home."""
    home = (tmp_path / "original" / ".prefect").resolve()
    home.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, "prefect", "server", "start"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PREFECT_HOME": str(home)}, start_new_session=True)
    port = int(proc.stdout.readline())
    api = f"http://127.0.0.1:{port}/api"
    state_file(home).write_text(json.dumps({"api_url": api, "ui_url": ui_url(api), "pid": proc.pid, "prefect_home": str(home)}))
    yield home, api, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _copy(home: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy" / ".prefect"
    copy.mkdir(parents=True)
    state_file(copy).write_bytes(state_file(home).read_bytes())  # what `cp -r original copy` carries along
    return copy


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to read a process's PREFECT_HOME")
def test_the_project_that_started_a_server_reuses_it(original):
    home, api, proc = original
    assert serves_home(proc.pid, home)
    assert reusable_url(home) == api


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to read a process's PREFECT_HOME")
def test_a_copied_server_json_is_neither_reused_nor_stopped(original, tmp_path):
    home, api, proc = original
    copy = _copy(home, tmp_path)
    record = ServerRecord.read(copy)
    assert record is not None and not record.belongs_to(copy) and record.belongs_to(home)
    assert reusable_url(copy) is None  # ensure_server in the copy starts its own server
    assert stop_server(copy) is False
    time.sleep(0.2)
    assert proc.poll() is None and reusable_url(home) == api  # the original's server still runs and is still its
    assert stop_server(home) is True
    proc.wait(timeout=10)
    assert not state_file(home).exists()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to read a process's PREFECT_HOME")
def test_a_record_naming_this_home_but_another_homes_process_is_not_signalled(original, tmp_path):
    home, api, proc = original
    forged = (tmp_path / "forged" / ".prefect").resolve()
    forged.mkdir(parents=True)
    record = {"api_url": api, "ui_url": ui_url(api), "pid": proc.pid, "prefect_home": str(forged)}
    state_file(forged).write_text(json.dumps(record))
    assert reusable_url(forged) is None  # the pid serves another home (its environment says so)
    assert stop_server(forged) is False
    time.sleep(0.2)
    assert proc.poll() is None


def test_server_stop_in_a_copy_prints_that_it_left_the_original_alone(original, tmp_path):
    home, api, proc = original
    copy = _copy(home, tmp_path)
    out = _cli(copy.parent, "server", "stop", timeout=60)  # PREFECT_HOME: the copy's .prefect/, as the CLI sets it
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"no server running for {copy} (its server.json is another project's, {home}: left alone)\n"
    assert proc.poll() is None


def test_ui_prints_the_mlflow_runs_table_address_of_a_model_training_experiment(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = _cli(tmp_path, "ui", "--no-serve", "--port", "5123", MLFLOW_TRACKING_URI=uri)
    assert proc.returncode == 0, proc.stderr
    exp = MlflowClient(uri).get_experiment_by_name("lensemble")
    # the UI opens an experiment in its GenAI mode unless told otherwise: the address says which table to show
    assert f"http://127.0.0.1:5123/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning" in proc.stdout
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "Prefect runs: no server yet" in proc.stdout
