"""`lensemble serve`: the pipeline and the federation rounds as deployments on the project's Prefect server.

Two deployments, served by this process (`prefect.serve`: it polls the server and runs each
scheduled or triggered flow run in a subprocess):

- `lensemble-pipeline/pipeline`: every stage in order (trigger it from the UI or `prefect deployment run`);
- `federate/federation-rounds`: a DiLoCo federation (resuming from its last committed round after a
  crash), on the schedule of `serve.cron` or `serve.interval_seconds`. Each round publishes its
  artifacts (`federation-round`, `federation-round-summary`) to the flow run in the UI.

Runs use the project's params, MLflow store and task runner; the schedule is checked when params load.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from lensemble.config import Params


def schedule_of(p: Params):
    """The Prefect schedule of the federation-rounds deployment."""
    from prefect.schedules import Cron, Interval

    if p.serve.cron is not None:
        return Cron(p.serve.cron, timezone=p.serve.timezone)
    return Interval(timedelta(seconds=p.serve.interval_seconds))


def deployments(root: Path, p: Params) -> list:
    """The RunnerDeployments `serve` registers and runs."""
    from flows.federate import configured_flow
    from flows.pipeline import pipeline_flow

    params = {"root": str(Path(root).resolve())}
    return [
        pipeline_flow.to_deployment(name="pipeline", parameters=params, description="Every Lensemble stage in DVC's order.",
                                    tags=["lensemble", "stage:pipeline"]),
        configured_flow(root).to_deployment(name="federation-rounds", parameters=params, schedule=schedule_of(p),
                                            description="DiLoCo rounds over every site; each round publishes drift, bytes and budgets.",
                                            tags=["lensemble", "federation", "stage:federate"]),
    ]


def serve_forever(root: Path, p: Params) -> None:
    """Register both deployments and run their flow runs until interrupted."""
    from prefect import serve

    serve(*deployments(root, p), print_starting_message=True, limit=1)
