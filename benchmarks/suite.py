"""The benchmark suite (`lensemble bench`): every figure beside a physical limit measured in the same run.

    lensemble bench                              # everything, reports/bench.json
    python -m benchmarks.suite small.mfu wire --smoke

Limits, at the current torch thread count:
  peak.matmul_gflops  best fp32 `torch.mm` of 2048² matrices, before and after the step benchmarks
                      (the MFU denominator)
  peak.copy_gbps      memory copy bandwidth (`perf.copy_bandwidth`, one thread)

Benchmarks (a name selects itself or, as a prefix, a group: "small", "wire"):
  <cfg>.mfu                counted FLOPs per step (`compute.count_step_flops`) / best step time / peak
  <cfg>.sigreg_fraction    (SIGReg forward+backward timed alone + the anchor's marginal step time) / best step time
  <cfg>.peak_memory_ratio  measured peak tensor bytes of a step / `compute.memory_estimate`
  large.params, large.memory_estimate_gib   ViT-L, counted on the meta device (no step on CPU)
  wire.keystream, wire.quant_mask, wire.client, wire.aggregate   `benchmarks.wire` (client and aggregate: the whole
                           path of a site and of the aggregator, native and eager, beside their copy floors)
with <cfg> in tiny, small. A step is one `training.train_steps` step (data sampling, forward,
backward, AdamW) of a federated inner step: fp32, the default objective (64 directions, 17 knots,
512 SIGReg tokens, anchor on 16 probe frames), 64x64 frames in 16x16 patches (16 tokens, ViT-L/16's
patch), Windows of 4 frames, batch 16 (tiny) and 8 (small): 64 and 32 frames a step, so the anchor's
16 probe frames weigh as in the default params (batch 16 x 4 frames), and a step takes ~0.5-2 s on
2 cores. SIGReg and the anchor are timed alone (forward + backward of each term, the anchor through
the encoder), because the backward of a span cannot be told apart inside one step.

Peak memory is `perf.peak_tensor_bytes` (torch.profiler, profile_memory=True): the running sum of
every allocation and free the CPU allocator reports during the first two steps of a fresh model (the
second has last step's gradients and the AdamW moments alive, as every later step does), plus the
parameters' bytes, the only tensors of the step alive before it (the caller's probe set is not the
step's; the step's copy of its probe batch is counted). It counts tensor bytes, as
`torch.cuda.max_memory_allocated` does on a GPU, not the allocator's slack or library scratch space.

Results are a flat dict of floats, keyed like `small.mfu`; `reports/bench.json` holds them with the
hardware string and class, torch version, thread count and the settings.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks import wire
from lensemble import compute
from lensemble.config import CemParams, DataParams, EvaluateParams, ModelParams, ObjectiveParams, Params, SiteParams, TrainParams
from lensemble.data.episodes import Episodes
from lensemble.data.windows import WindowSampler
from lensemble.errors import ConfigError, LensembleError
from lensemble.objectives.sigreg import random_directions, sigreg
from lensemble.observability.hardware import hardware_class, hardware_string
from lensemble.perf import MATMUL_SIZE, best_seconds, copy_bandwidth, matmul_peak_gflops, peak_tensor_bytes, torch_threads
from lensemble.training import encode_frames, make_optimizer, train_steps
from lensemble.workflow import build_model

EMBODIMENT = "grid_point"  # the built-in numpy world: building it costs nothing


@dataclass(frozen=True)
class StepSetting:
    """The training step a benchmark times."""

    encoder: str
    image_size: int
    patch_size: int
    num_steps: int
    batch_size: int
    probe_batch: int = 16
    precision: str = "fp32"


STEP_SETTINGS = {"tiny": StepSetting("tiny", 64, 16, 4, 16, 4), "small": StepSetting("small", 64, 16, 4, 16, 4)}
SMOKE_SETTINGS = {"tiny": StepSetting("tiny", 16, 8, 2, 1, 2), "small": StepSetting("small", 16, 8, 2, 1, 2)}
LARGE = StepSetting("large", 224, 16, 4, 16, 16, "bf16")  # the GPU step of benchmarks/gpu_vitl.py

SMOKE_MATMUL_SIZE = 256
STEP_NAMES = ("mfu", "sigreg_fraction", "peak_memory_ratio")
BENCHMARKS = (
    *(f"{cfg}.{b}" for cfg in STEP_SETTINGS for b in STEP_NAMES),
    "large.params", "large.memory_estimate_gib",
    "wire.keystream", "wire.quant_mask", "wire.client", "wire.aggregate",
)


def bench_params(s: StepSetting) -> Params:
    """Params of a benchmark step: defaults everywhere except the setting's sizes."""
    return Params(
        data=DataParams(image_size=s.image_size, num_steps=s.num_steps, sites=(SiteParams(name="bench", embodiment=EMBODIMENT, episodes=2),)),
        model=ModelParams(encoder=s.encoder, patch_size=s.patch_size),
        objective=ObjectiveParams(probe_batch=s.probe_batch),
        train=TrainParams(batch_size=s.batch_size, precision=s.precision),
        evaluate=EvaluateParams(cem=CemParams(horizon=s.num_steps - 1, context=1)),  # a plan the Window's positions cover
    )


def select(names: list[str] | None) -> list[str]:
    """Benchmarks named or prefixed by `names` (all when None); ConfigError naming an unknown one."""
    if not names:
        return list(BENCHMARKS)
    chosen = []
    for name in names:
        hits = [b for b in BENCHMARKS if b == name or b.startswith(name + ".")]
        if not hits:
            raise ConfigError(f"bench: unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
        chosen += [b for b in hits if b not in chosen]
    return chosen


# ------------------------------------------------------------------------------------ step fixture


@dataclass
class StepFixture:
    """A model, its optimizer and synthetic data, set up as a federated inner step would be."""

    params: Params
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: WindowSampler
    probe_PCHW: torch.Tensor
    global_probe_PND: torch.Tensor

    def run(self, steps: int, on_step: Callable[[int, dict], None] | None = None) -> None:
        train_steps(
            self.model, self.optimizer, [(EMBODIMENT, self.sampler)], steps, train=self.params.train,
            objective=self.params.objective, run_seed=0, round_idx=0, data_key="bench",
            probe_PCHW=self.probe_PCHW, global_probe_PND=self.global_probe_PND, on_step=on_step,
        )


def step_fixture(params: Params) -> StepFixture:
    """The model of `workflow.build_model`, AdamW, random uint8 episodes, a probe batch."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(params, "bench")
    rng = np.random.default_rng(0)
    E, L, H, K = 2, params.data.num_steps + 4, params.data.image_size, compute.action_dim(model, EMBODIMENT)
    eps = Episodes(
        EMBODIMENT, rng.integers(0, 256, (E, L, H, H, 3), dtype=np.uint8),
        rng.uniform(-1, 1, (E, L, K)).astype(np.float32), np.zeros((E, L, 2), np.float32),
    )
    probe = torch.rand(params.objective.probe_batch, 3, H, H, generator=torch.Generator().manual_seed(1)) * 2 - 1
    global_probe = encode_frames(model, probe)
    return StepFixture(params, model, make_optimizer(model, params.train), WindowSampler(eps, params.data.num_steps, params.model.proprio_dim), probe, global_probe)


def step_seconds(fx: StepFixture, steps: int) -> float:
    """Best wall time of one training step among `steps` consecutive ones."""
    stamps = [time.perf_counter()]
    fx.run(steps, on_step=lambda _step, _losses: stamps.append(time.perf_counter()))
    return min(b - a for a, b in zip(stamps, stamps[1:]))


def peak_step_bytes(fx: StepFixture) -> int:
    """Peak tensor bytes over two training steps (see the module docstring), parameters included."""
    before = sum(p.numel() * p.element_size() for p in fx.model.parameters())
    return before + peak_tensor_bytes(lambda: fx.run(2))


def step_flops(fx: StepFixture) -> int:
    """Counted FLOPs of one step on the fixture's own model (a real forward + backward on the CPU)."""
    shape = compute.step_shape(fx.params)
    inputs = compute.step_inputs(fx.model, shape, EMBODIMENT, torch.Generator().manual_seed(3))
    inputs.probe_PCHW, inputs.global_probe_PND = fx.probe_PCHW, fx.global_probe_PND
    fx.model.train()
    flops = compute.count_step_flops(fx.model, fx.params, inputs, EMBODIMENT)["total"]
    fx.optimizer.zero_grad(set_to_none=True)
    return flops


def objective_seconds(fx: StepFixture, repeats: int) -> tuple[float, float]:
    """Best forward+backward seconds of the SIGReg term alone, and the anchor's marginal step time."""
    obj, shape = fx.params.objective, compute.step_shape(fx.params)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randn(shape.sigreg_tokens, shape.width, generator=gen).requires_grad_()
    directions = random_directions(shape.width, obj.sketch_dim, gen)

    def sig() -> None:
        (obj.sigreg_weight * sigreg(tokens, directions, obj.num_knots, obj.t_max)).backward()

    fx.model.train()
    sig_s = best_seconds(sig, repeats)
    fx.optimizer.zero_grad(set_to_none=True)
    # The anchor shares the encoder pass of the step (losses.world_model_loss), so its cost is
    # marginal: the best step with the probe frames minus the best step without them.
    with_anchor = step_seconds(fx, repeats)
    probe, global_probe = fx.probe_PCHW, fx.global_probe_PND
    fx.probe_PCHW = fx.global_probe_PND = None
    try:
        without_anchor = step_seconds(fx, repeats)
    finally:
        fx.probe_PCHW, fx.global_probe_PND = probe, global_probe
    return sig_s, max(with_anchor - without_anchor, 0.0)


# -------------------------------------------------------------------------------------- benchmarks


def bench_step(cfg: str, setting: StepSetting, wanted: set[str], repeats: int) -> dict[str, float]:
    """The <cfg>.* figures of one step setting (MFU's peak is applied by the caller)."""
    params = bench_params(setting)
    fx = step_fixture(params)
    out: dict[str, float] = {}
    n_params = compute.param_counts(fx.model)["total"]
    peak_bytes = peak_step_bytes(fx)  # also the warm-up: AdamW state exists from here on
    if f"{cfg}.peak_memory_ratio" in wanted:
        estimate = compute.memory_estimate(params, n_params, action_dim=compute.action_dim(fx.model, EMBODIMENT))["total"]
        out |= {f"{cfg}.peak_memory_bytes": peak_bytes, f"{cfg}.memory_estimate_bytes": estimate,
                f"{cfg}.peak_memory_ratio": peak_bytes / estimate}
    step_s = step_seconds(fx, repeats)
    out[f"{cfg}.step_s"] = step_s
    if f"{cfg}.mfu" in wanted:
        flops = step_flops(fx)
        achieved = flops / step_s / 1e9
        out |= {f"{cfg}.flops_per_step": flops, f"{cfg}.achieved_gflops": achieved}
    if f"{cfg}.sigreg_fraction" in wanted:
        sig_s, anc_s = objective_seconds(fx, repeats)
        out |= {f"{cfg}.sigreg_s": sig_s, f"{cfg}.anchor_s": anc_s, f"{cfg}.sigreg_only_fraction": sig_s / step_s,
                f"{cfg}.anchor_fraction": anc_s / step_s, f"{cfg}.sigreg_fraction": (sig_s + anc_s) / step_s}
    return out


def bench_large(count_flops: bool) -> dict[str, float]:
    """ViT-L parameter counts and the memory estimate of its GPU step (bf16 autocast, fp32 master)."""
    params = bench_params(LARGE)
    model = compute.meta_model(params)
    counts = compute.param_counts(model)
    memory = compute.memory_estimate(params, counts["total"], action_dim=compute.action_dim(model, EMBODIMENT))
    out = {
        "large.params": counts["total"], "large.encoder_params": counts["encoder"],
        "large.federated_params": counts["federated"], "large.local_params": counts["local"],
        "large.memory_estimate_gib": memory["total"] / compute.GIB, "large.activation_gib": memory["activations"] / compute.GIB,
    }
    if count_flops:  # a few seconds of Python dispatch on the meta device; not worth it in CI
        out["large.flops_per_step"] = compute.step_flops(params)["total"]
    return out


def wire_benchmarks(wanted: set[str], smoke: bool) -> dict[str, float]:
    """The wire-path benchmarks of `benchmarks.wire`, at CI sizes when `smoke`."""
    out: dict[str, float] = {}
    if "wire.keystream" in wanted:
        r = wire.bench_keystream(num_bytes=1 << 20, repeats=1) if smoke else wire.bench_keystream()
        out |= {"wire.keystream_gbps": r["keystream_gbps"], "wire.mask_gbps": r["mask_gbps"]}
    if "wire.quant_mask" in wanted:
        r = wire.bench_quant_mask(numel=100_000, num_sites=3, repeats=1) if smoke else wire.bench_quant_mask()
        out |= {f"wire.quant_mask_{k}": v for k, v in r.items()}
    if "wire.client" in wanted:
        r = wire.bench_client(numel=100_000, num_sites=3, copy_bytes=8 << 20, repeats=1) if smoke else wire.bench_client()
        out |= {f"wire.client_{k}": v for k, v in r.items()}
    if "wire.aggregate" in wanted:
        r = wire.bench_aggregate(num_sites=3, numel=100_000, copy_bytes=8 << 20) if smoke else wire.bench_aggregate()
        out |= {f"wire.aggregate_{k}": v for k, v in r.items()}
    return out


def report_lines(r: dict[str, float]) -> list[str]:
    """One line per headline figure: name, value, then the limit or parts it is measured against."""
    peak, copy = r["peak.matmul_gflops"], r["peak.copy_gbps"]
    lines = [
        f"peak.matmul_gflops {peak:.1f}  fp32 torch.mm {r['peak.matmul_size']:.0f}^2, best of "
        f"{r['peak.matmul_gflops_before']:.1f} before and {r['peak.matmul_gflops_after']:.1f} after the steps",
        f"peak.copy_gbps {copy:.2f}  tensor copy, 1 thread",
    ]
    for cfg in STEP_SETTINGS:
        v = {k.removeprefix(cfg + "."): x for k, x in r.items() if k.startswith(cfg + ".")}
        step_ms = v.get("step_s", 0.0) * 1e3
        if "mfu" in v:
            lines.append(f"{cfg}.mfu {v['mfu']:.3f}  {v['achieved_gflops']:.1f} of {peak:.1f} GFLOP/s "
                         f"({v['flops_per_step'] / 1e9:.1f} GFLOP counted per step, best step {step_ms:.0f} ms)")
        if "sigreg_fraction" in v:
            lines.append(f"{cfg}.sigreg_fraction {v['sigreg_fraction']:.3f}  SIGReg {v['sigreg_s'] * 1e3:.1f} ms "
                         f"({v['sigreg_only_fraction']:.3f}) + anchor {v['anchor_s'] * 1e3:.1f} ms of a {step_ms:.0f} ms step")
        if "peak_memory_ratio" in v:
            lines.append(f"{cfg}.peak_memory_ratio {v['peak_memory_ratio']:.3f}  measured {v['peak_memory_bytes'] / 2**20:.1f} MiB, "
                         f"estimate {v['memory_estimate_bytes'] / 2**20:.1f} MiB")
    if "large.params" in r:
        lines.append(f"large.params {r['large.params']:,.0f}  encoder {r['large.encoder_params']:,.0f} (ViT-L/16 at 224)")
        lines.append(f"large.memory_estimate_gib {r['large.memory_estimate_gib']:.2f}  step of {LARGE.batch_size}x"
                     f"{LARGE.num_steps} frames + {LARGE.probe_batch} probe, bf16 autocast; activations {r['large.activation_gib']:.2f} GiB")
    if "wire.keystream_gbps" in r:
        lines.append(f"wire.keystream_gbps {r['wire.keystream_gbps']:.2f}  {r['wire.keystream_gbps'] / copy:.3f} of copy bandwidth")
    if "wire.quant_mask_total_s" in r:
        lines.append(f"wire.quant_mask_total_s {r['wire.quant_mask_total_s']:.3f}  {r['wire.quant_mask_numel']:,.0f} params, "
                     f"{r['wire.quant_mask_num_sites']:.0f} sites (quantize + mask alone; a site's cost is wire.client)")
    if "wire.client_ratio" in r:
        lines.append(f"wire.client_ratio {r['wire.client_ratio']:.2f}  {r['wire.client_total_s']:.3f} s vs memory floor "
                     f"{r['wire.client_floor_s']:.3f} s (one site's announce {r['wire.client_announce_s']:.3f} + encode "
                     f"{r['wire.client_encode_s']:.3f} s, {r['wire.client_numel']:,.0f} params, "
                     f"{r['wire.client_num_sites'] - 1:.0f} neighbours, {'native' if r['wire.client_native'] else 'eager'}; "
                     f"eager {r['wire.client_eager_s']:.3f} s, {r['wire.client_ratio_eager']:.2f}; of it ChaCha20 + SHA-256 "
                     f"{r['wire.client_crypto_s']:.3f} s, the rest {r['wire.client_ratio_beyond_crypto']:.2f} x the floor)")
    if "wire.aggregate_ratio" in r:
        lines.append(f"wire.aggregate_ratio {r['wire.aggregate_ratio']:.2f}  {r['wire.aggregate_total_s']:.3f} s vs memory floor "
                     f"{r['wire.aggregate_floor_s']:.3f} s (sum + outer step + self-check, {'native' if r['wire.aggregate_native'] else 'eager'}; "
                     f"eager {r['wire.aggregate_ratio_eager']:.2f}, once without self-check "
                     f"{r['wire.aggregate_ratio_one_evaluation']:.2f}; fresh buffers "
                     f"{r['wire.aggregate_ratio_fresh_alloc']:.2f}; signature checks {r['wire.aggregate_signature_verify_s']:.3f} s "
                     f"at arrival, {r['wire.aggregate_verify_gbps']:.2f} GB/s)")
        lines.append(f"wire.aggregate_path_ratio {r['wire.aggregate_path_ratio']:.2f}  {r['wire.aggregate_path_s']:.3f} s vs "
                     f"the same floor (agree + verify + sum + outer step; eager {r['wire.aggregate_path_eager_s']:.3f} s, "
                     f"{r['wire.aggregate_path_ratio_eager']:.2f})")
    return lines


def run_bench(
    names: list[str] | None, smoke: bool, out: Path | None = Path("reports/bench.json"), echo: bool = True,
    threads: int | None = None,
) -> dict[str, float]:
    """Run the selected benchmarks; print them, write `out` (unless None) and return the flat results.

    `threads` sets torch's intra-op threads for the run (restored after; default: as they are).
    `smoke` runs every code path at toy sizes on one thread, in seconds: a CI check that the suite
    works, not a measurement (two threads on a busy runner make small ops ten times slower).
    """
    wanted = set(select(names))
    with torch_threads(1 if smoke else threads):
        results = _run(wanted, smoke)
        used_threads = torch.get_num_threads()
    if echo:
        print("\n".join(report_lines(results)))
    if out is not None:
        settings = SMOKE_SETTINGS if smoke else STEP_SETTINGS
        doc = {
            "hardware": hardware_string(), "hardware_class": hardware_class(), "torch": torch.__version__,
            "threads": used_threads, "smoke": smoke, "benchmarks": sorted(wanted),
            "settings": {cfg: asdict(s) for cfg, s in {**settings, "large": LARGE}.items()}, "results": results,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return results


def _run(wanted: set[str], smoke: bool) -> dict[str, float]:
    """The limits, then the wanted benchmarks, as floats."""
    settings = SMOKE_SETTINGS if smoke else STEP_SETTINGS
    repeats = 1 if smoke else 4
    size, peak_repeats = (SMOKE_MATMUL_SIZE, 2) if smoke else (MATMUL_SIZE, 5)
    results: dict[str, float] = {
        "peak.matmul_size": size,
        "peak.matmul_gflops_before": matmul_peak_gflops(size, peak_repeats),
        "peak.copy_gbps": copy_bandwidth(8 << 20 if smoke else 256 << 20) / 1e9,
    }
    for cfg, setting in settings.items():
        if any(w.startswith(cfg + ".") for w in wanted):
            results |= bench_step(cfg, setting, wanted, repeats)
    # the peak again, after the steps: on a shared machine the best of both is the closer to the limit
    results["peak.matmul_gflops_after"] = matmul_peak_gflops(size, peak_repeats)
    peak = results["peak.matmul_gflops"] = max(results["peak.matmul_gflops_before"], results["peak.matmul_gflops_after"])
    for cfg in settings:
        if f"{cfg}.mfu" in wanted:
            results[f"{cfg}.mfu"] = results[f"{cfg}.achieved_gflops"] / peak
    if wanted & {"large.params", "large.memory_estimate_gib"}:
        results |= bench_large(count_flops=not smoke)
    results |= wire_benchmarks(wanted, smoke)
    return {k: float(v) for k, v in results.items()}


def bench_main(args: list[str]) -> int:
    """`lensemble bench [NAME ...] [--smoke] [--threads N] [--out PATH]`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="lensemble bench", description="Run the benchmark suite; write reports/bench.json.")
    parser.add_argument("names", nargs="*", help=f"benchmarks or prefixes (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds (CI)")
    parser.add_argument("--out", default="reports/bench.json", help="where to write the JSON (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's current setting)")
    ns = parser.parse_args(args)
    if ns.threads is not None and ns.threads < 1:
        parser.error(f"--threads must be >= 1, got {ns.threads}")
    try:
        run_bench(ns.names or None, ns.smoke, Path(ns.out), threads=ns.threads)
    except LensembleError as exc:
        print(f"lensemble: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
