"""Budgets as data, pre-flight estimates and ceilings."""
from __future__ import annotations

import pytest
import yaml

from lensemble.budgets import evaluate_budgets, load_budgets, violations
from lensemble.config import parse_params
from lensemble.errors import BudgetExceeded, ConfigError
from lensemble.preflight import enforce, estimate, load_pricing, training_steps
from tests.conftest import REPO, micro_params

ENTRY = {"name": "b", "metric": "fed/round_seconds", "low": 0.0, "high": 10.0, "unit": "s", "stage": "federate",
         "hardware_class": "cpu-2c", "response": "investigate"}


def _write(tmp_path, entries):
    path = tmp_path / "budgets.yaml"
    path.write_text(yaml.safe_dump({"budgets": entries}))
    return path


def test_repo_budgets_and_pricing_load():
    assert len(load_budgets(REPO / "budgets.yaml")) >= 10
    assert "cpu-2c" in load_pricing(REPO / "pricing.yaml")


@pytest.mark.parametrize(
    "change, message",
    [({"low": 5.0, "high": 1.0}, "low (5.0) > high (1.0)"), ({"metric": "fed/nonsense"}, "unknown metric name"), ({"response": "panic"}, "response")],
)
def test_bad_budget_entries_name_the_entry(tmp_path, change, message):
    with pytest.raises(ConfigError, match="budget 'b'") as exc:
        load_budgets(_write(tmp_path, [{**ENTRY, **change}]))
    assert message in str(exc.value)


def test_statuses_within_below_above_not_measured_and_no_band(tmp_path):
    budgets = load_budgets(_write(tmp_path, [ENTRY, {**ENTRY, "name": "c", "metric": "fed/comm_bytes", "response": "error"}]))
    rows = {r["name"]: r for r in evaluate_budgets(budgets, "federate", "cpu-2c", {"fed/round_seconds": 3.0})}
    assert rows["b"]["status"] == "within" and rows["c"]["status"] == "not_measured"
    assert evaluate_budgets(budgets, "federate", "cpu-2c", {"fed/round_seconds": 11.0})[0]["status"] == "above"
    assert evaluate_budgets(budgets, "federate", "cpu-2c", {"fed/round_seconds": -1.0})[0]["status"] == "below"
    assert {r["status"] for r in evaluate_budgets(budgets, "federate", "gpu-x", {"fed/round_seconds": 3.0})} == {"no_band"}
    over = evaluate_budgets(budgets, "federate", "cpu-2c", {"fed/comm_bytes": 1e9})
    assert [r["name"] for r in violations(over)] == ["c"]  # only an `error` response is an error


def test_preflight_estimate_closed_form_and_ceilings():
    params = parse_params(micro_params())
    pricing = {"cpu-2c": {"usd_per_hour": 2.0, "sustained_tflops": 1.0}}
    est = estimate(params, "federate", flops_per_step=1e12, memory_bytes=2**30, update_bytes=1000, hw_class="cpu-2c", pricing=pricing)
    steps = 2 * (2 * 3 * 2) + 50 * 2  # (federated + local-only) rounds × H × sites + head adaptation × sites
    assert est["steps"] == steps and est["flops_total"] == 1e12 * steps
    assert est["accelerator_hours"] == pytest.approx(steps / 3600) and est["cost_usd"] == pytest.approx(2 * steps / 3600)
    assert est["bytes_total"] == 1000 * 2 * 2 and est["memory_gib"] == 1.0
    enforce(est, params, "federate")
    tight = parse_params({**micro_params(), "preflight": {"max_cost_usd": 0.001}})
    with pytest.raises(BudgetExceeded, match=r"pre-flight cost_usd .* exceeds preflight\.max_cost_usd = 0\.001;"):
        enforce(est, tight, "federate")
    for ceiling, key in (("max_accelerator_hours", "accelerator_hours"), ("max_memory_gib", "memory_gib"),
                         ("max_comm_bytes", "bytes_total")):
        tight = parse_params({**micro_params(), "preflight": {ceiling: 1e-6}})
        with pytest.raises(BudgetExceeded, match=rf"pre-flight {key} .* exceeds preflight\.{ceiling} = "):
            enforce(est, tight, "federate")
    with pytest.raises(ConfigError, match="no entry for hardware class 'gpu-z'"):
        estimate(params, "federate", flops_per_step=1.0, memory_bytes=1.0, update_bytes=1, hw_class="gpu-z", pricing=pricing)


def test_preflight_counts_local_only_baselines_only_when_they_are_trained():
    raw = micro_params()
    with_baselines = parse_params({**raw, "federate": {**raw["federate"], "local_only": True}})
    without = parse_params({**raw, "federate": {**raw["federate"], "local_only": False}})
    federated, head_adapt = 2 * 3 * 2, 50 * 2  # rounds × H × sites, head adaptation × sites
    assert training_steps(with_baselines, "federate") == 2 * federated + head_adapt
    assert training_steps(without, "federate") == federated + head_adapt
    assert training_steps(without, "centralized") == training_steps(with_baselines, "centralized")


def test_budgets_compare_reads_mlflow_prints_the_table_and_writes_the_plot(tmp_path, monkeypatch):
    import subprocess
    import sys

    from tests.conftest import REPO

    root = tmp_path / "cmp"
    root.mkdir()
    (root / "budgets.yaml").write_text((REPO / "budgets.yaml").read_text())
    uri = f"sqlite:///{root / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from orchestration.tracking import Tracker

    tracker = Tracker(root)
    parent = tracker.parent_run("cmp", {"lensemble.kind": "pipeline"})
    recorded = {("cpu-2c", 0.5), ("cpu-2c", 2.5), ("tpu-v5e", 1.0)}  # 2.5 is above its band; tpu-v5e has no band
    for hw, value in recorded:
        run_id = tracker.start_stage(parent, "federate", {"lensemble.stage": "federate", "lensemble.hardware_class": hw})
        tracker.client.log_metric(run_id, "fed/bytes_per_param", value)
        tracker.finish(run_id, ok=True)
    # a per-round metric whose last round is within its band [0.8, 1000] while the budget's value (the minimum over
    # rounds, as the report reads it) is below: compare must count the run below, as the report does
    run_id = tracker.start_stage(parent, "gauge", {"lensemble.stage": "gauge", "lensemble.hardware_class": "cpu-2c"})
    for step, value in enumerate((0.2, 0.9, 1.1)):
        tracker.client.log_metric(run_id, "gauge/effective_dim_vs_pooled", value, step=step)
    tracker.client.log_metric(run_id, "budget/effective_dim_vs_pooled", 0.2)
    tracker.finish(run_id, ok=True)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), "budgets", "compare"],
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr
    rows = {tuple(line.split()[:3]): line.split() for line in proc.stdout.splitlines() if line.startswith("wire_bytes_per_param")}
    cpu = rows[("wire_bytes_per_param", "federate", "cpu-2c")]
    assert cpu[3:6] == ["2", "0.5", "1.5"] and cpu[-3:] == ["0", "1/2", "1"]  # runs, min, median; below, within [0, 2.1], above
    gauge = next(line.split() for line in proc.stdout.splitlines() if line.startswith("effective_dim_vs_pooled"))
    assert gauge[4] == "0.2" and gauge[-3:] == ["1", "0/1", "0"]  # the budget's own value, counted below its band
    tpu = rows[("wire_bytes_per_param", "federate", "tpu-v5e")]
    assert "no" in tpu and "band" in tpu  # a class without bands is reported, never silently passed
    assert proc.stdout.strip().splitlines()[-1] == "plot: reports/plots/budgets_compare.png"
    assert (root / "reports" / "plots" / "budgets_compare.png").read_bytes()[:4] == b"\x89PNG"
