"""How much the stage runner's background MLflow opening slows the stage it overlaps (A/B, same process).

    python benchmarks/tracking_interference.py [--repeats 3]

`tracking_share.py` counts what tracking adds to a stage's wall time directly (budget evaluation,
waiting for the opening, recording). The opening itself (import MLflow, open the SQL store, create
the parent and stage runs: `orchestration.runner._open_run`) runs on a thread beside the stage's work and
takes CPU from it. This measures that: two representative stage workloads, each timed alone (A)
and with a fresh opening on a background thread against a scratch store (B), in a fresh process per
measurement (MLflow must not be imported yet, as at a stage's start); best of `repeats` each.

- torch: 200 training steps of the default params' model on synthetic frames (2 threads), like
  centralized/federate/evaluate.
- python: a GIL-bound pure-Python loop, like data generation and the audit scan.

Prints each slowdown (B - A) beside the opening's own CPU time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, threading
from pathlib import Path
sys.path.insert(0, {root!r})
kind, with_opening, scratch = sys.argv[1], sys.argv[2] == "1", Path(sys.argv[3])
import torch, yaml
from lensemble.config import parse_params
from benchmarks.suite import EMBODIMENT, step_fixture
raw = yaml.safe_load((Path({root!r}) / "params.yaml").read_text())
raw["data"]["sites"] = [{{"name": "bench", "embodiment": EMBODIMENT, "episodes": 2}}]  # the default model, synthetic frames
params = parse_params(raw)
torch.set_num_threads(params.run.torch_threads)
fx = step_fixture(params) if kind == "torch" else None
fx.run(5) if fx else None  # warm-up outside the timed window
result = {{}}
def opening():
    from orchestration.runner import _open_run
    run = _open_run(scratch, "bench-key", {{"lensemble.stage": "bench"}}, "bench", priority)
    result.update(wall=run.seconds, cpu=run.cpu_seconds)
def work():
    if fx:
        fx.run(200)
    else:
        x = 0
        for i in range(30_000_000):
            x += i & 7
from orchestration.runner import BackgroundPriority
priority = BackgroundPriority()
start = time.perf_counter()
t = threading.Thread(target=opening) if with_opening else None
t.start() if t else None
work()
work_s = time.perf_counter() - start
priority.restore()  # as the stage does before it waits on the opening
t.join() if t else None
print(json.dumps({{"work_seconds": work_s, **result}}))
"""


def measure(kind: str, with_opening: bool, repeats: int) -> dict:
    best: dict | None = None
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="lensemble-interference-") as scratch:
            env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{scratch}/mlflow.db", "MLFLOW_DISABLE_TELEMETRY": "true"}
            out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), kind, "1" if with_opening else "0", scratch],
                                 capture_output=True, text=True, env=env, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        if best is None or r["work_seconds"] < best["work_seconds"]:
            best = r
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for kind in ("torch", "python"):
        alone, shared = measure(kind, False, args.repeats), measure(kind, True, args.repeats)
        slow = shared["work_seconds"] - alone["work_seconds"]
        print(f"{kind:<6} work alone {alone['work_seconds']:.2f} s, beside the opening {shared['work_seconds']:.2f} s:"
              f" slowed by {slow:.2f} s; the opening took {shared['wall']:.2f} s wall, {shared['cpu']:.2f} s CPU")


if __name__ == "__main__":
    main()
