"""Stage `report`: reports/report.md (verdict first), reports/budgets.json, the PNG plots and their data files."""
from __future__ import annotations

from prefect import flow

from flows.runs import STAGE_RUN
from orchestration.runner import stage_run
from tasks.report import write_report


@flow(name="report", **STAGE_RUN)
def report_flow(root: str = ".") -> None:
    with stage_run("report", root) as ctx:
        write_report(ctx)
