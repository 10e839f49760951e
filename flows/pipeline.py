"""The whole pipeline as one Prefect flow: every stage a subflow, in DVC's order, one MLflow parent run."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from prefect import flow

from flows.centralized import centralized_flow
from flows.evaluate import evaluate_flow
from flows.federate import configured_flow, federate_flow
from flows.gauge import gauge_flow
from flows.prepare import prepare_flow
from flows.report import report_flow
from flows.residency import residency_flow
from flows.runs import STAGE_RUN, told

STAGE_FLOWS = (prepare_flow, residency_flow, centralized_flow, federate_flow, gauge_flow, evaluate_flow, report_flow)


@flow(name="lensemble-pipeline", **STAGE_RUN)
def pipeline_flow(root: str = ".") -> None:
    """Run every stage, each a subflow named and tagged as its stage; they share one MLflow parent run created here."""
    from lensemble.config import load_params
    from orchestration.runner import run_tags
    from orchestration.tracking import Tracker

    tags, key = run_tags("pipeline", load_params(Path(root) / "params.yaml"), Path(root))
    parent = Tracker(Path(root)).parent_run(f"{key}-{uuid.uuid4().hex[:8]}", tags)  # this flow run's own parent
    previous = os.environ.get("LENSEMBLE_PIPELINE_RUN")
    os.environ["LENSEMBLE_PIPELINE_RUN"] = parent
    try:
        for stage in STAGE_FLOWS:
            told(configured_flow(root) if stage is federate_flow else stage)(root=root)
    finally:
        if previous is None:
            os.environ.pop("LENSEMBLE_PIPELINE_RUN", None)
        else:
            os.environ["LENSEMBLE_PIPELINE_RUN"] = previous
