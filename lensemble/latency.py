"""Per-component figures of the budget chapter (spec/08 §2-§3), measured on every Stage A run.

- `perf/encoder_forward_ms`: f_θ on one clip (`data.num_steps` frames, batch 1), eval mode, no grad.
- `perf/predictor_step_ms`: one autoregressive latent step of g_φ from one latent frame.
- `perf/predictor_step_fraction`: the two above divided; the chapter wants the predictor step
  "small relative to the encoder forward" (band below 1).
- `perf/sigreg_seconds`: SIGReg forward + backward on one step's `sigreg_tokens` embeddings, at the
  run's sketch size and knots; `perf/objective_fraction` is it divided by the mean training step.
  (The anchor shares the step's encoder pass; its marginal cost is measured by `lensemble bench`.)
- `perf/peak_memory_gib`: the process's peak resident memory (CPU) or peak allocated device memory.

Each timing is the best of `repeats` calls: the least disturbed by other processes on a shared machine.
"""
from __future__ import annotations

import resource
import sys

import torch

from lensemble.compute import step_shape
from lensemble.config import Params
from lensemble.federation.bench_wire import best_seconds
from lensemble.model.world_model import WorldModel
from lensemble.objectives.sigreg import random_directions, sigreg


def peak_memory_gib(device: torch.device | None = None) -> float:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes), or CUDA peak allocated."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def component_latency(model: WorldModel, params: Params, step_seconds: float, repeats: int = 5) -> dict[str, float]:
    """The measured figures of the module docstring for a trained `model`; `step_seconds` = mean training step."""
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
