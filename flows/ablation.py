"""Flow `ablation`: a small (H, λ_anc) grid as a Prefect map, with drift and success against communication.

    lensemble ablate --inner-steps 25,150 --anchor-weight 0,0.1 [--parallel 1]

Needs the run's `prepare`, `residency` and `centralized` outputs. Each grid point is one mapped
task run (`tasks.ablation.run_point`; the grid and a point's folder: orchestration/ablation.py) in `ablation/<tag>/`; the flow writes `reports/ablation.json`
and `reports/plots/ablation_drift.png` and `ablation_success.png`, and records its own MLflow
stage run and RunManifest like every stage. It is not a DVC stage: it reruns federation several
times, which a plain `dvc repro` should not pay for.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow, unmapped

from flows.runs import STAGE_RUN
from lensemble.config import load_yaml
from lensemble.report import plot_ablation
from orchestration.ablation import grid, point_params, require_inputs
from orchestration.runner import stage_run
from tasks.ablation import run_point


@flow(name="ablation", **STAGE_RUN)
def ablation_flow(root: str = ".", inner_steps: tuple[int, ...] = (25, 150), anchor_weights: tuple[float, ...] = (0.0, 0.1)) -> list[dict]:
    with stage_run("ablation", root) as ctx:
        base = Path(root).resolve()
        raw = load_yaml(base / "params.yaml")
        points = grid(ctx.params, list(inner_steps), list(anchor_weights))
        for point in points:
            point_params(raw, point)  # every point's params are valid before anything runs
        require_inputs(base)
        results = run_point.map(unmapped(base), unmapped(raw), points).result()
        for i, r in enumerate(results):
            ctx.metric("eval/ablation/mean_success", r["mean_success"], step=i)
            ctx.metric("eval/ablation/comm_bytes", r["comm_bytes"], step=i)
            ctx.metric("eval/ablation/drift_angle_deg", r["drift_angle_deg_final"], step=i)
        ctx.out.write_json("reports/ablation.json", {"total_inner_steps": points[0].rounds * points[0].inner_steps, "points": results})
        plot_ablation(results, ctx.out.path("reports/plots/ablation_drift.png"), ctx.out.path("reports/plots/ablation_success.png"))
        return results
