"""Measurement primitives: the timer, thread control, the hardware limits, peak memory, component latency.

Everything that measures lives here; the suites that run these measurements and report them are in
`benchmarks/` (`lensemble bench`, `lensemble profile`, `python -m benchmarks.data`, `benchmarks.wire`).
FLOPs are counted and memory estimated in `lensemble.compute`.

- `best_seconds`: the best wall time of `repeats` calls, the least disturbed by other processes on
  a shared machine; every timing below is one.
- `torch_threads`: torch's intra-op thread count set for a block.
- `copy_bandwidth`, `matmul_peak_gflops`: memory copy bandwidth and the fp32 matmul peak, the
  physical limits a benchmark is set beside.
- `peak_memory_gib`: the process's peak resident memory (CPU) or peak allocated device memory;
  `peak_tensor_bytes`: the peak of live tensor bytes while a callable runs.
- `component_latency`: the per-component figures of the budget chapter (spec/08 §2-§3), measured on
  every Stage A run:
  - `perf/encoder_forward_ms`: f_θ on one clip (`data.num_steps` frames, batch 1), eval mode, no grad.
  - `perf/predictor_step_ms`: one autoregressive latent step of g_φ from one latent frame.
  - `perf/predictor_step_fraction`: the two above divided; the chapter wants the predictor step
    "small relative to the encoder forward" (band below 1).
  - `perf/sigreg_seconds`: SIGReg forward + backward on one step's `sigreg_tokens` embeddings, at the
    run's sketch size and knots; `perf/objective_fraction` is it divided by the mean training step.
    (The anchor shares the step's encoder pass; its marginal cost is measured by `lensemble bench`.)
  - `perf/peak_memory_gib`: `peak_memory_gib()`.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from lensemble.compute import step_shape
from lensemble.config import Params
from lensemble.model.world_model import WorldModel
from lensemble.objectives.sigreg import random_directions, sigreg

MATMUL_SIZE = 2048


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls (the least disturbed by other processes on a shared machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the block (unchanged when None)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Memory bandwidth in bytes/s of one large tensor copy (bytes read + bytes written), on one thread."""
    with torch_threads(1):
        src = torch.ones(num_bytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        return 2 * num_bytes / best_seconds(lambda: dst.copy_(src), repeats)


def matmul_peak_gflops(n: int = MATMUL_SIZE, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of an n x n by n x n `torch.mm` at the current thread count."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm up the BLAS
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=out), repeats) / 1e9


def peak_memory_gib(device: torch.device | None = None) -> float:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes), or CUDA peak allocated."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def peak_tensor_bytes(fn: Callable[[], object]) -> int:
    """Peak of the running sum of every allocation and free the CPU allocator reports while `fn` runs.

    Measured with `torch.profiler` (profile_memory=True); tensors alive before the call are not
    counted. It counts tensor bytes, as `torch.cuda.max_memory_allocated` does on a GPU, not the
    allocator's slack or library scratch space (RSS would include both, and the interpreter, and
    would not fall when memory is freed).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def component_latency(model: WorldModel, params: Params, step_seconds: float, repeats: int = 5) -> dict[str, float]:
    """The per-component figures of the module docstring for a trained `model`; `step_seconds` = mean training step."""
    gen = torch.Generator().manual_seed(0)
    H, T = params.data.image_size, params.data.num_steps
    clip_BTCHW = torch.rand(1, T, 3, H, H, generator=gen) * 2 - 1
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            encoder_s = best_seconds(lambda: model.encoder(clip_BTCHW), repeats)
            z_BTND = model.encoder(clip_BTCHW[:, :1])
            act_BTA = torch.zeros(1, 1, params.model.action_dim)
            q_BTQ = torch.zeros(1, 1, params.model.proprio_dim)
            predictor_s = best_seconds(lambda: model.predictor(z_BTND, q_BTQ, act_BTA), repeats)
    finally:
        model.train(was_training)
    shape, obj = step_shape(params), params.objective
    tokens_ND = torch.randn(shape.sigreg_tokens, shape.width, generator=gen).requires_grad_()
    directions = random_directions(shape.width, obj.sketch_dim, gen)
    sigreg_s = best_seconds(lambda: sigreg(tokens_ND, directions, obj.num_knots, obj.t_max).backward(), repeats)
    return {
        "perf/encoder_forward_ms": encoder_s * 1e3,
        "perf/predictor_step_ms": predictor_s * 1e3,
        "perf/predictor_step_fraction": predictor_s / encoder_s,
        "perf/sigreg_seconds": sigreg_s,
        "perf/objective_fraction": sigreg_s / step_seconds,
        "perf/peak_memory_gib": peak_memory_gib(),
    }
