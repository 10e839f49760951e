"""Operations: site timeouts and retries, the Dask runner with 16 sites, sovereign sites over the
exchange, per-round Prefect artifacts, `lensemble serve` and `lensemble site deploy`, and their bad input."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from lensemble.errors import ConfigError
from tests.conftest import REPO, make_project, micro_params

pytestmark = pytest.mark.e2e


def _fed(root):
    return json.loads((root / "reports" / "federate.json").read_text())


def _edit(root, **federate):
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["federate"].update(federate)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def _pin_keys(root):
    """What each sovereign site does first: `lensemble site keygen SITE`, its fingerprint pinned in params."""
    from lensemble.paths import Layout
    from orchestration.site_agent import keygen

    raw = yaml.safe_load((root / "params.yaml").read_text())
    for s in raw["data"]["sites"]:
        s["key_fingerprint"] = keygen(Layout(root), s["name"])[0]
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def hangs_at_site_b(params, layout, site, round_idx, *args):
    """`site_train_body` for a site_b that never answers; run in a worker process (by name), so it notes each try
    in a file the test reads."""
    from orchestration.site_work import site_train_body

    if site == "site_b":
        with open(layout.root / "site_b.tries", "a") as f:
            f.write(f"{round_idx}\n")
        while True:  # the task's timeout stops the worker (orchestration.workers: an abandoned call)
            time.sleep(0.05)
    return site_train_body(params, layout, site, round_idx, *args)


def test_a_hung_site_is_retried_then_dropped_and_every_round_completes(prefect_server, project, monkeypatch):
    import tasks.train
    from flows.federate import federate_flow
    from flows.prepare import prepare_flow

    prepare_flow(root=str(project))
    # 8 s: a try at site_a may start after a worker restart (spawn + imports, ~3 s) and still finish in time
    _edit(project, site_timeout_seconds=8.0, site_retries=1, head_adapt_steps=0, local_only=False)
    monkeypatch.setattr(tasks.train, "site_train_body", hangs_at_site_b)
    t0 = time.monotonic()
    federate_flow(root=str(project))
    elapsed = time.monotonic() - t0
    fed = _fed(project)
    assert len(fed["per_round"]) == 2
    for r in fed["per_round"]:
        assert list(r["sites"]) == ["site_a"]
        assert "site_b" in r["dropped"] and "timeout" in r["dropped"]["site_b"].lower()
    assert (project / "site_b.tries").read_text().split() == ["0", "0", "1", "1"]  # every round: the first try and one retry
    assert elapsed < 120  # 2 rounds x 2 tries x 8 s, the work and the workers' restarts: never waits forever
    dropped = [json.loads(line) for line in (project / "reports" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(d["round"] for d in dropped if d["name"] == "perf/site_dropouts" and d["participant"] == "site_b") == [0, 1]


def test_each_round_publishes_prefect_artifacts_and_its_orchestration_overhead(prefect_server, project):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.federate import federate_flow
    from flows.prepare import prepare_flow

    prepare_flow(root=str(project))
    federate_flow(root=str(project))
    with get_client(sync_client=True) as client:
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["federation-round"])))
        notes = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["federation-round-summary"])))
    assert len(tables) >= 2 and len(notes) >= 2  # one version per round (other tests may add more)
    newest = sorted(tables, key=lambda a: a.created)[-1]
    rows = json.loads(newest.data) if isinstance(newest.data, str) else newest.data
    assert {r["site"] for r in rows} == {"site_a", "site_b"} and all(r["comm_bytes"] > 0 for r in rows)
    assert all("wire_bytes_per_param" in r["budget_status"] for r in rows)
    note = sorted(notes, key=lambda a: a.created)[-1]
    assert note.data.startswith("# Federation round 1") and "| budget | value | band | status |" in note.data
    ours = sorted((a for a in notes if a.flow_run_id == note.flow_run_id), key=lambda a: a.created)
    assert [a.data.splitlines()[0] for a in ours] == ["# Federation round 0", "# Federation round 1"]  # written in round order
    fed = _fed(project)
    for r in fed["per_round"]:
        assert 0 <= r["orchestration_seconds"] <= r["seconds"] and 0 < r["work_seconds"]
        assert abs(r["seconds"] - r["work_seconds"] - r["orchestration_seconds"]) < 1e-6 or r["orchestration_seconds"] == 0


def test_sixteen_sites_on_dask_match_the_thread_runner_bitwise(prefect_server, tmp_path, monkeypatch):
    from flows.federate import configured_flow
    from flows.prepare import prepare_flow

    raw = micro_params()
    raw["data"]["sites"] = [{"name": f"site_{i:02d}", "embodiment": ("grid_point", "grid_thruster")[i % 2], "episodes": 2}
                            for i in range(16)]
    raw["federate"].update(rounds=1, inner_steps=2, head_adapt_steps=0, local_only=False)
    shas = {}
    for runner in ("dask", "threads"):
        raw["federate"]["task_runner"] = runner
        root = make_project(tmp_path / runner, raw)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        prepare_flow(root=str(root))
        configured_flow(root)(root=str(root))
        fed = _fed(root)
        assert len(fed["per_round"][0]["sites"]) == 16 and not fed["per_round"][0]["dropped"]
        shas[runner] = fed["global_params_sha256"]
    assert shas["dask"] == shas["threads"]


def test_sovereign_sites_over_the_exchange_equal_local_federation_bitwise(prefect_server, project, tmp_path, monkeypatch):
    from flows.federate import federate_flow
    from flows.prepare import prepare_flow

    prepare_flow(root=str(project))
    _edit(project, head_adapt_steps=0, local_only=False)
    federate_flow(root=str(project))
    local = _fed(project)
    _pin_keys(project)
    _edit(project, execution="sovereign", site_launch="task", exchange="exchange")
    federate_flow(root=str(project))
    sovereign = _fed(project)
    assert sovereign["global_params_sha256"] == local["global_params_sha256"]
    assert [sorted(r["sites"]) for r in sovereign["per_round"]] == [["site_a", "site_b"]] * 2
    assert sovereign["comm_bytes_total"] == local["comm_bytes_total"]  # same protocol, same bytes per message
    key = project / "keys" / "site_a.ed25519"
    assert key.stat().st_mode & 0o777 == 0o600
    exchange = project / "exchange"
    pinned = yaml.safe_load((project / "params.yaml").read_text())["data"]["sites"][0]["key_fingerprint"]
    published = (exchange / "keys" / f"site_a-{pinned[:24]}.pub").read_bytes()  # named by its pin
    assert hashlib.sha256(published).hexdigest() == pinned and not list(exchange.glob("*/round-*"))  # spent messages removed
    assert list((project / "site_state" / "site_a").glob("*/state.pt"))  # the site's state stayed at the site


@pytest.mark.parametrize(
    "federate, message",
    [
        ({"exchange": "file:///proc/lensemble-no-such/exchange"}, "federate.exchange 'file:///proc/lensemble-no-such/exchange' cannot be reached"),
        ({"site_launch": "deployment"}, "work pool 'lensemble-site-a' of site site_a does not exist"),
    ],
)
def test_sovereign_bad_input_fails_before_any_round(prefect_server, project, federate, message):
    from flows.federate import federate_flow

    _pin_keys(project)
    _edit(project, **{"execution": "sovereign", "site_launch": "task", **federate})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        federate_flow(root=str(project))  # no data prepared: the checks come first
    assert not (project / "reports" / "federate.json").exists()
    assert not (project / "checkpoints").exists()


def _cli(root, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.parametrize(
    "serve, message",
    [
        ({"cron": "61 * * * *", "interval_seconds": None}, "serve: cron '61 * * * *' in time zone 'UTC' does not parse"),
        ({"cron": "0 * * * *"}, "serve: give exactly one of cron and interval_seconds"),
    ],
)
def test_serve_with_a_bad_schedule_is_one_line_and_starts_nothing(tmp_path, serve, message):
    raw = micro_params()
    raw["serve"] = serve
    root = make_project(tmp_path / "proj", raw)
    out = _cli(root, "serve")
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and message in out.stderr
    assert not (root / ".prefect").exists()


def test_serve_registers_the_pipeline_and_the_scheduled_rounds(prefect_server, project):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["serve"] = {"cron": "*/15 * * * *", "interval_seconds": None, "timezone": "Europe/Berlin"}
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "--root", str(project), "serve"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, found = time.monotonic() + 90, None
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline and found is None:
                try:
                    found = client.read_deployment_by_name("federate/federation-rounds")
                except Exception:
                    assert proc.poll() is None, proc.stderr.read()
                    time.sleep(0.5)
            assert found is not None, "federation-rounds was not registered"
            pipeline = client.read_deployment_by_name("lensemble-pipeline/pipeline")
        (schedule,) = found.schedules
        assert schedule.schedule.cron == "*/15 * * * *" and schedule.schedule.timezone == "Europe/Berlin" and schedule.active
        assert found.parameters == {"root": str(project.resolve())} and pipeline.parameters == found.parameters
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen, group: bool = False, grace: float = 30.0) -> None:
    """SIGTERM (the process group with `group`), then SIGKILL after `grace` s: a Prefect worker or server whose
    shutdown call to the test's SQLite API waits on a locked database (seen on a quiet 2-core machine) must not
    fail a test whose work is done."""
    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout=grace)


def test_site_deploy_refuses_a_missing_work_pool(prefect_server, project):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    out = _cli(project, "site", "deploy", "site_a", env=env)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert "work pool 'lensemble-site-a' of site site_a does not exist" in out.stderr
    assert not (project / "keys").exists()


def test_sovereign_sites_on_their_own_work_pools_with_real_workers(prefect_server, project):
    """Each site's round runs as a deployment run picked up by a real `prefect worker` on the site's pool."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    from flows.federate import federate_flow
    from flows.prepare import prepare_flow
    from flows.site import deploy_site

    prepare_flow(root=str(project))
    _edit(project, head_adapt_steps=0, local_only=False)
    federate_flow(root=str(project))
    local = _fed(project)["global_params_sha256"]
    _pin_keys(project)
    raw = yaml.safe_load((project / "params.yaml").read_text())
    pools = {s["name"]: f"pool-{s['name'].replace('_', '-')}-{uuid.uuid4().hex[:8]}" for s in raw["data"]["sites"]}
    for s in raw["data"]["sites"]:
        s["work_pool"] = pools[s["name"]]
    # generous: on a loaded 2-core machine the workers took over 120 s to pick up a run once
    raw["federate"].update(execution="sovereign", site_launch="deployment", site_timeout_seconds=300.0)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with get_client(sync_client=True) as client:
        for pool in pools.values():
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    for site in pools:
        deploy_site(project, site)
    # a worker asks for scheduled runs every second (Prefect's default: 10 s; this test 78 s -> 67 s)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    workers = [subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], cwd=project, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True) for pool in pools.values()]
    try:
        federate_flow(root=str(project))
    finally:
        for w in workers:
            _stop(w, group=True)
    fed = _fed(project)
    assert [sorted(r["sites"]) for r in fed["per_round"]] == [["site_a", "site_b"]] * 2 and not any(r["dropped"] for r in fed["per_round"])
    assert fed["global_params_sha256"] == local
