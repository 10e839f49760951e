"""The metrics JSONL sink: the local record of truth, mirrored to MLflow by the stage runner.

One object per line: run_id, stage, round, participant, name, value, step, timestamp. Names must be
canonical (DESIGN.md §7); values must be finite-or-not floats (INV-REDACTION: scalars only).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

_GAUGE = ("drift_angle_deg", "drift_angle_max_deg", "procrustes_residual", "effective_dim", "effective_dim_fraction",
          "effective_dim_vs_pooled", "effective_dim_vs_local_only", "effective_dim_within_vs_pooled", "between_fraction",
          "temporal_share_vs_pooled", "rankme", "participation_ratio", "reflection")
_FED = ("comm_bytes", "quant_ratio", "round_seconds", "outer_step_seconds", "bytes_per_param")
CANONICAL = re.compile(rf"^(loss/(pred|proprio|sigreg|anchor)|gauge/({'|'.join(_GAUGE)})|fed/({'|'.join(_FED)})"
                       r"|dp/[a-z0-9_]+|eval/[a-z0-9_/]+|perf/[a-z0-9_/]+)$")


class MetricsSink:
    """Appends canonical scalar metrics to a JSONL file and keeps them for mirroring."""

    def __init__(self, path: Path, run_id: str | None, stage: str) -> None:
        self.path = Path(path)
        self.run_id = run_id  # may be set later: the stage runner opens its MLflow run in the background
        self.stage = stage
        self.records: list[dict] = []

    def log(self, name: str, value: float, step: int = 0, round_idx: int | None = None, participant: str | None = None) -> None:
        """Record one scalar; ValueError for a non-canonical name or a non-scalar value."""
        if not CANONICAL.match(name):
            raise ValueError(f"metric name {name!r} is not canonical (DESIGN.md §7)")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"metric {name} must be a scalar number, got {type(value).__name__}")
        self.records.append(
            {"stage": self.stage, "round": round_idx, "participant": participant,
             "name": name, "value": float(value), "step": int(step), "timestamp": time.time()}
        )

    def flush(self) -> None:
        """Append the buffered records to the JSONL file (called once the stage succeeded)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for rec in self.records:
                f.write(json.dumps({"run_id": self.run_id, **rec}, sort_keys=True) + "\n")

