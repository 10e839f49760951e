"""What users compare in DVC and MLflow: one parent per configuration, numeric summaries, per-site keys, live metrics."""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from lensemble.observability.manifest import git_state
from lensemble.observability.metrics import MetricsSink
from lensemble.observability.summary import flat, summarize
from orchestration.runner import BackgroundPriority, MetricsMirror, _OpenRun, _wait, can_raise_priority, mlflow_key, site_means
from orchestration.tracking import Tracker, patient, tracking_uri


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_the_parent_key_ignores_what_the_pipeline_writes_but_not_source_edits(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@t")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "reports" / "metrics").mkdir(parents=True)
    for rel in ("dvc.lock", "reports/metrics/evaluate.json", "code.py"):
        (tmp_path / rel).write_text("a\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "c")
    commit, dirty = git_state(tmp_path)
    assert len(commit) == 40 and not dirty
    # a fresh clone's `dvc repro` rewrites dvc.lock and the DVC metrics files: still the same configuration
    (tmp_path / "dvc.lock").write_text("b\n")
    (tmp_path / "reports" / "metrics" / "evaluate.json").write_text("b\n")
    assert git_state(tmp_path) == (commit, False)
    (tmp_path / "code.py").write_text("b\n")  # an edited source file is a different configuration
    assert git_state(tmp_path) == (commit, True)


EVAL = {"embodiments": {"point": {"centralized": 0.9, "federated": 0.5, "local_only": 0.8, "oracle": 1.0, "random": 0.0625,
                                  "episodes": 16.0, "success_criterion": "within 3 cm"}},
        "mean_success_rate": {"centralized": 0.9, "federated": 0.5, "local_only": 0.8, "oracle": 1.0, "random": 0.0625},
        "sites": {"a": {"embodiment": "point", "diagnostics": {"federated": {"rollout_vs_copy": [0.5, 0.7], "action_sensitivity": 2.0,
                                                                                 "probe_r2": 0.75}}},
                  "b": {"embodiment": "point", "diagnostics": {"federated": {"rollout_vs_copy": [0.7, 0.9], "action_sensitivity": 3.0,
                                                                                 "probe_r2": 0.25}}}}}


def test_the_evaluation_summary_holds_numbers_only_with_site_means():
    s = summarize("evaluate", EVAL)
    assert s["success_rate"]["federated"] == {"point": 0.5, "mean": 0.5}
    assert s["dynamics"]["federated"] == {"latent_1step_vs_copy": 0.6, "action_sensitivity": 2.5, "probe_r2": 0.5}
    keys = flat(s)
    assert keys["success_rate/random/point"] == 0.0625 and all(isinstance(v, float) for v in keys.values())
    # push capture: the mean over the sites whose robot pushes its world only, absent when none does
    pushing = {**EVAL, "sites": {**EVAL["sites"], "b": {"embodiment": "pusht", "diagnostics": {"federated": {
        **EVAL["sites"]["b"]["diagnostics"]["federated"], "push_capture": 0.25}}}}}
    assert summarize("evaluate", pushing)["dynamics"]["federated"]["push_capture"] == 0.25


def test_the_federation_summary_derives_the_reduction_and_rounds_to_six_digits():
    fed = {"final_loss_pred": 0.123456789, "rounds": 15, "inner_steps": 50, "comm_bytes_total": 3_000, "bytes_per_param": 2.0,
           "quant_ratio": 0.5, "step_synchronous_bytes": 600_000, "round_seconds_mean": 7.0, "global_params_sha256": "ab" * 32,
           "transport": "secure_int8", "dp": {"enabled": True, "epsilon": 3.25}}
    s = summarize("federate", fed)
    assert s["comm_reduction_vs_synchronous"] == 200.0 and s["final_loss_pred"] == 0.123457 and s["dp_epsilon"] == 3.25
    assert "global_params_sha256" not in s and "transport" not in s


def test_per_site_records_get_their_own_keys_and_the_plain_key_is_their_mean():
    sink = MetricsSink(__import__("pathlib").Path("/dev/null"), None, "evaluate")
    for site, v in (("site_a", 0.25), ("site_b", 0.75)):
        sink.log("eval/success_rate/federated", v, participant=site)
    sink.log("perf/plan_total", 3.0)
    assert [mlflow_key(r) for r in sink.records] == ["eval/success_rate/federated/site_a", "eval/success_rate/federated/site_b", "perf/plan_total"]
    assert [(n, v, s) for n, v, s, _ in site_means(sink.records)] == [("eval/success_rate/federated", 0.5, 0)]


def test_metrics_reach_mlflow_while_the_stage_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = Tracker(tmp_path)
    parent = tracker.parent_run("k", {})
    run_id = tracker.start_stage(parent, "centralized", {})
    opening: Future = Future()
    opening.set_result(_OpenRun(tracker, parent, run_id, 0.0, 0.0))
    sink = MetricsSink(tmp_path / "m.jsonl", None, "centralized")
    mirror = MetricsMirror(sink, opening, interval=0.05)
    sink.log("loss/pred", 1.5, step=0)
    deadline = time.monotonic() + 30
    while "loss/pred" not in tracker.client.get_run(run_id).data.metrics and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tracker.client.get_run(run_id).data.metrics["loss/pred"] == 1.5  # before the stage ends
    sink.log("loss/pred", 0.5, step=1)
    mirror.close(opening.result())
    history = sorted((m.step, m.value) for m in tracker.client.get_metric_history(run_id, "loss/pred"))
    assert history == [(0, 1.5), (1, 0.5)]  # each record sent once


def test_an_experiment_made_before_the_kind_existed_gets_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    MlflowClient(uri).create_experiment("lensemble")
    tracker = Tracker(tmp_path)
    assert tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


OPEN_STORE = """
import sys
from pathlib import Path
from orchestration.tracking import Tracker
tracker = Tracker(Path(sys.argv[1]))
print(tracker.experiment_id, tracker.start_stage(tracker.parent_run("k-c0ffee", {}), "s", {}))
"""


def test_processes_opening_one_fresh_store_at_once_all_record_into_one_experiment(tmp_path, monkeypatch):
    """Without the set-up lock, two of three such processes died in MLflow's schema migrations ("duplicate column name")."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("LENSEMBLE_PIPELINE_RUN", raising=False)
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_STORE, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err.strip().splitlines()[-1:] for _, err in outs]
    rows = [out.split() for out, _ in outs]
    assert len({exp for exp, _ in rows}) == 1 and len({run for _, run in rows}) == 3
    tracker = Tracker(tmp_path)
    assert len(tracker.client.search_runs([tracker.experiment_id], "tags.`lensemble.kind` = 'pipeline'")) == 1


def _write(db):
    """One write with no busy wait of its own: SQLite's "database is locked" at once while another writer holds the lock."""
    with sqlite3.connect(db, timeout=0) as conn:
        conn.execute("INSERT INTO t VALUES (1)")
    return "written"


def _locked_store(tmp_path):
    db = tmp_path / "store.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x)")
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        _write(db)
    return db, holder


def test_a_store_call_waits_out_another_writers_lock_and_records_once(tmp_path):
    db, holder = _locked_store(tmp_path)
    release = threading.Timer(1.0, lambda: holder.execute("COMMIT"))
    release.start()
    calls = []
    assert patient(lambda: (calls.append(1), _write(db))[1], patience=60) == "written"
    release.join()
    assert len(calls) >= 2
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,)


def test_a_lock_held_past_the_patience_or_another_error_is_raised(tmp_path):
    db, holder = _locked_store(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        patient(lambda: _write(db), patience=0.6)
    assert time.monotonic() - t0 >= 0.6
    holder.execute("COMMIT")
    calls = []

    def fails():
        calls.append(1)
        raise sqlite3.OperationalError("no such table: t2")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        patient(fails, patience=60)
    assert len(calls) == 1  # only a lock is waited out


@pytest.mark.parametrize("dvc_root", [None, "ws"])
def test_a_dvc_experiment_in_a_temporary_copy_records_into_its_workspace(tmp_path, monkeypatch, dvc_root):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy = tmp_path / "tmp-copy"
    if dvc_root:
        monkeypatch.setenv("DVC_ROOT", str(tmp_path / dvc_root))
    else:
        monkeypatch.delenv("DVC_ROOT", raising=False)
    expected = (tmp_path / dvc_root if dvc_root else copy).resolve() / "mlflow.db"
    assert tracking_uri(copy) == f"sqlite:///{expected}"


def _niceness(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


NICE_RESTORABLE = can_raise_priority(os.getpriority(os.PRIO_PROCESS, 0))
NO_NICE_SKIP = "raising a thread's priority is not permitted here (no CAP_SYS_NICE, RLIMIT_NICE 0): background threads are never niced"


@pytest.mark.skipif(not NICE_RESTORABLE, reason=NO_NICE_SKIP)
def test_the_opening_runs_niced_beside_the_stage_and_at_the_stages_priority_once_the_stage_waits_on_it():
    priority, lowered, go, seen = BackgroundPriority(), threading.Event(), threading.Event(), {}

    def opening():
        priority.lower()
        seen["id"] = threading.get_native_id()
        lowered.set()
        go.wait(30)
        seen["while_waited_on"] = _niceness(seen["id"])
        return "run"

    own = _niceness(threading.get_native_id())
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(opening)
        assert lowered.wait(30)
        assert _niceness(seen["id"]) == 19  # beside the stage's work: idle CPU only
        threading.Timer(0.2, go.set).start()
        run, waited = _wait(future, priority)
    assert run == "run" and waited > 0
    assert seen["while_waited_on"] == own  # the stage waits on it: no longer starved by other work on the machine

    late = BackgroundPriority()  # restored before it lowered itself (the stage got there first): never niced
    assert late.restore()
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: (late.lower(), _niceness(threading.get_native_id()))[1]).result() == own


@pytest.mark.skipif(not NICE_RESTORABLE, reason=NO_NICE_SKIP)
def test_the_metrics_mirrors_thread_runs_niced_and_takes_the_stages_priority_when_handed_it(tmp_path):
    opening: Future = Future()  # never opens: the mirror's thread waits, niced
    mirror = MetricsMirror(MetricsSink(tmp_path / "m.jsonl", None, "gauge"), opening, interval=0.05)
    deadline = time.monotonic() + 30
    while mirror.priority._native_id is None and time.monotonic() < deadline:
        time.sleep(0.01)
    tid = mirror.priority._native_id
    assert tid is not None and _niceness(tid) == 19
    mirror.stop()
    assert mirror.priority.restore()
    assert _niceness(tid) == _niceness(threading.get_native_id())  # still waiting on the opening: alive
    opening.set_exception(RuntimeError("no store"))
    mirror._thread.join(30)
    assert not mirror._thread.is_alive()


def test_can_raise_priority_reads_the_capability_and_the_nice_limit():
    root_caps, no_nice = "CapEff:\t000001ffffffffff\n", "Name:\tpython\nCapEff:\t000001fffe7fffff\n"  # bit 23: CAP_SYS_NICE
    assert can_raise_priority(0, status=root_caps, rlimit_nice=0)
    assert not can_raise_priority(0, status=no_nice, rlimit_nice=0)  # an unprivileged user's default: nice only goes up
    assert can_raise_priority(0, status=no_nice, rlimit_nice=20)  # RLIMIT_NICE 20: down to 20 - 20 = 0
    assert not can_raise_priority(-5, status=no_nice, rlimit_nice=20)
    assert can_raise_priority(5, status=no_nice, rlimit_nice=15)
    assert not can_raise_priority(0, status="Name:\tpython\n", rlimit_nice=0)  # unknown: not assumed


SETPRIV = shutil.which("setpriv")


@pytest.mark.skipif(SETPRIV is None or not NICE_RESTORABLE, reason="needs setpriv and CAP_SYS_NICE to drop")
def test_without_cap_sys_nice_the_background_thread_is_never_niced():
    # The same process without CAP_SYS_NICE (RLIMIT_NICE 0): a thread niced to 19 could never be handed the stage's
    # priority back, and would starve once the stage waits on it, so it is left at the stage's niceness.
    script = (
        "import os, threading\n"
        "from orchestration.runner import BackgroundPriority, can_raise_priority\n"
        "p, seen = BackgroundPriority(), {}\n"
        "def body():\n"
        "    p.lower()\n"
        "    seen['nice'] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
        "t = threading.Thread(target=body); t.start(); t.join()\n"
        "own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
        "print(can_raise_priority(own), seen['nice'] == own, p.restore())\n"
    )
    drop = [SETPRIV, "--inh-caps=-sys_nice", "--ambient-caps=-sys_nice", "--bounding-set=-sys_nice"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([*drop, sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    if out.returncode != 0 and "setpriv" in out.stderr:
        pytest.skip(f"setpriv cannot drop the capability here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]
