"""Prefect + MLflow orchestration overhead of the last federation (issue 8 target: <= 5% of a round's wall time).

    python benchmarks/orchestration_share.py [ROOT]

Per round, from `reports/federate.json`: the round's wall time, the critical path of the work
itself (global probe embedding, the slowest site's training task body, the slowest announce and
encode task bodies, the aggregation task body, the gauge's probe embedding and task body) and the
rest, which is Prefect's: task submission, state tracking, retries' bookkeeping, the round's
artifacts. MLflow adds nothing inside a round (metrics go to the local sink); its cost is the
stage's `perf/tracking_seconds` from the MLflow run, spread over the rounds here, and the
background opening's CPU time, counted in full as an upper bound.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    fed = json.loads((root / "reports" / "federate.json").read_text())
    rounds = fed["per_round"]
    for r in rounds:
        print(f"round {r['round']}: wall {r['seconds']:7.2f} s   work {r['work_seconds']:7.2f} s   Prefect {r['orchestration_seconds']:5.2f} s"
              f"   ({100 * r['orchestration_seconds'] / r['seconds']:.2f}%)")
    from orchestration.tracking import Tracker

    tracker = Tracker(root)
    found = tracker.client.search_runs([tracker.experiment_id], "tags.`lensemble.stage` = 'federate' and tags.`lensemble.kind` = 'stage'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
    m = found[0].data.metrics if found else {}
    wall = sum(r["seconds"] for r in rounds)
    prefect = sum(r["orchestration_seconds"] for r in rounds)
    mlflow = m.get("perf/tracking_seconds", 0.0)
    cpu = m.get("perf/tracking_background_cpu_seconds", 0.0)
    print(f"Prefect {prefect:.2f} s + MLflow {mlflow:.2f} s over {len(rounds)} rounds of {wall:.1f} s:"
          f" {100 * (prefect + mlflow) / wall:.2f}% of the rounds' wall time (target <= 5%)")
    print(f"counting the background MLflow opening's {cpu:.2f} s of CPU as lost too: {100 * (prefect + mlflow + cpu) / wall:.2f}% (an upper bound)")


if __name__ == "__main__":
    main()
