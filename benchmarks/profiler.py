"""`lensemble profile`: the compute profiler of the profiling plan (spec 08 §6) on one step setting.

    lensemble profile small --steps 3 --out reports/profile     (or: python -m benchmarks.profiler ...)

Runs `steps` training steps (after one warm-up step) of a benchmark step setting
(`benchmarks.suite.STEP_SETTINGS`) under `torch.profiler` and writes
  <out>/profile-<config>.json  a Chrome trace (chrome://tracing, https://ui.perfetto.dev)
  <out>/profile-<config>.txt   the plan's spans — encoder_forward, predictor_step, sigreg_anchor
                               (world_model_loss), backward, optimizer_step (train_steps) — as
                               time per step and share of the step, then the top operators.
Ad hoc, never in CI (spec 08 §6); nothing of the data is recorded, only op names and timings.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.suite import STEP_SETTINGS, StepSetting, bench_params, step_fixture
from lensemble.errors import LensembleError
from lensemble.model.sizes import vit_config
from lensemble.perf import torch_threads

SPANS = ("encoder_forward", "predictor_step", "sigreg_anchor", "backward", "optimizer_step")
TOP_OPS = 25


def setting_for(config: str) -> StepSetting:
    """The benchmark step of an encoder config (ConfigError for an unknown name)."""
    vit_config(config)
    return STEP_SETTINGS.get(config, StepSetting(config, 64, 16, 4, 2))


def span_table(prof: profile, steps: int, wall_s: float) -> str:
    """Milliseconds per step and share of the step of each plan span."""
    totals = {e.key: e.cpu_time_total for e in prof.key_averages() if e.key in SPANS}
    step_ms = wall_s / steps * 1e3
    lines = [f"{'span':<18}{'ms/step':>10}{'share':>9}", "-" * 37]
    for name in SPANS:
        ms = totals.get(name, 0.0) / 1e3 / steps
        lines.append(f"{name:<18}{ms:>10.1f}{ms / step_ms:>9.1%}")
    lines.append(f"{'step (wall)':<18}{step_ms:>10.1f}{1:>9.0%}")
    return "\n".join(lines)


def profile_step(config_name: str, steps: int, out_dir: Path, threads: int | None = None) -> Path:
    """Profile `steps` training steps of `config_name`; returns the Chrome trace's path."""
    setting = setting_for(config_name)
    fx = step_fixture(bench_params(setting))
    with torch_threads(threads):
        fx.run(1)  # warm-up: AdamW state, allocator and oneDNN caches
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            fx.run(steps)
            wall_s = time.perf_counter() - start
        used_threads = torch.get_num_threads()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"profile-{config_name}.json"
    prof.export_chrome_trace(str(trace))
    header = (
        f"lensemble profile {config_name}: {steps} steps of {setting}, torch {torch.__version__}, "
        f"{used_threads} threads\n\n"
    )
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)
    (out_dir / f"profile-{config_name}.txt").write_text(header + span_table(prof, steps, wall_s) + "\n\n" + ops + "\n")
    return trace


def profile_main(args: list[str]) -> int:
    """`lensemble profile [CONFIG] [--steps N] [--threads N] [--out DIR]`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="lensemble profile", description="Profile training steps; write a Chrome trace and a span table.")
    parser.add_argument("config", nargs="?", default="small", help="encoder config (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps after one warm-up (default: %(default)s)")
    parser.add_argument("--out", default="reports/profile", help="output folder (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's current setting)")
    ns = parser.parse_args(args)
    if ns.steps < 1:
        parser.error(f"--steps must be >= 1, got {ns.steps}")
    if ns.threads is not None and ns.threads < 1:
        parser.error(f"--threads must be >= 1, got {ns.threads}")
    try:
        trace = profile_step(ns.config, ns.steps, Path(ns.out), ns.threads)
    except LensembleError as exc:
        print(f"lensemble: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(trace.with_suffix(".txt").read_text())
    print(f"trace: {trace}")
    return 0


if __name__ == "__main__":
    sys.exit(profile_main(sys.argv[1:]))
