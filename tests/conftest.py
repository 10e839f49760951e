"""Shared fixtures: offline switches, one Prefect test server per session, micro params."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from orchestration.heap import skip_final_collection

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
_OWN_PREFECT_HOME = None  # the session's Prefect home when this file made it (removed at the session's end)
if "PREFECT_HOME" not in os.environ:
    _OWN_PREFECT_HOME = os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="lensemble-prefect-")
skip_final_collection()  # the session's exit skips the last collection over every object the tests made

REPO = Path(__file__).resolve().parents[1]


def pytest_sessionfinish(session, exitstatus):
    if _OWN_PREFECT_HOME is not None:
        shutil.rmtree(_OWN_PREFECT_HOME, ignore_errors=True)


def micro_params() -> dict:
    """The default params shrunk to seconds: same structure, tiny counts."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update(episode_length=8, probe_episodes=2, num_steps=3)
    raw["data"]["sites"] = [
        {"name": "site_a", "embodiment": "grid_point", "episodes": 3},
        {"name": "site_b", "embodiment": "grid_thruster", "episodes": 3},
    ]
    raw["data"]["image_size"] = 16
    raw["model"]["patch_size"] = 8
    raw["objective"]["sketch_dim"] = 8
    raw["objective"]["sigreg_tokens"] = 64
    raw["train"]["batch_size"] = 4
    raw["centralized"]["steps"] = 4
    raw["federate"].update(rounds=2, inner_steps=3, head_adapt_steps=50)
    raw["evaluate"].update(episodes=2, max_steps=3)
    raw["objective"]["rollout_steps"] = 1
    raw["evaluate"]["cem"].update(samples=8, elites=2, iterations=1, horizon=2, execute_steps=2, context=1)
    raw.pop("join", None)  # the default's joining robot may be one of these sites' embodiments
    return raw


def pooled_samplers(p) -> list:
    """(embodiment, WindowSampler) of every site of params `p`, episodes generated in memory (pooled training's input)."""
    from lensemble.data.episodes import generate_episodes
    from lensemble.sim.registry import make_embodiment
    from lensemble.workflow import sampler_for

    samplers = []
    for s in p.data.sites:
        env = make_embodiment(s.embodiment, p.data.image_size)
        eps = generate_episodes(env, p.run.seed, s.name, s.episodes, p.data.episode_length, p.data.expert_noise, p.data.random_fraction,
                                p.data.segment_length)
        samplers.append((s.embodiment, sampler_for(eps, p)))
    return samplers


def make_project(root: Path, params: dict) -> Path:
    """A project root with params.yaml, budgets.yaml and pricing.yaml."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copy(REPO / "budgets.yaml", root / "budgets.yaml")
    shutil.copy(REPO / "pricing.yaml", root / "pricing.yaml")
    return root


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server (SQLite) for every test that runs a flow."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, its schema made once by MLflow itself (`mlflow db upgrade`'s migrations, ~1.2 s a
    store): a project's store starts as a copy. A test of how a fresh store is made (test_tracking_users) makes its own."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def project(tmp_path, monkeypatch, mlflow_store_template):
    """A micro project root; MLflow tracking pinned to its own SQLite file (a copy of the session's empty store)."""
    root = make_project(tmp_path / "proj", micro_params())
    shutil.copyfile(mlflow_store_template, root / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.delenv("LENSEMBLE_PIPELINE_RUN", raising=False)
    return root


@pytest.fixture(params=["native", "eager"])
def kernel_path(request, monkeypatch):
    """Run a test on the native kernels (where a C compiler exists) and on the eager NumPy/torch path."""
    from lensemble.federation import native

    if request.param == "native":
        if native.load() is None:
            pytest.skip("no C compiler: the native kernel cannot be built here")
    else:
        monkeypatch.setenv("LENSEMBLE_NATIVE", "0")
    native.load.cache_clear()
    yield request.param
    native.load.cache_clear()
