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

Several processes share one SQLite store (DVC's stages, an ablation's points, a pipeline and its
stages). Two processes setting up a fresh store at once collide in MLflow's schema migrations, so the
set-up runs under a file lock beside the store. SQLite lets one writer at a time and MLflow's sessions
wait 20 s for the lock, which a loaded machine can exceed (a niced thread holding it), so every store
call retries "database is locked" until `LOCK_PATIENCE_SECONDS` have passed since its first try; any
other error is raised at once. Each store call is one transaction, so a retried call records once.
"""
from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
LOCK_PATIENCE_SECONDS = 180.0

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


@contextmanager
def _setup_lock(uri: str) -> Iterator[None]:
    """Processes set up one SQLite store in turn: a fresh store's schema migrations, run by two at once, collide.

    An exclusive `flock` on `<store>.lock` beside the file; nothing for a store that is not a local SQLite file.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_locked(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it wraps) is SQLite's "database is locked"."""
    while exc is not None:
        if "database is locked" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def patient(call: Callable[[], T], patience: float | None = None, pause: float = 0.25) -> T:
    """`call()`, retried while the store is locked, for `patience` seconds (default `LOCK_PATIENCE_SECONDS`).

    The pause doubles from `pause` up to 4 s. After the patience is spent the last error is raised.
    """
    deadline = time.monotonic() + (LOCK_PATIENCE_SECONDS if patience is None else patience)
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_locked(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, 4.0)


class Tracker:
    """A thin client bound to the lensemble experiment."""

    def __init__(self, root: Path) -> None:
        from mlflow.tracking import MlflowClient

        t0 = time.perf_counter()
        uri = tracking_uri(root)
        with _setup_lock(uri):
            self.client = patient(lambda: MlflowClient(tracking_uri=uri))  # opens the store: schema check, migrations
            exp = patient(lambda: self.client.get_experiment_by_name(EXPERIMENT))
            if exp is None:
                artifacts = _artifact_root(uri, root)
                self.experiment_id = patient(
                    lambda: self.client.create_experiment(EXPERIMENT, artifact_location=artifacts, tags=EXPERIMENT_KIND))
            else:
                self.experiment_id = exp.experiment_id
                if any(exp.tags.get(k) != v for k, v in EXPERIMENT_KIND.items()):  # a store made before the kind was set
                    for k, v in EXPERIMENT_KIND.items():
                        patient(lambda k=k, v=v: self.client.set_experiment_tag(self.experiment_id, k, v))
        self.setup_seconds = time.perf_counter() - t0  # store open/migration check, part of the tracking overhead

    def parent_run(self, pipeline_key: str, tags: dict[str, str]) -> str:
        """The parent run for this pipeline key, created on first use."""
        pinned = os.environ.get("LENSEMBLE_PIPELINE_RUN")
        if pinned:
            return pinned
        key_filter = f"tags.`lensemble.pipeline_key` = '{pipeline_key}'"
        found = patient(lambda: self.client.search_runs([self.experiment_id], filter_string=key_filter, max_results=1))
        if found:
            return found[0].info.run_id
        from mlflow.entities import RunStatus

        parent_tags = {k: v for k, v in tags.items() if k not in STAGE_ONLY_TAGS or tags.get("lensemble.stage") == "pipeline"}
        source = "lensemble pipeline" if tags.get("lensemble.stage") == "pipeline" else "dvc repro"
        run_tags = {**parent_tags, "mlflow.source.name": source, "lensemble.pipeline_key": pipeline_key, "lensemble.kind": "pipeline"}
        run = patient(lambda: self.client.create_run(self.experiment_id, run_name=parent_name(pipeline_key), tags=run_tags))
        patient(lambda: self.client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED)))
        return run.info.run_id

    def start_stage(self, parent: str, stage: str, tags: dict[str, str]) -> str:
        """A child run for one stage execution."""
        run_tags = {**tags, "mlflow.parentRunId": parent, "lensemble.kind": "stage", "lensemble.stage": stage}
        run = patient(lambda: self.client.create_run(self.experiment_id, run_name=stage, tags=run_tags))
        return run.info.run_id

    def log(self, run_id: str, params: dict[str, str], metrics: list[tuple[str, float, int, float]], tags: dict[str, str]) -> None:
        """Params, metrics (name, value, step, timestamp) and tags in batches."""
        from mlflow.entities import Metric, Param, RunTag

        param_list = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(param_list), 100):
            patient(lambda i=i: self.client.log_batch(run_id, params=param_list[i : i + 100]))
        metric_list = [Metric(n, v, int(ts * 1000), s) for n, v, s, ts in metrics]
        for i in range(0, len(metric_list), 1000):
            patient(lambda i=i: self.client.log_batch(run_id, metrics=metric_list[i : i + 1000]))
        patient(lambda: self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()]))

    def log_artifact(self, run_id: str, path: Path, subdir: str | None = None) -> None:
        patient(lambda: self.client.log_artifact(run_id, str(path), subdir))

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        patient(lambda: self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()]))

    def touch_parent(self, parent: str, description: str | None = None) -> None:
        """The parent's end time moves to now (its Duration spans its stages); `description` becomes its note."""
        from mlflow.entities import RunStatus

        if description is not None:
            patient(lambda: self.client.set_tag(parent, "mlflow.note.content", description))
        patient(lambda: self.client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED)))

    def finish(self, run_id: str, ok: bool, reason: str = "") -> None:
        """End the stage run: FINISHED, or FAILED with the reason as a tag."""
        from mlflow.entities import RunStatus

        if not ok:
            patient(lambda: self.client.set_tag(run_id, "lensemble.failure_reason", reason[:5000]))
        patient(lambda: self.client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)))
