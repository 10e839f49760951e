"""ViT-L training step on one CUDA GPU: bf16 autocast, fp32 master weights, AdamW — time and peak memory.

    python benchmarks/gpu_vitl.py                       # batch 16 x 4 frames, 224 px, patch 16
    python benchmarks/gpu_vitl.py --batch 32 --out reports/gpu_vitl.json

The step is the library's: `world_model_loss` (encoder, predictor with rollout, SIGReg at 64
directions / 17 knots, anchor on 16 probe frames) under `training.autocast_context("bf16")`, then
zero_grad, backward and `training.make_optimizer`'s AdamW, in `train_steps`' order. Inputs are random
tensors already on the GPU, so the figure is the model's, not the data loader's.

Recorded in the JSON, beside the limits measured in the same run: step time (best and median of
--steps after --warmup), clip-samples/s, counted FLOPs per step (`compute.step_flops`) and MFU
against a measured bf16 `torch.mm` peak, `torch.cuda.max_memory_allocated` against
`compute.memory_estimate`, the device name, the hardware string and class. Without CUDA it prints
one line and exits 0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.suite import LARGE, StepSetting, bench_params  # noqa: E402
from lensemble import compute  # noqa: E402
from lensemble.observability.hardware import hardware_class, hardware_string  # noqa: E402
from lensemble.perf import matmul_peak_gflops, peak_tensor_bytes  # noqa: E402
from lensemble.training import autocast_context, make_optimizer  # noqa: E402
from lensemble.workflow import build_model  # noqa: E402


def bf16_matmul_peak_tflops(n: int = 8192, repeats: int = 10) -> float:
    """Best bf16 TFLOP/s of an n x n `torch.mm` on the current GPU."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def vitl_step(setting: StepSetting, device: torch.device, warmup: int = 3, steps: int = 10) -> dict:
    """Time the library's training step of `setting` on `device` (bf16 autocast, fp32 master weights, AdamW) beside
    the device's measured matmul peak, and its peak memory beside `compute.memory_estimate`."""
    params = bench_params(setting)
    flops = compute.step_flops(params)["total"]  # meta device, before anything is on the device
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays fp32; the bf16 is autocast's
    with torch.random.fork_rng(devices=[]):
        model = build_model(params, "gpu_vitl").to(device)
    optimizer = make_optimizer(model, params.train)
    embodiment = next(iter(model.action_heads))
    shape = compute.step_shape(params)
    inputs = compute.step_inputs(model, shape, embodiment, torch.Generator().manual_seed(0))

    def step() -> None:
        with torch.device(device), autocast_context(setting.precision, device.type):  # tensors made in the loss land on `device`
            loss = compute.step_loss(model, params, inputs, embodiment)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak_bytes = torch.cuda.max_memory_allocated() if cuda else peak_tensor_bytes(step)
    counts = compute.param_counts(model)
    estimate = compute.memory_estimate(params, counts["total"], action_dim=compute.action_dim(model, embodiment))
    peak_tflops = bf16_matmul_peak_tflops() if cuda else matmul_peak_gflops() / 1e3
    best = min(times)
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "hardware": hardware_string(), "hardware_class": hardware_class(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "setting": vars(setting) | {"steps": steps, "warmup": warmup},
        "params": counts, "step_s_best": best, "step_s_median": statistics.median(times),
        "clip_samples_per_s": setting.batch_size / best, "flops_per_step": flops, "achieved_tflops": flops / best / 1e12,
        "matmul_peak_tflops": peak_tflops, "matmul_peak_kind": "bf16 torch.mm" if cuda else "fp32 torch.mm (CPU)",
        "mfu": flops / best / 1e12 / peak_tflops,
        "peak_memory_bytes": peak_bytes, "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "memory_estimate_bytes": estimate, "peak_memory_ratio": peak_bytes / estimate["total"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=LARGE.batch_size)
    parser.add_argument("--frames", type=int, default=LARGE.num_steps)
    parser.add_argument("--image", type=int, default=LARGE.image_size)
    parser.add_argument("--patch", type=int, default=LARGE.patch_size)
    parser.add_argument("--probe", type=int, default=LARGE.probe_batch)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="reports/gpu_vitl.json")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_vitl: no CUDA GPU on this machine; nothing measured")
        return 0
    setting = StepSetting("large", ns.image, ns.patch, ns.frames, ns.batch, ns.probe, "bf16")
    result = vitl_step(setting, torch.device("cuda"), ns.warmup, ns.steps)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{result['device']}: ViT-L step {result['step_s_best'] * 1e3:.1f} ms ({result['clip_samples_per_s']:.1f} clips/s), "
        f"MFU {result['mfu']:.3f} of {result['matmul_peak_tflops']:.0f} TFLOP/s bf16, peak {result['peak_memory_bytes'] / 2**30:.2f} GiB "
        f"vs estimate {result['memory_estimate_bytes']['total'] / 2**30:.2f} GiB -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
