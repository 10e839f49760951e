"""The whole pipeline as one Prefect flow: every stage a subflow, in DVC's order, one MLflow parent run."""
from __future__ import annotations

import os
import uuid

from prefect import flow

from flows.centralized import centralized_flow
from flows.evaluate import evaluate_flow
from flows.federate import configured_flow, federate_flow
from flows.gauge import gauge_flow
from flows.prepare import prepare_flow
from flows.report import report_flow
from flows.residency import residency_flow

STAGE_FLOWS = (prepare_flow, residency_flow, centralized_flow, federate_flow, gauge_flow, evaluate_flow, report_flow)


@flow(name="lensemble-pipeline")
def pipeline_flow(root: str = ".") -> None:
    """Run every stage; the stages share one MLflow parent run created here."""
    from orchestration.tracking import Tracker

    tracker = Tracker(__import__("pathlib").Path(root))
    parent = tracker.parent_run(f"pipeline-{uuid.uuid4().hex}", {"lensemble.kind": "pipeline"})
    previous = os.environ.get("LENSEMBLE_PIPELINE_RUN")
    os.environ["LENSEMBLE_PIPELINE_RUN"] = parent
    try:
        for stage in STAGE_FLOWS:
            (configured_flow(root) if stage is federate_flow else stage)(root=root)
    finally:
        if previous is None:
            os.environ.pop("LENSEMBLE_PIPELINE_RUN", None)
        else:
            os.environ["LENSEMBLE_PIPELINE_RUN"] = previous
