"""The prepared GPU check (`scripts/device_check.sh`): one JSON of what a CUDA machine does with Lensemble.

    bash scripts/device_check.sh                    # on a GPU machine: ≤ 8 minutes, writes reports/device_check.json
    bash scripts/device_check.sh --dry-run          # the same path on the CPU at toy sizes (a test runs it)

1. The ViT-L training step (`benchmarks.gpu_vitl.vitl_step`): bf16 autocast, fp32 master weights,
   AdamW; clip-samples/s, peak memory against `compute.memory_estimate`, MFU against the GPU's bf16
   `torch.mm` peak measured in the same run.
2. A 2-site federation round end to end on the device: a fresh project (two grid-world sites, one
   round), `prepare` then `federate` through the real flows (Prefect, MLflow, secure int8 transport)
   with `run.device` set to the device, twice in two folders; the two runs' `global_params_sha256`
   must agree (deterministic kernels, `run.deterministic`), and each stage's RunManifest records the
   device it ran on.
Exit status 0 when both ran and the hashes agree, 1 otherwise; the JSON says which part failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_vitl import vitl_step  # noqa: E402
from benchmarks.suite import LARGE, StepSetting  # noqa: E402

DRY_STEP = StepSetting("tiny", 32, 16, 2, 2, 2, "bf16")  # the CPU dry run's step: the same code at toy sizes


def round_params(device: str) -> dict:
    """Two grid-world sites, one DiLoCo round of a few steps, on `device`: the shortest real federation."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["run"]["device"] = device
    raw["data"].update(image_size=32, episode_length=8, probe_episodes=1, num_steps=3)
    raw["data"]["sites"] = [{"name": "site_a", "embodiment": "grid_point", "episodes": 4},
                            {"name": "site_b", "embodiment": "grid_thruster", "episodes": 4}]
    raw["model"]["patch_size"] = 8
    raw["objective"].update(sketch_dim=8, sigreg_tokens=64, rollout_steps=1)
    raw["train"].update(batch_size=4, precision="bf16")
    raw["federate"].update(rounds=1, inner_steps=4, head_adapt_steps=0, local_only=False)
    raw["evaluate"]["cem"].update(horizon=2, context=1, execute_steps=1)
    return raw


def federation_round(device: str, workdir: Path) -> dict:
    """`prepare` + `federate` in two fresh projects on `device`; their hashes, stage seconds and manifests' device."""
    from flows.federate import configured_flow
    from flows.prepare import prepare_flow

    runs = []
    for name in ("first", "second"):
        root = workdir / name
        root.mkdir(parents=True)
        (root / "params.yaml").write_text(yaml.safe_dump(round_params(device), sort_keys=False))
        for f in ("budgets.yaml", "pricing.yaml"):
            (root / f).write_text((REPO / f).read_text())
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
        t0 = time.perf_counter()
        prepare_flow(root=str(root))
        configured_flow(root)(root=str(root))
        fed = json.loads((root / "reports" / "federate.json").read_text())
        manifest = json.loads((root / "reports" / "manifests" / "federate.json").read_text())
        runs.append({"seconds": time.perf_counter() - t0, "global_params_sha256": fed["global_params_sha256"],
                     "round_seconds": fed["round_seconds_mean"], "comm_bytes_total": fed["comm_bytes_total"],
                     "manifest_device": manifest.get("device")})
    return {"runs": runs, "hashes_agree": runs[0]["global_params_sha256"] == runs[1]["global_params_sha256"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run every part on the CPU at toy sizes (no GPU needed)")
    parser.add_argument("--out", default=str(REPO / "reports" / "device_check.json"))
    parser.add_argument("--steps", type=int, default=10, help="timed ViT-L steps (after 3 warm-up steps)")
    ns = parser.parse_args(argv)
    if not ns.dry_run and not torch.cuda.is_available():
        print("device_check: no CUDA GPU on this machine; run with --dry-run to check the path on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if ns.dry_run else torch.device("cuda")
    result: dict = {"dry_run": ns.dry_run, "device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda, "errors": {}}
    t0 = time.perf_counter()
    try:
        result["vitl_step"] = vitl_step(DRY_STEP if ns.dry_run else LARGE, device, warmup=1 if ns.dry_run else 3,
                                        steps=2 if ns.dry_run else ns.steps)
    except Exception:  # noqa: BLE001 - the check reports each part's failure and goes on to the next
        result["errors"]["vitl_step"] = traceback.format_exc(limit=3)
    with tempfile.TemporaryDirectory(prefix="lensemble-device-check-") as tmp:
        try:
            result["federation_round"] = federation_round(device.type, Path(tmp))
        except Exception:  # noqa: BLE001
            result["errors"]["federation_round"] = traceback.format_exc(limit=3)
    result["seconds"] = time.perf_counter() - t0
    ok = not result["errors"] and result["federation_round"]["hashes_agree"]
    result["ok"] = ok
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    step = result.get("vitl_step")
    if step:
        print(f"device_check: {step['device']} step {step['step_s_best'] * 1e3:.1f} ms ({step['clip_samples_per_s']:.1f} clips/s), "
              f"MFU {step['mfu']:.3f}, peak memory {step['peak_memory_ratio']:.2f}x the estimate")
    fed = result.get("federation_round")
    if fed:
        print(f"device_check: 2-site round on {device.type}, hashes {'agree' if fed['hashes_agree'] else 'DIFFER'} "
              f"({fed['runs'][0]['global_params_sha256'][:16]}…)")
    for part, error in result["errors"].items():
        print(f"device_check: {part} failed: {error.strip().splitlines()[-1]}", file=sys.stderr)
    print(f"device_check: {'ok' if ok else 'FAILED'} in {result['seconds']:.0f} s -> {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
