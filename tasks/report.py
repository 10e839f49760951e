"""Prefect task of the report stage: reports/report.md, reports/budgets.json and the PNG plots."""
from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NONE

from lensemble.errors import DataError
from lensemble.observability.hardware import hardware_string
from lensemble.report import plot_losses, plot_series, render_markdown

INPUTS = ("centralized", "federate", "gauge", "eval")  # reports/<name>.json the report reads
BUDGET_STAGES = ("prepare", "residency", "centralized", "federate", "gauge", "evaluate")  # manifests with budget rows


@task(name="write-report", cache_policy=NONE)
def write_report(ctx) -> None:
    """Render the report, its plots and the budget table from the stages' reports and manifests into `ctx.out`."""
    reports = ctx.layout.reports
    figures = {}
    for name in INPUTS:
        path = reports / f"{name}.json"
        if not path.is_file():
            raise DataError(f"{path} does not exist: run its stage first")
        figures[name] = json.loads(path.read_text())
    budgets = []
    for stage in BUDGET_STAGES:
        m = ctx.layout.manifest(stage)
        if m.is_file():
            budgets += json.loads(m.read_text())["budgets"]
    central_curve = json.loads((reports / "plots" / "centralized_loss.json").read_text())
    plot_losses(central_curve, figures["federate"], ctx.out.path("reports/plots/losses.png"))
    rounds = figures["gauge"]["per_round"]
    drift = {"mean": [r["drift_angle_deg_mean"] for r in rounds], "max": [r["drift_angle_deg_max"] for r in rounds]}
    plot_series([r["round"] for r in rounds], drift, "Frame drift vs round-start global", "degrees",
                ctx.out.path("reports/plots/drift.png"))
    fed = figures["federate"]["per_round"]
    sites = sorted(fed[0]["sites"])
    plot_series([r["round"] for r in fed], {s: [r["sites"][s]["comm_bytes"] for r in fed] for s in sites},
                "On-wire bytes per round", "bytes", ctx.out.path("reports/plots/comm_bytes.png"))
    ctx.out.path("reports/report.md").write_text(render_markdown(figures, budgets, ctx.hw_class, hardware_string()))
    ctx.out.write_json("reports/budgets.json", budgets)
