"""Prefect runs that tell: stage flow runs named and tagged, task runs named by site and round, INFO lines
in the run's logs, the logging switches the CLI sets, and progress lines that leave training's numbers alone."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from functools import partial

import pytest
import torch

from lensemble.config import load_params, parse_params
from lensemble.observability.progress import Progress, format_line
from tests.conftest import REPO, micro_params


# ------------------------------------------------------------ progress lines


def test_progress_line_reads_like_the_example():
    line = format_line("centralized", "step", 400, 2000, 400 / 21, {"loss/pred": 0.93})
    assert line == "centralized: step 400/2000 (20%), loss/pred 0.93, 21 steps/s, ETA 76 s"
    assert format_line("site_a round 03", "step", 50, 50, 4.0, None) == "site_a round 03: step 50/50 (100%), 12.5 steps/s, 4.0 s"


def test_progress_prints_every_tenth_at_most_every_30_s_and_at_the_end(caplog):
    now = [0.0]
    progress = Progress("centralized", 100, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="lensemble.progress"):
        for step in range(1, 101):
            now[0] += 0.1
            progress.update(step, {"loss/pred": 1.0 / step})
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0] for line in lines] == [f"centralized: step {k}/100 ({k}%)" for k in range(10, 101, 10)]
    assert lines[-1] == "centralized: step 100/100 (100%), loss/pred 0.01, 10 steps/s, 10.0 s"

    caplog.clear()
    now[0] = 0.0
    slow = Progress("site_a round 00", 50, every_fraction=None, clock=lambda: now[0])  # one line a round unless slow
    with caplog.at_level(logging.INFO, logger="lensemble.progress"):
        for step in range(1, 51):
            now[0] += 1.0  # 1 s a step: a line every 30 s, then the last
            slow.update(step)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["site_a round 00: step 30/50 (60%)",
                                                                       "site_a round 00: step 50/50 (100%)"]


def test_the_progress_hook_leaves_training_bit_identical(tmp_path):
    """Same steps with and without the hook `site_train` passes: every parameter and loss equal bit for bit."""
    from lensemble.data.episodes import generate_episodes
    from lensemble.sim.registry import make_embodiment
    from lensemble.training import make_optimizer, train_steps
    from lensemble.workflow import build_model, sampler_for
    from tasks.train import loss_progress

    p = parse_params(micro_params())
    d = p.data
    env = make_embodiment("grid_point", d.image_size)
    eps = generate_episodes(env, p.run.seed, "site/site_a", 3, d.episode_length, d.expert_noise, d.random_fraction,
                            d.segment_length)
    runs = []
    for hook in (None, partial(loss_progress, Progress("site_a round 00", 5, every_fraction=0))):  # a line every step
        model = build_model(p, "site/site_a")
        log = train_steps(model, make_optimizer(model, p.train), [("grid_point", sampler_for(eps, p))], 5, train=p.train,
                          objective=p.objective, run_seed=p.run.seed, round_idx=0, data_key="site_a", on_step=hook)
        runs.append((model.state_dict(), log))
    (a, log_a), (b, log_b) = runs
    assert all(torch.equal(a[k], b[k]) for k in a) and log_a == log_b


# ------------------------------------------------------------ the CLI's logging switches


def test_offline_environment_sends_info_to_the_api_and_keeps_the_console_at_warning(tmp_path):
    code = f"""
import json, logging, os, sys
sys.path.insert(0, {str(REPO)!r})
for k in [k for k in os.environ if k.startswith(("PREFECT_LOGGING", "DO_NOT_TRACK"))]:
    del os.environ[k]
from flows.cli import offline_environment
from pathlib import Path
offline_environment(Path({str(tmp_path)!r}))
import prefect.main  # what `from prefect import flow` runs: configures logging from the environment
from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler
console = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
print(json.dumps({{
    "flow_runs": logging.getLogger("prefect.flow_runs").getEffectiveLevel(),
    "task_runs": logging.getLogger("prefect.task_runs").getEffectiveLevel(),
    "console": [h.level for h in console],
    "lensemble_to_api": any(isinstance(h, APILogHandler) for h in logging.getLogger("lensemble").handlers),
    "do_not_track": os.environ["DO_NOT_TRACK"],
}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"flow_runs": logging.INFO, "task_runs": logging.INFO, "console": [logging.WARNING], "lensemble_to_api": True,
                   "do_not_track": "1"}


def test_the_pipeline_flow_run_is_tagged_as_the_pipeline(tmp_path):
    from flows.runs import run_tags, stage_of
    from lensemble.observability.hardware import hardware_class
    from tests.conftest import make_project

    p = load_params(make_project(tmp_path / "proj", micro_params()) / "params.yaml")
    assert run_tags(stage_of("lensemble-pipeline"), p) == {"stage:pipeline", f"params:{p.hash()[:12]}",
                                                           f"hw:{hardware_class(p.run.hardware_class)}"}


# ------------------------------------------------------------ a stage's runs on a Prefect server


@pytest.fixture
def api_logs():
    """What `PREFECT_LOGGING_EXTRA_LOGGERS=lensemble` does in a CLI process: lensemble's INFO lines go to the API.

    `setLevel`, not an assignment to `level`: it clears the loggers' cached `isEnabledFor` answers, which an
    earlier test's progress lines (at the default WARNING) would otherwise keep for `lensemble.progress`."""
    from prefect.logging.handlers import APILogHandler

    handler = APILogHandler()
    logger = logging.getLogger("lensemble")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _task_runs(client, run_id, expected: set[str], timeout: float = 60.0) -> list:
    """The flow run's task runs once every `expected` name is among them (or the timeout passed): the Prefect server
    writes a task run from the events its client sends, so the last ones may land a moment after the flow returned."""
    from prefect.client.schemas.filters import FlowRunFilter

    deadline = time.monotonic() + timeout
    while True:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run_id]}))
        if expected <= {t.name for t in runs} or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def test_a_stage_run_is_named_tagged_and_logs_at_info(prefect_server, project, api_logs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    from flows.cli import stage_flow
    from lensemble.observability.hardware import hardware_class

    p = load_params(project / "params.yaml")
    state = stage_flow("prepare", project)(root=str(project), return_state=True)
    assert state.is_completed(), state.message
    api_logs.flush()  # the API log worker sends in batches
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        expected = {"generate-site_a", "generate-site_b", "generate-probe-grid_point", "generate-probe-grid_thruster"}
        tasks = _task_runs(client, run_id, expected)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id={"any_": [run_id]}))
    assert run.name == f"prepare-{p.hash()[:8]}"
    assert {"stage:prepare", f"params:{p.hash()[:12]}", f"hw:{hardware_class(p.run.hardware_class)}"} <= set(run.tags)
    assert expected <= {t.name for t in tasks}
    info = [(log.message, log.task_run_id) for log in logs if log.level == logging.INFO]
    assert any(msg.startswith(f"prepare: started flow run 'prepare-{p.hash()[:8]}' (http://") for msg, _ in info), info
    assert any(msg.startswith("prepare: finished in ") for msg, _ in info), info
    site_lines = [(msg, task) for msg, task in info if msg.startswith("generate site_a: episode 3/3 (100%)")]
    assert site_lines and site_lines[0][1] is not None  # logged inside the site's task run: its Logs tab shows it


def test_federation_task_runs_are_named_by_site_and_round_and_each_round_logs_a_line(prefect_server, project, api_logs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    from flows.cli import stage_flow

    for stage in ("prepare", "federate"):
        state = stage_flow(stage, project)(root=str(project), return_state=True)
        assert state.is_completed(), state.message
    api_logs.flush()
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        expected = {f"{part}-round-{r}-{what}" for r in ("00", "01") for part, what in (
            ("site_a", "train"), ("site_b", "train"), ("site_a", "announce"), ("site_b", "encode"))}
        expected |= {f"round-{r}-{what}" for r in ("00", "01") for what in ("aggregate", "gauge", "record")}
        expected |= {"preflight-federate", "site_a-adapt-head", "site_b-local-only-train"}
        task_runs = _task_runs(client, run_id, expected)
        names = {t.name for t in task_runs}
        logs = [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id={"any_": [run_id]}))]
    assert "stage:federate" in run.tags and run.name.startswith("federate-")
    assert not [t.name for t in task_runs if t.tags]  # untagged: no tag concurrency slot to take before each task
    assert expected <= names, sorted(expected - names)
    rounds = [m for m in logs if m.startswith("federate: round ")]
    assert [m.split(" done in ")[0] for m in rounds] == ["federate: round 00 (1 of 2)", "federate: round 01 (2 of 2)"], logs
    assert all("bytes on the wire, mean site loss/pred " in m for m in rounds)
    assert any(m.startswith("site_a round 01: step 3/3 (100%), loss/pred ") for m in logs), logs
