"""Time `lensemble budgets compare` over N recorded stage runs (issue target: 100 runs in <= 5 s).

    python benchmarks/compare_runs.py [--runs 100]

Builds a scratch project (this repo's budgets.yaml, an empty params-free root) whose MLflow store
holds N stage runs recorded the way the stage runner records them (tags, ~60 params, every budget's
metric, budget.* tags) across two hardware classes, then runs the real CLI in a fresh process and
reports the wall time to the printed table and to the finished plot. The scratch folder is removed.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def populate(root: Path, runs: int) -> None:
    from mlflow.entities import Metric, Param, RunTag

    from lensemble.budgets import load_budgets
    from orchestration.tracking import Tracker

    budgets = load_budgets(root / "budgets.yaml")
    stages = sorted({b.stage for b in budgets})
    tracker = Tracker(root)
    rng = random.Random(0)
    parent = tracker.parent_run("bench-parent", {"lensemble.kind": "pipeline"})
    for i in range(runs):
        stage, hw = stages[i % len(stages)], ("cpu-2c", "gpu-h100x1")[i % 2]
        tags = {"lensemble.stage": stage, "lensemble.hardware_class": hw, "lensemble.params_hash": f"{i:064x}"}
        run_id = tracker.start_stage(parent, stage, tags)
        metrics = [Metric(b.metric, rng.uniform(b.low, b.high * 1.2 if b.high else 1.0), 0, 0) for b in budgets if b.stage == stage]
        params = [Param(f"section{j // 10}.key{j}", str(rng.random())) for j in range(60)]
        tracker.client.log_batch(run_id, metrics=metrics, params=params,
                                 tags=[RunTag(f"budget.{b.name}", "within") for b in budgets if b.stage == stage])
        tracker.finish(run_id, ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    scratch = Path(tempfile.mkdtemp(prefix="lensemble-compare-"))
    try:
        shutil.copy(ROOT / "budgets.yaml", scratch / "budgets.yaml")
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{scratch / 'mlflow.db'}"}
        os.environ.update(env)
        populate(scratch, args.runs)
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "budgets", "compare"], cwd=scratch, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        table_s, lines = None, []
        for line in proc.stdout:
            lines.append(line.rstrip())
            if table_s is None and line.startswith("-----"):
                table_s = time.perf_counter() - start
        proc.wait()
        total_s = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"compare failed: {proc.stderr.read().strip()}")
        counted = sum(int(line.split()[3]) for line in lines[2:] if line and not line.startswith("plot:"))
        print(f"runs recorded {args.runs}, values in the table {counted}")
        print(f"budgets compare: table printed after {table_s:.2f} s, plot written after {total_s:.2f} s (target <= 5 s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
