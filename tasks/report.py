"""Prefect task of the report stage: reports/report.md (verdict first), reports/budgets.json, the PNG plots and
the numeric plot files under reports/plots/ that `dvc plots diff` compares."""
from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NONE

from lensemble.errors import DataError
from lensemble.observability.hardware import hardware_string
from lensemble.report import (federated_loss_rows, plot_comm, plot_drift, plot_losses, plot_success, pooled_loss_rows,
                              render_markdown, round_rows, success_rows, verdicts)

INPUTS = ("centralized", "federate", "gauge", "eval")  # reports/<name>.json the report reads
BUDGET_STAGES = ("prepare", "residency", "centralized", "federate", "gauge", "evaluate")  # manifests with budget rows


@task(name="write-report", cache_policy=NONE)
def write_report(ctx) -> None:
    """Render the report, its plots, their data files and the budget table from the stages' reports and manifests
    into `ctx.out` (committed only when the stage succeeds)."""
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
    success = success_rows(verdicts(figures["eval"]))
    rounds = round_rows(figures["federate"], figures["gauge"])
    ctx.out.write_json("reports/plots/success.json", success)
    ctx.out.write_json("reports/plots/rounds.json", rounds)
    ctx.out.write_json("reports/plots/loss_curve.json", pooled_loss_rows(central_curve))
    ctx.out.write_json("reports/plots/federated_loss.json", federated_loss_rows(figures["federate"]))
    plot_success(success, ctx.out.path("reports/plots/success.png"))
    plot_losses(central_curve, figures["federate"], ctx.out.path("reports/plots/losses.png"))
    plot_drift(rounds, ctx.out.path("reports/plots/drift.png"))
    plot_comm(rounds, figures["federate"], ctx.out.path("reports/plots/comm_bytes.png"))
    text = render_markdown(figures, budgets, ctx.hw_class, hardware_string(), ctx.params.gauge.collapse_drop_fraction)
    ctx.out.path("reports/report.md").write_text(text)
    ctx.out.write_json("reports/budgets.json", budgets)
