"""End to end through Prefect and MLflow on a micro config: the pipeline, determinism, bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from lensemble.errors import ConfigError, DataError
from tests.conftest import make_project, micro_params
from tests.test_report_verdict import check_report_outputs

pytestmark = pytest.mark.e2e
STAGES = ("prepare", "residency", "centralized", "federate", "gauge", "evaluate", "report")


def _runs(root):
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lensemble")
    return client, client.search_runs([exp.experiment_id], max_results=1000)


def _local_only_is_the_in_process_model(project):
    """The local-only baseline trained beside the rounds (lowest-priority workers) is the bits the same body gives
    run here, one thread like a worker, after nothing else."""
    import torch

    from lensemble.config import load_params
    from lensemble.paths import Layout
    from orchestration.site_work import local_only_body

    params = load_params(project / "params.yaml")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local_only_body(params, Layout(project), "site_b", project / "local_here.pt")
    finally:
        torch.set_num_threads(threads)
    here = torch.load(project / "local_here.pt", weights_only=True)
    there = torch.load(project / "models" / "local" / "site_b.pt", weights_only=True)
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
    # reading its RankMe at the round marks changes nothing: the same steps without the reading give the same bits
    from lensemble.training import make_optimizer, train_steps
    from lensemble.workflow import build_model, load_site, place, sampler_for, site_embodiment, warm_start

    layout, steps = Layout(project), params.federate.rounds * params.federate.inner_steps
    model = build_model(params, "local/site_b")
    warm_start(model, params, layout)
    place(model, params)
    torch.set_num_threads(1)
    try:
        samplers = [(site_embodiment(params, "site_b"), sampler_for(load_site(layout, params, "site_b"), params))]
        train_steps(model, make_optimizer(model, params.train), samplers, steps, train=params.train, objective=params.objective,
                    run_seed=params.run.seed, round_idx=-2, data_key="site_b", schedule=(0, steps))
    finally:
        torch.set_num_threads(threads)
    plain = model.state_dict()
    assert all(torch.equal(here[k], plain[k]) for k in here)


def _probe_rows_name_their_episodes(project):
    """Each probe row's embodiment and episode: contiguous per episode, frames in time order, every PROBE_STRIDE-th."""
    import numpy as np

    from lensemble.config import load_params
    from lensemble.data.episodes import read_episodes
    from lensemble.data.windows import frames_to_tensor
    from lensemble.paths import Layout
    from lensemble.workflow import PROBE_STRIDE, embodiments, probe_frames_labelled

    params, layout = load_params(project / "params.yaml"), Layout(project)
    probe, labels, episodes = probe_frames_labelled(layout, params)
    assert len(labels) == len(episodes) == probe.shape[0]
    first = 0
    for emb in embodiments(params):
        eps = read_episodes(layout.probe(emb), params.data.image_size)
        E, L = eps.frames_ELHWC[:, ::PROBE_STRIDE].shape[:2]
        rows = [i for i, lab in enumerate(labels) if lab == emb]
        assert rows == list(range(rows[0], rows[0] + E * L))
        assert [episodes[i] for i in rows] == [first + e for e in range(E) for _ in range(L)]
        for e in range(E):  # the rows of probe episode first + e are that episode's frames, in order
            frames = probe[[i for i in rows if episodes[i] == first + e]]
            assert np.array_equal(frames.numpy(), frames_to_tensor(eps.frames_ELHWC[e, ::PROBE_STRIDE]).numpy())
        first += E


def _each_robot_against_its_site_trained_alone(project, client, children):
    """The gauge's per-robot reference: a site's local-only encoder's RankMe on its embodiment's probe rows, recomputed
    here from the model; the federated figure is the per-embodiment one; MLflow carries the lowest ratio."""
    import torch

    from lensemble.config import load_params
    from lensemble.gauge import effective_dim, pool_tokens
    from lensemble.paths import Layout
    from lensemble.training import encode_frames
    from lensemble.workflow import probe_frames_labelled, site_embodiment, site_names
    from orchestration.evaluation import load_local_only

    gauge = json.loads((project / "reports" / "gauge.json").read_text())
    alone = gauge["final"]["dimension_against_alone"]
    params, layout = load_params(project / "params.yaml"), Layout(project)
    probe, labels, _ = probe_frames_labelled(layout, params)
    assert sorted(alone["local_only"]) == site_names(params)
    for site in site_names(params):
        emb = site_embodiment(params, site)
        rows = torch.tensor([label == emb for label in labels])
        z = pool_tokens(encode_frames(load_local_only(params, layout, site), probe[rows]))
        # the baseline's worker encodes on one thread, this process on its own: the same figure to float32 rounding
        assert alone["local_only"][site] == pytest.approx(effective_dim(z)["rankme"], rel=1e-6)
        assert alone["federated_vs_local_only"][site] == pytest.approx(alone["federated"][emb] / alone["local_only"][site])
    # every round: each baseline recorded its RankMe at every round mark, its last the model's at the end; the gauge reads
    # each round's federated robot against it, the lowest round and site the figure, MLflow the lowest site each round
    fed = json.loads((project / "reports" / "federate.json").read_text())
    for site in site_names(params):
        curve = fed["local_only"][site]["effective_dim_curve"]
        assert [c["round"] for c in curve] == list(range(params.federate.rounds))
        assert curve[-1]["rankme"] == alone["local_only"][site]  # the end reading is the baseline's final model
        # its encoder freezes at a quarter of its steps (train.freeze_encoder_at), before the first mark: the reading stops moving
        assert params.train.freeze_encoder_at * params.federate.rounds * params.federate.inner_steps < params.federate.inner_steps
        assert len({c["rankme"] for c in curve}) == 1
    ratios = [(r["round"], r["vs_alone"]) for r in gauge["per_round"]]
    assert len(ratios) == params.federate.rounds and all(set(v) == set(site_names(params)) for _, v in ratios)
    assert gauge["effective_dim_vs_local_only_min"] == min(x for _, v in ratios for x in v.values())
    gauge_run = next(r for r in children if r.data.tags["lensemble.stage"] == "gauge")
    logged: dict[int, list[float]] = {}
    for m in client.get_metric_history(gauge_run.info.run_id, "gauge/effective_dim_vs_local_only"):
        logged.setdefault(m.step, []).append(m.value)
    assert sorted(logged) == [r for r, _ in ratios]
    assert all(min(v.values()) in logged[r] for r, v in ratios)
    assert gauge["effective_dim_vs_local_only_min"] in logged[0]  # the stage's figure, beside round 0's


def _planning_over_seeds_reproduces_the_stage(project, ev):
    """benchmarks/plan_seeds.py at CEM seed offset 0 is the evaluate stage's own draw (the same rates, from another
    process); a second offset is a second draw over the same episodes, counted beside the first."""
    from benchmarks.plan_seeds import plan_over_seeds
    from lensemble.config import load_params
    from lensemble.paths import Layout

    p = load_params(project / "params.yaml")
    res = plan_over_seeds(p, Layout(project), "site_a", ["federated", "oracle"], [0, 1])
    for name in ("federated", "oracle"):
        stage = ev["sites"]["site_a"][name]
        assert res[name]["rates"][0] == stage["success_rate"], name
        assert len(res[name]["rates"]) == 2 and res[name]["episodes"] == 2 * stage["episodes"]
        assert res[name]["mean"] == pytest.approx(sum(res[name]["rates"]) / 2)
        assert res[name]["ci_low"] <= res[name]["mean"] <= res[name]["ci_high"]
    with pytest.raises(ConfigError, match="unknown model 'pooled'"):
        plan_over_seeds(p, Layout(project), "site_a", ["pooled"], [0])


def test_pipeline_end_to_end(prefect_server, project):
    from flows.pipeline import pipeline_flow

    pipeline_flow(root=str(project))
    reports = project / "reports"
    for name in ("prepare", "residency", "centralized", "federate", "gauge", "eval", "budgets"):
        assert (reports / f"{name}.json").is_file(), name
    for stage in STAGES:
        manifest = json.loads((reports / "manifests" / f"{stage}.json").read_text())
        assert manifest["stage"] == stage and manifest["params_hash"] and manifest["hardware_class"]
        assert set(manifest["data_manifests"]) >= {"site_a", "site_b"}
    for png in ("losses", "drift", "comm_bytes"):
        assert (reports / "plots" / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    report = (reports / "report.md").read_text()
    assert "| site_a | grid_point |" in report and "wire_bytes_per_param" in report
    fed = json.loads((reports / "federate.json").read_text())
    assert fed["transport"] == "secure_int8" and len(fed["global_params_sha256"]) == 64
    _local_only_is_the_in_process_model(project)
    assert fed["bytes_per_param"] < 2.6  # 2 bytes/param + headers, keys and signatures on a tiny model
    ev = json.loads((reports / "eval.json").read_text())
    assert set(ev["sites"]["site_a"]) >= {"centralized", "federated", "local_only", "oracle", "random", "diagnostics"}
    _planning_over_seeds_reproduces_the_stage(project, ev)
    for emb in ("grid_point", "grid_thruster"):  # every table reads each model against the oracle and the floor
        assert {"centralized", "federated", "local_only", "oracle", "random", "of_oracle", "success_criterion"} <= set(ev["embodiments"][emb])
        assert ev["embodiments"][emb]["energy_terms"] == "proprio 0–1 ×1; image ×1"  # what the planner's energy weighs, in the table
        assert f"| {emb} | " in report and "| proprio 0–1 ×1; image ×1 |" in report
    diag = ev["sites"]["site_a"]["diagnostics"]["federated"]
    assert len(diag["rollout_vs_copy"]) == 2 and diag["action_sensitivity"] > 0 and diag["probe_r2"] <= 1.0
    assert diag["world_probe_r2"] == {}  # the grid's frames show nothing beyond the agent's proprioception
    assert "oracle" in report and "Dynamics diagnostics" in report and "world probe R²" in report
    records = [json.loads(line) for line in (reports / "metrics.jsonl").read_text().splitlines()]
    names = {r["name"] for r in records}
    assert {"loss/pred", "loss/proprio", "loss/sigreg", "loss/anchor", "fed/comm_bytes", "gauge/drift_angle_deg", "gauge/effective_dim",
            "gauge/effective_dim_vs_pooled", "eval/rollout_vs_copy", "eval/action_sensitivity", "eval/probe_r2",
            "eval/rollout_vs_copy/federated", "eval/success_rate/oracle"} <= names
    # the global model entering each round is diagnosed at every site
    per_round = [r for r in records if r["name"] == "eval/probe_r2" and r["round"] is not None]
    assert len(per_round) == 2 * 2
    assert all(set(r) == {"run_id", "stage", "round", "participant", "name", "value", "step", "timestamp"} for r in records)
    # the comms accountant: one fed/comm_bytes per (round, site), equal to the transport's own formula
    comm = [r for r in records if r["name"] == "fed/comm_bytes"]
    assert len(comm) == 2 * 2
    client, runs = _runs(project)
    parents = [r for r in runs if r.data.tags.get("lensemble.kind") == "pipeline"]
    children = [r for r in runs if r.data.tags.get("lensemble.kind") == "stage"]
    assert len(parents) == 1 and sorted(r.data.tags["lensemble.stage"] for r in children) == sorted(STAGES)
    for r in children:
        assert r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert r.info.status == "FINISHED"
        assert {"lensemble.hardware_class", "lensemble.git_commit", "lensemble.params_hash"} <= set(r.data.tags)
        manifest = f"reports/manifests/{r.data.tags['lensemble.stage']}.json"  # under its folder in the project
        assert manifest in {a.path for a in client.list_artifacts(r.info.run_id, "reports/manifests")}
        assert {"perf/tracking_seconds", "perf/tracking_background_seconds", "perf/stage_seconds"} <= set(r.data.metrics)
    by_stage = {r.data.tags["lensemble.stage"]: r.data.metrics for r in children}
    assert {"perf/encoder_forward_ms", "perf/predictor_step_fraction", "perf/objective_fraction", "perf/peak_memory_gib"} <= set(by_stage["centralized"])
    assert {"perf/comm_bytes_total", "perf/comm_reduction_vs_synchronous", "perf/gauge_round_fraction"} <= set(by_stage["federate"])
    assert by_stage["federate"]["perf/comm_bytes_total"] == fed["comm_bytes_total"]
    # the effective-dimension target holds over the whole run: its budget checks the lowest round, not the last
    gauge = json.loads((reports / "gauge.json").read_text())
    lowest = min(r["effective_dim"] for r in gauge["per_round"]) / gauge["final"]["latent_dim"]
    assert gauge["effective_dim_fraction_min"] == lowest
    assert by_stage["gauge"]["gauge/effective_dim_fraction"] == pytest.approx(lowest, rel=1e-12)
    # federated vs pooled at the same fraction of training, every round; the tripwire reads the same pairs
    ratios = [r["effective_dim"] / r["pooled_effective_dim"] for r in gauge["per_round"]]
    assert gauge["effective_dim_vs_pooled_min"] == pytest.approx(min(ratios))
    # and per embodiment: every round carries each robot's RankMe ratio and within-episode share ratio, the summary the
    # lowest of them; the tripwire reads those two (the whole-probe ratio also falls when the robots sit apart)
    within = [v for r in gauge["per_round"] for v in r["within_vs_pooled"].values()]
    temporal = [v for r in gauge["per_round"] for v in r["temporal_vs_pooled"].values()]
    assert len(within) == len(temporal) == len(gauge["per_round"]) * len(gauge["per_round"][0]["effective_dim_by_embodiment"])
    assert all(0.0 < v < 1.0 for r in gauge["per_round"] for v in r["temporal_share"].values())
    assert gauge["effective_dim_within_vs_pooled_min"] == pytest.approx(min(within))
    assert gauge["temporal_share_vs_pooled_min"] == pytest.approx(min(temporal))
    assert gauge["collapse_tripwire"] == bool(gauge["collapse_reasons"]) == any(x < 0.5 for x in within + temporal)
    # MLflow carries the lowest robot's within-episode share ratio once a round, the record's figure
    gauge_run = next(r for r in children if r.data.tags["lensemble.stage"] == "gauge")
    history = sorted(client.get_metric_history(gauge_run.info.run_id, "gauge/temporal_share_vs_pooled"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(min(r["temporal_vs_pooled"].values()))) for r in gauge["per_round"]]
    _probe_rows_name_their_episodes(project)
    _each_robot_against_its_site_trained_alone(project, client, children)
    _check_tracking_for_users(project, client, parents[0], children, records)
    check_report_outputs(project)


def _numbers_only(tree) -> bool:
    if isinstance(tree, dict):
        return bool(tree) and all(_numbers_only(v) for v in tree.values())
    return isinstance(tree, (int, float)) and not isinstance(tree, bool)


def _check_tracking_for_users(project, client, parent, children, records):
    """What DVC's and MLflow's UIs show: numeric metrics files, per-site keys, summaries, source and links."""
    from lensemble.observability.summary import flat

    summaries = {}
    for stage in STAGES[:-1]:
        summary = json.loads((project / "reports" / "metrics" / f"{stage}.json").read_text())
        assert _numbers_only(summary), stage  # no hashes, names or lists: `dvc metrics diff` compares numbers
        summaries[stage] = summary
    ev = json.loads((project / "reports" / "eval.json").read_text())
    assert summaries["evaluate"]["success_rate"]["federated"]["mean"] == pytest.approx(ev["mean_success_rate"]["federated"], rel=1e-5)
    exp = client.get_experiment_by_name("lensemble")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on the runs table
    by_stage = {r.data.tags["lensemble.stage"]: r for r in children}
    ev_run = by_stage["evaluate"]
    for site, row in ev["sites"].items():  # every site's value under its own key, none hiding another
        assert ev_run.data.metrics[f"eval/success_rate/federated/{site}"] == pytest.approx(row["federated"]["success_rate"])
    # the plain key is the mean over sites, as the report reads it
    assert ev_run.data.metrics["eval/success_rate/federated"] == pytest.approx(ev["mean_success_rate"]["federated"])
    fed_run = by_stage["federate"]
    comm = {(r["participant"], r["step"]): r["value"] for r in records if r["name"] == "fed/comm_bytes"}
    history = client.get_metric_history(fed_run.info.run_id, "fed/comm_bytes/site_b")
    assert sorted((m.step, m.value) for m in history) == sorted((step, v) for (site, step), v in comm.items() if site == "site_b")
    for stage, summary in summaries.items():  # the parent row compares configurations on the same numbers as DVC
        for key, value in flat(summary).items():
            assert parent.data.metrics[f"{stage}/{key}"] == pytest.approx(value), (stage, key)
    for r in children + [parent]:
        assert r.data.tags["mlflow.source.git.commit"] == r.data.tags["lensemble.git_commit"] and r.data.tags["mlflow.source.name"]
    for r in children:
        assert r.data.tags["prefect.flow_run_id"]  # the link to the Prefect flow run that ran the stage
    # a budget's value as its table read it (the lowest round), not the raw metric's last round
    gauge = json.loads((project / "reports" / "gauge.json").read_text())
    assert by_stage["gauge"].data.metrics["budget/effective_dim_vs_pooled"] == pytest.approx(gauge["effective_dim_vs_pooled_min"])
    parent = client.get_run(parent.info.run_id)  # as it stands after the last stage
    assert parent.data.tags["mlflow.note.content"].startswith("## Verdict")  # the description the run page opens with
    assert parent.info.end_time >= max(r.info.end_time for r in children) - 5000  # its duration spans its stages
    parent_files = {a.path for a in client.list_artifacts(parent.info.run_id, "reports")}
    assert "reports/report.md" in parent_files  # the report opens from the parent run
    plots = {a.path for a in client.list_artifacts(by_stage["report"].info.run_id, "reports/plots")}
    assert {"reports/plots/success.png", "reports/plots/success.json"} <= plots


def test_two_federations_with_one_seed_are_bitwise_identical(prefect_server, project, tmp_path, monkeypatch):
    from flows.federate import federate_flow
    from flows.prepare import prepare_flow

    prepare_flow(root=str(project))
    federate_flow(root=str(project))
    first = json.loads((project / "reports" / "federate.json").read_text())["global_params_sha256"]
    other = make_project(tmp_path / "other", micro_params())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{other / 'mlflow.db'}")
    prepare_flow(root=str(other))
    federate_flow(root=str(other))
    assert json.loads((other / "reports" / "federate.json").read_text())["global_params_sha256"] == first


def test_corrupt_site_data_fails_cleanly_and_marks_the_run_failed(prefect_server, project):
    from flows.centralized import centralized_flow
    from flows.prepare import prepare_flow

    prepare_flow(root=str(project))
    store = project / "data" / "sites" / "site_b" / "episodes.parquet"
    store.write_bytes(store.read_bytes()[: store.stat().st_size // 2])
    with pytest.raises(DataError, match="site_b/episodes.parquet"):
        centralized_flow(root=str(project))
    assert not (project / "reports" / "centralized.json").exists()
    assert not (project / "models" / "centralized.pt").exists()
    assert not (project / "reports" / "manifests" / "centralized.json").exists()
    _, runs = _runs(project)
    failed = [r for r in runs if r.data.tags.get("lensemble.stage") == "centralized"]
    assert failed and failed[0].info.status == "FAILED"
    assert "site_b/episodes.parquet" in failed[0].data.tags["lensemble.failure_reason"]


def test_a_tracking_store_that_cannot_open_fails_the_stage_and_commits_nothing(prefect_server, project, monkeypatch):
    # MLflow opens on a background thread while the stage body runs; its failure must still fail the stage.
    from flows.prepare import prepare_flow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'params.yaml' / 'mlflow.db'}")  # under a file
    with pytest.raises(ConfigError, match="MLflow tracking store .*params.yaml/mlflow.db cannot be opened"):
        prepare_flow(root=str(project))
    assert not (project / "reports" / "prepare.json").exists()
    assert not (project / "reports" / "manifests" / "prepare.json").exists()
    assert not (project / "data").exists() or not any((project / "data").rglob("*.parquet"))
    assert not any((project / ".staging").glob("*")) if (project / ".staging").exists() else True


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p["federate"].update(inner_steps=0), "federate.inner_steps must be >= 1, got 0"),
        (lambda p: p["federate"].update(bogus=1), "unknown key federate.bogus"),
        (lambda p: p["data"]["sites"][0].update(embodiment="nope"), "unknown embodiment 'nope'"),
        (lambda p: p["model"].update(patch_size=5), "model.patch_size (5) must divide data.image_size (16)"),
        (lambda p: p["evaluate"]["cem"].update(context=2, horizon=2),
         "evaluate.cem.context (2) + evaluate.cem.horizon (2) exceeds data.num_steps (3), the time positions the predictor is trained on"),
        (lambda p: p["evaluate"].update(success={"grid_point": "touch"}),
         "evaluate.success.grid_point: unknown success criterion 'touch'; grid_point knows ['position']"),
        (lambda p: p["model"].update(proprio_dim=1), "model.proprio_dim (1) is smaller than grid_point's proprioception (2)"),
    ],
)
def test_cli_params_errors_are_one_line_and_write_nothing(tmp_path, edit, message):
    params = micro_params()
    edit(params)
    root = make_project(tmp_path / "bad", params)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), "run", "prepare"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lensemble: error: ") and message in lines[0], proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["budgets.yaml", "params.yaml", "pricing.yaml"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--inner-steps", "4"], "ablation inner steps 4 must be a positive divisor of the run's 6 total inner steps"),
        (["--anchor-weight", "x"], "--inner-steps takes integers and --anchor-weight numbers"),
        (["--inner-steps", "3,6"], "the ablation needs"),  # no prepare/centralized outputs yet
    ],
)
def test_cli_ablation_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    root = make_project(tmp_path / "abl", micro_params())
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), "ablate", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lensemble: error: ") and message in lines[0], proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["budgets.yaml", "params.yaml", "pricing.yaml"]


def test_cli_unknown_stage_is_rejected(tmp_path):
    root = make_project(tmp_path / "p", micro_params())
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), "run", "nonsense"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "invalid choice" in proc.stderr
    assert yaml.safe_load((root / "params.yaml").read_text())["run"]["seed"] == 0


def test_a_run_over_its_ceiling_is_refused_before_training(prefect_server, project):
    from flows.federate import federate_flow
    from flows.prepare import prepare_flow
    from lensemble.errors import BudgetExceeded

    prepare_flow(root=str(project))
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["preflight"]["max_comm_bytes"] = 1000.0
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(BudgetExceeded, match="exceeds preflight.max_comm_bytes"):
        federate_flow(root=str(project))
    assert not (project / "models" / "sites").exists() and not (project / "reports" / "federate.json").exists()
    assert not (project / "audit" / "site_a.jsonl").exists()  # no site task ever ran


def test_federate_killed_mid_run_resumes_bitwise(prefect_server, project, tmp_path, monkeypatch):
    """SIGKILL the coordinator after its first committed round; the rerun resumes and ends bit-identical."""
    import os
    import signal
    import time

    from flows.federate import federate_flow
    from flows.prepare import prepare_flow

    params = micro_params()
    params["federate"].update(rounds=5)
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    prepare_flow(root=str(project))
    reference = make_project(tmp_path / "reference", params)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{reference / 'mlflow.db'}")
    prepare_flow(root=str(reference))
    federate_flow(root=str(reference))
    expected = json.loads((reference / "reports" / "federate.json").read_text())["global_params_sha256"]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    from prefect.settings import PREFECT_API_URL

    # the session's Prefect server: an ephemeral one of its own cost the coordinator its start-up before round 1 (this test 66 s -> 44 s)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    # its own process group: the kill takes its worker processes with it, as a machine crash would (killing the
    # coordinator alone left its spawned workers orphaned, asleep, after the test session)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "--root", str(project), "run", "federate"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt_dir = project / "checkpoints" / "federate"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not any(ckpt_dir.glob("*.ckpt")) and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpts = list(ckpt_dir.glob("*.ckpt"))
    assert ckpts, "the coordinator was killed before it committed a round"
    assert not (project / "reports" / "federate.json").exists()
    federate_flow(root=str(project))
    manifest = json.loads((project / "reports" / "manifests" / "federate.json").read_text())
    assert manifest["resumed_from_round"] >= 1
    assert json.loads((project / "reports" / "federate.json").read_text())["global_params_sha256"] == expected
    assert not list(ckpt_dir.glob("*.ckpt"))  # spent once the stage succeeded
