"""The stage runner: params, metrics sink, staged outputs, RunManifest and MLflow for one stage.

Outputs are written under a staging folder and moved into place only when the stage succeeded, so a
failed stage leaves nothing half-written in `reports/` or `models/`; its MLflow run is marked FAILED
with the reason.

MLflow is opened on a background thread while the stage body runs (import, SQL store, parent and
stage runs: ~3 s of CPU that would otherwise add to every stage); the body never needs the run id.
After the body: budgets, then wait for that thread, then the manifest, one batch of metrics, params
and tags, the manifest artifact and the datasets. `perf/tracking_seconds` is what tracking added to
the stage's wall time (budget evaluation, the wait, the recording); `perf/tracking_background_seconds`
is the overlapped opening and `perf/tracking_background_cpu_seconds` its CPU time (on a busy machine
an upper bound on what the opening took from the stage's own work). The opening and the metrics mirror run
niced while the body works and get the stage's priority back when the stage waits on them
(`BackgroundPriority`). If MLflow cannot be opened, the stage fails with that error and commits nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lensemble.budgets import evaluate_budgets, load_budgets, violations
from lensemble.config import Params, load_params
from lensemble.device import device_info, resolve_device
from lensemble.errors import BudgetExceeded, ConfigError
from lensemble.observability.hardware import hardware_class
from lensemble.observability.manifest import build_manifest, git_state
from lensemble.observability.metrics import MetricsSink
from lensemble.observability.summary import REPORTS, flat, summarize
from lensemble.paths import Layout
from orchestration.tracking import Tracker, patient, tracking_uri
from orchestration.workers import close_pools, thread_split


@dataclass
class Outputs:
    """Files a stage produces, staged until commit."""

    root: Path
    staging: Path
    written: list[Path] = field(default_factory=list)

    def path(self, rel: str) -> Path:
        """A staging path for `rel` (relative to the project root); the parent exists."""
        p = self.staging / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        self.written.append(Path(rel))
        return p

    def write_json(self, rel: str, obj: object) -> Path:
        p = self.path(rel)
        p.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        return p

    def commit(self) -> list[Path]:
        """Move every staged file into place (rename within one filesystem)."""
        final = []
        for rel in dict.fromkeys(self.written):
            src, dst = self.staging / rel, self.root / rel
            if src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
                final.append(dst)
        shutil.rmtree(self.staging, ignore_errors=True)
        return final


@dataclass
class StageContext:
    stage: str
    params: Params
    layout: Layout
    sink: MetricsSink
    out: Outputs
    hw_class: str
    seeds: dict = field(default_factory=dict)
    data_manifests: dict = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    extra_manifest: dict = field(default_factory=dict)

    def metric(self, name: str, value: float, step: int = 0, round_idx: int | None = None, participant: str | None = None) -> None:
        self.sink.log(name, value, step, round_idx, participant)


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def ledger_entry(ctx: StageContext, run_id: str, started: float) -> dict:
    """Estimate beside actual spend for one training stage run."""
    est = ctx.extra_manifest["preflight"]
    seconds = time.time() - started
    price = ctx.extra_manifest.get("usd_per_hour", 0.0)
    return {"run_id": run_id, "stage": ctx.stage, "hardware_class": ctx.hw_class, "params_hash": ctx.params.hash(),
            "finished": time.time(), "estimate": est, "actual": {"wall_seconds": seconds, "hours": seconds / 3600,
            "cost_usd": seconds / 3600 * price, **{k: v for k, v in ctx.measured.items()}}}


def append_ledger(path: Path, entry: dict) -> None:
    """Append one entry to the JSON-list ledger (rewritten atomically); the ledger spans runs, DVC does not own it."""
    entries = json.loads(path.read_text()) if path.is_file() else []
    entries.append(entry)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


@dataclass
class _OpenRun:
    tracker: Tracker
    parent: str
    run_id: str
    seconds: float
    cpu_seconds: float  # CPU time of the opening thread: an upper bound on what it took from the stage


CAP_SYS_NICE = 23  # linux/capability.h


def can_raise_priority(to: int, status: str | None = None, rlimit_nice: int | None = None) -> bool:
    """Whether this process may set a thread's niceness back down to `to` once it has raised it: with
    CAP_SYS_NICE in its effective set (`status`: /proc/self/status's text), or when RLIMIT_NICE's soft
    limit (`rlimit_nice`) allows niceness down to 20 - limit (setpriority(2)). False where neither is known."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NICE)[0] if rlimit_nice is None else rlimit_nice
        if limit == resource.RLIM_INFINITY or 20 - limit <= to:
            return True
    except (ImportError, AttributeError, ValueError, OSError):
        pass
    try:
        text = Path("/proc/self/status").read_text() if status is None else status
    except OSError:
        return False
    caps = next((line.split()[1] for line in text.splitlines() if line.startswith("CapEff:")), None)
    return caps is not None and bool(int(caps, 16) >> CAP_SYS_NICE & 1)


class BackgroundPriority:
    """A background thread's priority: lowest while the stage works beside it, the stage's own once the stage
    waits on it.

    `lower()` (in the thread) nices it to 19 (Linux schedules threads individually): it then runs on idle
    CPU only. A stage's torch ops keep every core busy; an opening at normal priority took a core from
    them and slowed a 2-thread training loop by more than its own CPU time (benchmarks/tracking_interference.py,
    one run at each niceness, an opening of 2.6 s CPU beside 200 steps: 4.98 s at 0, 2.10 s at 10, 0.05 s at
    19; the same run repeated moves by up to 1.2 s).

    `restore()` (by the stage, before it waits on the thread) gives it the stage's niceness back: the stage's
    own work is done, so the thread takes nothing from it, and at 19 on a machine busy with other work it
    got ~1.5% of a core (a gauge stage beside two busy processes: 103.7 s against 6.2 s quiet). Raising a
    priority needs CAP_SYS_NICE or a RLIMIT_NICE that allows it (`can_raise_priority`): where neither does,
    as for most unprivileged users, `lower()` leaves the thread at the stage's niceness, so it competes with
    the stage's work (the interference above) rather than starving for the rest of the stage once the stage
    waits on it. A thread restored before it lowered itself is never niced.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._native_id: int | None = None
        self._restored = False

    def lower(self) -> None:
        """Called by the background thread itself."""
        with self._lock:
            if self._restored:
                return
            try:
                if not can_raise_priority(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())):
                    return  # niced, it could never be handed the stage's priority back
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
                return
            self._native_id = threading.get_native_id()

    def restore(self) -> bool:
        """Called by the thread that is about to wait on it: the caller's niceness for the background thread."""
        with self._lock:
            self._restored = True
            if self._native_id is None:
                return True
            try:
                os.setpriority(os.PRIO_PROCESS, self._native_id, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            except ProcessLookupError:  # it has ended
                pass
            except OSError:  # raising a priority is not permitted here
                return False
            self._native_id = None
            return True


STREAM_SECONDS = 10.0  # how often a running stage's new metrics reach its MLflow run
ARTIFACT_MAX_BYTES = 8 << 20  # staged report files up to this size are logged as artifacts (models are not)


def mlflow_key(record: dict) -> str:
    """A record's MLflow key: per-site values get the site as the last segment, so no site hides another."""
    return record["name"] if record["participant"] is None else f"{record['name']}/{record['participant']}"


def site_means(records: list[dict]) -> list[tuple[str, float, int, float]]:
    """Under the plain key, the mean over sites of every per-site metric at each step (what the report reads)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        if r["participant"] is not None:
            groups.setdefault((r["name"], r["step"]), []).append(r)
    return [(name, sum(r["value"] for r in rs) / len(rs), step, max(r["timestamp"] for r in rs)) for (name, step), rs in groups.items()]


class MetricsMirror:
    """Sends the sink's records to the stage's MLflow run while the stage runs, then the rest at the end.

    A niced background thread waits for the run to open, then every `interval` seconds logs the records
    appended since its last batch (the sink only appends). `close` stops it and sends what is left.
    """

    def __init__(self, sink: MetricsSink, opening: Future, interval: float = STREAM_SECONDS) -> None:
        self.sink, self.opening, self.interval = sink, opening, interval
        self.priority = BackgroundPriority()
        self.sent = 0
        self.cpu_seconds = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlflow-stream", daemon=True)
        self._thread.start()

    def _send(self, run: _OpenRun) -> None:
        with self._lock:
            end = len(self.sink.records)
            batch = self.sink.records[self.sent:end]
            if batch:
                run.tracker.log(run.run_id, {}, [(mlflow_key(r), r["value"], r["step"], r["timestamp"]) for r in batch], {})
            self.sent = end

    def _loop(self) -> None:
        self.priority.lower()
        cpu0 = time.thread_time()
        try:
            run = self.opening.result()
            while not self._stop.wait(self.interval):
                self._send(run)
        except Exception:  # noqa: BLE001 - the stage's own wait on the opening reports the error; streaming is best effort
            pass
        finally:
            self.cpu_seconds = time.thread_time() - cpu0

    def stop(self) -> None:
        """Stop streaming (a failed stage: what was streamed stays on its FAILED run)."""
        self._stop.set()

    def close(self, run: _OpenRun) -> None:
        """Stop streaming and send every record not sent yet."""
        self.stop()
        self.priority.restore()  # a batch it is sending now finishes at the stage's priority
        self._thread.join()
        self._send(run)


def run_links() -> dict[str, str]:
    """Tags that link the MLflow run to the Prefect flow run and the DVC stage or experiment that made it.

    Read in the stage's own thread: Prefect's run context does not reach the background opening thread.
    """
    tags = {}
    try:
        from prefect.runtime import flow_run

        if flow_run.id:
            tags.update({"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": str(flow_run.name)})
            ui = os.environ.get("PREFECT_UI_URL") or (os.environ.get("PREFECT_API_URL", "").removesuffix("/api") or None)
            if ui:
                tags["prefect.flow_run_url"] = f"{ui}/runs/flow-run/{flow_run.id}"
    except Exception:  # noqa: BLE001 - outside a flow run there is nothing to link
        pass
    for env, tag in (("DVC_STAGE", "dvc.stage"), ("DVC_EXP_NAME", "dvc.experiment"), ("DVC_EXP_BASELINE_REV", "dvc.baseline_rev")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    return tags


def source_tags(stage: str, commit: str) -> dict[str, str]:
    """MLflow's own source tags: the UI's Source and Version columns, and the user."""
    import getpass

    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": f"lensemble run {stage}", "mlflow.source.git.commit": commit}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):
        pass
    return tags


def run_tags(stage: str, params: Params, root: Path) -> tuple[dict[str, str], str]:
    """The MLflow tags of a run of `stage` (or of the `pipeline`) and the key of its configuration's parent run."""
    commit, dirty = git_state(root)
    tags = {"lensemble.stage": stage, "lensemble.hardware_class": hardware_class(params.run.hardware_class),
            "lensemble.git_commit": commit, "lensemble.git_dirty": str(dirty), "lensemble.params_hash": params.hash(),
            **source_tags(stage, commit), **run_links()}
    return tags, f"{params.hash()[:16]}-{commit[:12]}{'-dirty' if dirty else ''}"


def _open_run(root: Path, pipeline_key: str, tags: dict[str, str], stage: str, priority: BackgroundPriority) -> _OpenRun:
    """Import MLflow, open the store, find or create the parent run and create the stage run."""
    priority.lower()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    try:
        tracker = Tracker(root)
        parent = tracker.parent_run(pipeline_key, tags)
        run_id = tracker.start_stage(parent, stage, tags)
    except Exception as exc:
        raise ConfigError(
            f"the MLflow tracking store {tracking_uri(root)} cannot be opened ({type(exc).__name__}: {exc});"
            " set MLFLOW_TRACKING_URI to a writable store"
        ) from exc
    return _OpenRun(tracker, parent, run_id, time.perf_counter() - t0, time.thread_time() - cpu0)


def _wait(opening: Future, priority: BackgroundPriority) -> tuple[_OpenRun, float]:
    t0 = time.perf_counter()
    if not opening.done():
        priority.restore()
    run = opening.result()
    return run, time.perf_counter() - t0


def stage_summary(ctx: StageContext) -> dict:
    """Write `reports/metrics/<stage>.json`, the stage's numeric summary (a DVC metrics file), from its staged report."""
    name = REPORTS.get(ctx.stage)
    staged = ctx.out.staging / "reports" / f"{name}.json"
    if name is None or not staged.is_file():
        return {}
    summary = summarize(ctx.stage, json.loads(staged.read_text()))
    ctx.out.write_json(f"reports/metrics/{ctx.stage}.json", summary)
    return summary


def verdict(report_md: Path) -> str | None:
    """The report's verdict section (markdown), which the parent run shows as its description."""
    if not report_md.is_file():
        return None
    text = report_md.read_text()
    start = text.find("## Verdict")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None].strip() + "\n\nThe whole report, plots and budgets: this run's artifacts, `reports/`."


def log_artifacts(run: _OpenRun, out: Outputs, manifest_path: Path, to_parent: bool) -> None:
    """The manifest and the stage's report files (not models or data) as artifacts, under their folder in the project."""
    files = [manifest_path] + [out.staging / rel for rel in dict.fromkeys(out.written)
                               if rel.parts[0] == "reports" and "manifests" not in rel.parts]
    for path in files:
        if path.is_file() and path.stat().st_size <= ARTIFACT_MAX_BYTES:
            subdir = str(path.parent.relative_to(out.staging))
            run.tracker.log_artifact(run.run_id, path, subdir)
            if to_parent:
                run.tracker.log_artifact(run.parent, path, subdir)


@contextmanager
def stage_run(stage: str, root: Path | str = ".", params_path: str = "params.yaml") -> Iterator[StageContext]:
    """Run one stage's body with tracking; see the module docstring."""
    layout = Layout(Path(root))
    started = time.time()
    params = load_params(layout.root / params_path)  # ConfigError before anything is created
    device = resolve_device(params.run.device)  # ConfigError (cuda asked for, none here) before anything is created
    tags, pipeline_key = run_tags(stage, params, layout.root)
    hw = tags["lensemble.hardware_class"]
    pool = ThreadPoolExecutor(1, thread_name_prefix="mlflow-open")
    opening_priority = BackgroundPriority()
    opening = pool.submit(_open_run, layout.root, pipeline_key, tags, stage, opening_priority)
    pool.shutdown(wait=False)
    staging = layout.root / ".staging" / f"{stage}-{uuid.uuid4().hex}"
    ctx = StageContext(stage, params, layout, MetricsSink(layout.metrics(), None, stage), Outputs(layout.root, staging), hw)
    ctx.seeds = {"run": params.run.seed}
    workers, threads = thread_split(params.run.torch_threads, params.run.workers)
    ctx.extra_manifest["device"] = {**device_info(device, params.run.deterministic), "workers": workers, "threads_per_worker": threads}
    for s in params.data.sites:
        if layout.site_manifest(s.name).is_file():
            ctx.data_manifests[s.name] = json.loads(layout.site_manifest(s.name).read_text())
    mirror = MetricsMirror(ctx.sink, opening)
    run: _OpenRun | None = None
    try:
        yield ctx
        close_pools()  # the stage's worker processes (orchestration.workers), started on first use
        ctx.measured.setdefault("perf/stage_seconds", time.time() - started)
        t_tracking = time.perf_counter()
        summary = stage_summary(ctx)
        budgets = load_budgets(layout.root / "budgets.yaml")
        rows = evaluate_budgets(budgets, stage, hw, ctx.measured, params)
        bad = violations(rows)
        if bad:
            raise BudgetExceeded(f"{stage}: invariant budget {bad[0]['name']} is {bad[0]['status']} its band ({bad[0]['value']})")
        run, _ = _wait(opening, opening_priority)
        ctx.sink.run_id = run.run_id
        manifest_rel = str(layout.manifest(stage).relative_to(layout.root))
        artifacts = [ctx.out.staging / p for p in ctx.out.written]
        manifest = build_manifest(
            run_id=run.run_id, stage=stage, parent_run=run.parent, started=started, root=layout.root,
            params=params.model_dump(mode="json"), params_hash=params.hash(), seeds=ctx.seeds, hw_override=params.run.hardware_class,
            data_manifests=ctx.data_manifests, artifacts=artifacts, budgets=rows, extra=ctx.extra_manifest,
        )
        manifest["artifacts"] = {str(Path(k).relative_to(ctx.out.staging)): v for k, v in manifest["artifacts"].items()}
        manifest_path = ctx.out.write_json(manifest_rel, manifest)
        from orchestration.datasets import (
            log_site_datasets,  # imports MLflow, which the opening thread has loaded
        )

        mirror.close(run)  # the records not streamed yet
        now = time.time()
        metrics = site_means(ctx.sink.records)
        metrics += [(k, float(v), 0, now) for k, v in ctx.measured.items()]
        # each budget's value as the budget table read it (a mean, a minimum), beside the raw per-round metric
        metrics += [(f"budget/{r['name']}", float(r["value"]), 0, now) for r in rows if r["value"] is not None]
        metrics.append(("perf/tracking_background_seconds", run.seconds, 0, now))
        metrics.append(("perf/tracking_background_cpu_seconds", run.cpu_seconds + mirror.cpu_seconds, 0, now))
        budget_tags = {f"budget.{r['name']}": r["status"] for r in rows}
        run.tracker.log(run.run_id, _flatten(params.model_dump(mode="json")), metrics, budget_tags)
        summary_metrics = [(f"{stage}/{k}", v, 0, now) for k, v in flat(summary).items()]
        run.tracker.log(run.run_id, {}, summary_metrics, {})
        run.tracker.log(run.parent, {}, summary_metrics, {})  # the parent's row in the runs table compares configurations
        log_artifacts(run, ctx.out, manifest_path, to_parent=stage == "report")
        log_site_datasets(run.tracker.client, run.run_id, ctx.data_manifests, layout.root)
        run.tracker.touch_parent(run.parent, verdict(ctx.out.staging / "reports" / "report.md"))
        # what budgets + MLflow added to this stage's wall time, itself recorded (target: ≤ 2% of the pipeline)
        tracking_seconds = time.perf_counter() - t_tracking
        patient(lambda: run.tracker.client.log_metric(run.run_id, "perf/tracking_seconds", tracking_seconds))
        ctx.sink.flush()
        ctx.out.commit()
        if "preflight" in ctx.extra_manifest:
            append_ledger(layout.reports / "ledger.json", ledger_entry(ctx, run.run_id, started))
        run.tracker.finish(run.run_id, ok=True)
    except BaseException as exc:
        close_pools()
        mirror.stop()
        shutil.rmtree(staging, ignore_errors=True)
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else "".join(traceback.format_exception_only(exc)).strip()
        if run is None and opening.exception() is None:
            run, _ = _wait(opening, opening_priority)
        if run is not None:
            run.tracker.finish(run.run_id, ok=False, reason=reason)
        raise
