"""What budget evaluation and MLflow recording cost the last pipeline run (issue target: <= 2% of its wall time).

    python benchmarks/tracking_share.py [ROOT]

Reads the project's MLflow store: the latest run of each of the seven stages, its
`perf/stage_seconds`, `perf/tracking_seconds` (what tracking added to the stage's wall time: budget
evaluation, waiting for the background MLflow opening, the recording) and
`perf/tracking_background_seconds` (the opening itself, overlapped with the stage's work) and
`perf/tracking_background_cpu_seconds` (its CPU time: the most it can have taken from the stage). The
pipeline's wall time is the span from the first stage run's start to the last one's end.
"""
from __future__ import annotations

import sys
from pathlib import Path

STAGES = ("prepare", "residency", "centralized", "federate", "gauge", "evaluate", "report")


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from orchestration.tracking import Tracker

    tracker = Tracker(root)
    latest = {}
    for stage in STAGES:
        found = tracker.client.search_runs([tracker.experiment_id], f"tags.`lensemble.stage` = '{stage}' and tags.`lensemble.kind` = 'stage'",
                                           order_by=["attributes.start_time DESC"], max_results=1)
        if not found:
            raise SystemExit(f"no {stage} run in {root}: run `dvc repro` first")
        latest[stage] = found[0]
    total = background = cpu = 0.0
    for stage, run in latest.items():
        m = run.data.metrics
        total += m.get("perf/tracking_seconds", 0.0)
        background += m.get("perf/tracking_background_seconds", 0.0)
        cpu += m.get("perf/tracking_background_cpu_seconds", 0.0)
        print(f"{stage:<12} stage {m.get('perf/stage_seconds', 0.0):7.1f} s   tracking {m.get('perf/tracking_seconds', 0.0):5.2f} s"
              f"   background opening {m.get('perf/tracking_background_seconds', float('nan')):5.2f} s")
    wall = (max(r.info.end_time for r in latest.values()) - min(r.info.start_time for r in latest.values())) / 1000
    print(f"tracking added {total:.2f} s to a {wall:.0f} s pipeline: {100 * total / wall:.2f}% of its wall time (target <= 2%)")
    print(f"the background openings took {background:.1f} s wall, {cpu:.1f} s CPU, overlapped with the stages' work;"
          f" counting all of that CPU as lost too gives {100 * (total + cpu) / wall:.2f}% (an upper bound)")


if __name__ == "__main__":
    main()
