"""The (H, λ_anc) ablation's Prefect task: one grid point (orchestration/ablation.py has the grid and the point's folder)."""
from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import load_params
from lensemble.paths import Layout
from lensemble.workflow import site_names
from orchestration.ablation import Point, point_root, run_stage
from orchestration.evaluation import evaluate_models


@task(name="ablation-point", task_run_name="ablation-{point.tag}", cache_policy=NONE)
def run_point(root: Path, raw: dict, point: Point) -> dict:
    """Federate, gauge and evaluate one grid point; returns its communication, drift and success."""
    sub = point_root(root, raw, point)
    for stage in ("federate", "gauge"):
        run_stage(sub, stage, root)
    params, layout = load_params(sub / "params.yaml"), Layout(sub)
    fed = json.loads((layout.reports / "federate.json").read_text())
    gauge = json.loads((layout.reports / "gauge.json").read_text())
    success = {site: evaluate_models(params, layout, site, ("federated",))["federated"] for site in site_names(params)}
    rounds = gauge["per_round"]
    return {
        "tag": point.tag, "inner_steps": point.inner_steps, "anchor_weight": point.anchor_weight, "rounds": point.rounds,
        "comm_bytes": fed["comm_bytes_total"],
        "drift_angle_deg_final": rounds[-1]["drift_angle_deg_mean"],
        "drift_angle_deg_mean": sum(r["drift_angle_deg_mean"] for r in rounds) / len(rounds),
        "effective_dim_fraction_min": gauge["effective_dim_fraction_min"],
        "effective_dim_vs_pooled_min": gauge["effective_dim_vs_pooled_min"],
        "success": success,
        "mean_success": sum(s["success_rate"] for s in success.values()) / len(success),
        "global_params_sha256": fed["global_params_sha256"],
    }
