"""RunManifest: one JSON per stage (INV-MANIFEST), also logged to the stage's MLflow run."""
from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import time
from pathlib import Path

from lensemble.observability.hardware import hardware_class, hardware_string

LIBRARIES = ("torch", "numpy", "pyarrow", "pydantic", "prefect", "dvc", "mlflow", "cryptography")


# what the pipeline itself rewrites in a clone: not a change of the code or configuration that ran
PIPELINE_WRITTEN = ("dvc.lock", "reports")


def git_state(root: Path) -> tuple[str, bool]:
    """(commit, dirty) of the repository at `root`; ('unknown', True) outside git.

    Dirty means a tracked source file differs from the commit; `dvc.lock` and `reports/` (which
    every `dvc repro` rewrites, its DVC metrics and plots files included) do not count.
    """
    excluded = [f":(exclude){p}" for p in PIPELINE_WRITTEN]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded],
                                    cwd=root, capture_output=True, text=True, check=True).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that shape results."""
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = "absent"
    return out


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(
    *, run_id: str, stage: str, parent_run: str, started: float, root: Path, params: dict, params_hash: str,
    seeds: dict, hw_override: str, data_manifests: dict, artifacts: list[Path], budgets: list[dict], extra: dict | None = None,
) -> dict:
    """Assemble a RunManifest; artifact hashes are computed here, from the files as written."""
    commit, dirty = git_state(root)
    return {
        "run_id": run_id,
        "stage": stage,
        "parent_pipeline_run": parent_run,
        "started": started,
        "finished": time.time(),
        "git_commit": commit,
        "git_dirty": dirty,
        "params": params,
        "params_hash": params_hash,
        "seeds": seeds,
        "hardware": hardware_string(),
        "hardware_class": hardware_class(hw_override),
        "libraries": library_versions(),
        "data_manifests": data_manifests,
        "artifacts": {str(p): file_sha256(p) for p in artifacts if Path(p).is_file()},
        "budgets": budgets,
        **(extra or {}),
    }
