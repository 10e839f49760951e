"""One point of the (H, λ_anc) ablation: a federation in its own folder, its gauge, its closed-loop success.

A grid point keeps the run's total inner steps T = rounds × H fixed and sets H and the anchor
weight λ_anc, so rounds = T / H: a smaller H communicates more often (more bytes), a larger H lets
each site's frame drift further between rounds. Each point runs in `ablation/<tag>/`, a project
folder of its own whose params are the run's with those three keys changed (and no local-only
baselines: the ablation compares federations). It shares the run's site data, public probe, Stage A
model and residency audit through links, and records to the run's MLflow store and Prefect server.
The `federate` and `gauge` stages run there as subprocesses (`lensemble run`), exactly as DVC
would run them; then the federated model is evaluated closed loop on every site's embodiment.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from lensemble.config import Params, parse_params
from lensemble.errors import ConfigError, DataError, LensembleError
from orchestration.tracking import tracking_uri


@dataclass(frozen=True)
class Point:
    inner_steps: int
    anchor_weight: float
    rounds: int

    @property
    def tag(self) -> str:
        return f"H{self.inner_steps}-anc{self.anchor_weight:g}"


def grid(params: Params, inner_steps: list[int], anchor_weights: list[float]) -> list[Point]:
    """Every (H, λ_anc) pair at the run's total inner steps; ConfigError for a value that cannot be run."""
    total = params.federate.rounds * params.federate.inner_steps
    if not inner_steps or not anchor_weights:
        raise ConfigError("the ablation needs at least one inner-steps value and one anchor weight")
    points = []
    for h in inner_steps:
        if h < 1 or total % h:
            raise ConfigError(f"ablation inner steps {h} must be a positive divisor of the run's {total} total inner steps (rounds x H)")
        for w in anchor_weights:
            if w < 0:
                raise ConfigError(f"ablation anchor weight {w} must be >= 0")
            points.append(Point(h, float(w), total // h))
    return points


def point_params(raw: dict, point: Point) -> dict:
    """The run's params (as YAML data) with the point's H, rounds and λ_anc, validated."""
    out = json.loads(json.dumps(raw))
    out["federate"].update(inner_steps=point.inner_steps, rounds=point.rounds, local_only=False)
    out["objective"]["anchor_weight"] = point.anchor_weight
    parse_params(out)  # ConfigError before anything runs
    return out


def _link(src: Path, dst: Path) -> None:
    """`dst` -> `src`, replacing what a previous run of the point left there."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    elif dst.is_symlink() or dst.exists():
        dst.unlink()
    dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def point_root(root: Path, raw: dict, point: Point) -> Path:
    """`ablation/<tag>/`: params, budgets and pricing of its own; links to the run's data, probe, Stage A model and audit."""
    sub = root / "ablation" / point.tag
    sub.mkdir(parents=True, exist_ok=True)
    (sub / "params.yaml").write_text(yaml.safe_dump(point_params(raw, point), sort_keys=False))
    for name in ("budgets.yaml", "pricing.yaml"):
        shutil.copy(root / name, sub / name)
    for rel in ("data/sites", "data/probe", "models/centralized.pt", "reports/residency.json", "reports/centralized.json"):
        _link(root / rel, sub / rel)
    return sub


def require_inputs(root: Path) -> None:
    """DataError naming the first input of the ablation that does not exist yet."""
    for rel in ("data/sites", "data/probe", "models/centralized.pt", "reports/residency.json", "reports/centralized.json"):
        if not (root / rel).exists():
            raise DataError(f"the ablation needs {root / rel}: run `dvc repro centralized` first")


def run_stage(sub: Path, stage: str, root: Path) -> None:
    """`lensemble run STAGE` in the point's folder, on this flow's Prefect server and MLflow store."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri(root), "PREFECT_HOME": os.environ.get("PREFECT_HOME", str(root / ".prefect"))}
    if PREFECT_API_URL.value():  # the server this flow reports to (project-local, exported, or a test harness)
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", stage], cwd=sub, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LensembleError(f"ablation point {sub.name}: stage {stage} failed: {last}")
