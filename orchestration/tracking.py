"""MLflow side of a stage: one parent run per pipeline run, one child run per stage.

The tracking URI is absolute (DVC experiments run in temporary copies): `MLFLOW_TRACKING_URI` if set,
else an SQLite file `mlflow.db` at the project root, with artifacts beside it in `mlartifacts/`.
The parent run is found by the `lensemble.pipeline_key` tag - the params hash and the git commit
(dirty or not, ignoring what DVC writes: `dvc.lock` and `reports/`) - so every stage of one
configuration lands under one parent, whichever stages DVC reruns; `LENSEMBLE_PIPELINE_RUN` (set by
`flows/pipeline.py`) pins it explicitly. A DVC experiment run in a temporary copy (`dvc exp run
--temp`, `--queue`) records into its workspace's store: DVC sets `DVC_ROOT` to that workspace.

The experiment is tagged `mlflow.experimentKind = custom_model_development`, so the MLflow UI opens
it on the runs table (an untagged experiment opens on the GenAI traces page).

MLflow is imported when a `Tracker` is made, not with this module: importing it and opening the SQL
store take about 3 s of CPU, which the stage runner spends on a background thread (see runner.py).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

EXPERIMENT = "lensemble"
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
STAGE_ONLY_TAGS = ("lensemble.stage", "mlflow.source.name", "prefect.flow_run_id", "prefect.flow_run_name", "prefect.flow_run_url", "dvc.stage")


def tracking_uri(root: Path) -> str:
    """The absolute tracking URI for this project (DVC's workspace when DVC runs a copy of it)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    home = Path(os.environ.get("DVC_ROOT") or root).resolve()
    return f"sqlite:///{home / 'mlflow.db'}"


def _artifact_root(uri: str, root: Path) -> str | None:
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    return None


def parent_name(pipeline_key: str) -> str:
    """`pipeline-<params hash, 8 hex>-<commit, 7 hex>[-dirty]` from a key `<params16>-<commit12>[-dirty][-...]`."""
    parts = pipeline_key.split("-")
    return "-".join(["pipeline", parts[0][:8], *(p[:7] for p in parts[1:2]), *(["dirty"] if "dirty" in parts[2:] else [])])


class Tracker:
    """A thin client bound to the lensemble experiment."""

    def __init__(self, root: Path) -> None:
        from mlflow.tracking import MlflowClient

        t0 = time.perf_counter()
        uri = tracking_uri(root)
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            self.experiment_id = self.client.create_experiment(EXPERIMENT, artifact_location=_artifact_root(uri, root), tags=EXPERIMENT_KIND)
        else:
            self.experiment_id = exp.experiment_id
            if any(exp.tags.get(k) != v for k, v in EXPERIMENT_KIND.items()):  # a store made before the kind was set
                for k, v in EXPERIMENT_KIND.items():
                    self.client.set_experiment_tag(self.experiment_id, k, v)
        self.setup_seconds = time.perf_counter() - t0  # store open/migration check, part of the tracking overhead

    def parent_run(self, pipeline_key: str, tags: dict[str, str]) -> str:
        """The parent run for this pipeline key, created on first use."""
        pinned = os.environ.get("LENSEMBLE_PIPELINE_RUN")
        if pinned:
            return pinned
        found = self.client.search_runs([self.experiment_id], filter_string=f"tags.`lensemble.pipeline_key` = '{pipeline_key}'", max_results=1)
        if found:
            return found[0].info.run_id
        from mlflow.entities import RunStatus

        parent_tags = {k: v for k, v in tags.items() if k not in STAGE_ONLY_TAGS or tags.get("lensemble.stage") == "pipeline"}
        source = "lensemble pipeline" if tags.get("lensemble.stage") == "pipeline" else "dvc repro"
        run = self.client.create_run(self.experiment_id, run_name=parent_name(pipeline_key),
                                     tags={**parent_tags, "mlflow.source.name": source, "lensemble.pipeline_key": pipeline_key,
                                           "lensemble.kind": "pipeline"})
        self.client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED))
        return run.info.run_id

    def start_stage(self, parent: str, stage: str, tags: dict[str, str]) -> str:
        """A child run for one stage execution."""
        run = self.client.create_run(self.experiment_id, run_name=stage, tags={**tags, "mlflow.parentRunId": parent, "lensemble.kind": "stage", "lensemble.stage": stage})
        return run.info.run_id

    def log(self, run_id: str, params: dict[str, str], metrics: list[tuple[str, float, int, float]], tags: dict[str, str]) -> None:
        """Params, metrics (name, value, step, timestamp) and tags in batches."""
        from mlflow.entities import Metric, Param, RunTag

        param_list = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(param_list), 100):
            self.client.log_batch(run_id, params=param_list[i : i + 100])
        metric_list = [Metric(n, v, int(ts * 1000), s) for n, v, s, ts in metrics]
        for i in range(0, len(metric_list), 1000):
            self.client.log_batch(run_id, metrics=metric_list[i : i + 1000])
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, run_id: str, path: Path, subdir: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), subdir)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def touch_parent(self, parent: str, description: str | None = None) -> None:
        """The parent's end time moves to now (its Duration spans its stages); `description` becomes its note."""
        from mlflow.entities import RunStatus

        if description is not None:
            self.client.set_tag(parent, "mlflow.note.content", description)
        self.client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED))

    def finish(self, run_id: str, ok: bool, reason: str = "") -> None:
        """End the stage run: FINISHED, or FAILED with the reason as a tag."""
        from mlflow.entities import RunStatus

        if not ok:
            self.client.set_tag(run_id, "lensemble.failure_reason", reason[:5000])
        self.client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED))
