"""The prepared GPU check (scripts/device_check.sh) runs its whole path on the CPU with --dry-run."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_dry_run_times_the_step_and_federates_twice_to_the_same_hash(tmp_path, prefect_server):
    from prefect.settings import PREFECT_API_URL

    out = tmp_path / "device_check.json"
    # the session's Prefect server: without one the script starts a temporary server of its own (~25 s)
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PREFECT_API_URL": PREFECT_API_URL.value()}
    run = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--dry-run", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["dry_run"] and not result["errors"]
    step = result["vitl_step"]
    assert step["setting"]["precision"] == "bf16" and step["step_s_best"] > 0 and 0 < step["mfu"] < 1
    assert step["peak_memory_bytes"] > 0 and step["memory_estimate_bytes"]["total"] > 0
    runs = result["federation_round"]["runs"]
    assert len(runs) == 2 and runs[0]["global_params_sha256"] == runs[1]["global_params_sha256"]
    assert all(r["manifest_device"]["type"] == "cpu" and r["manifest_device"]["deterministic"] for r in runs)
    assert "device_check: ok" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_and_without_dry_run_it_says_so_and_exits_2(tmp_path):
    run = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == "device_check: no CUDA GPU on this machine; run with --dry-run to check the path on the CPU"
    assert not (tmp_path / "x.json").exists()
