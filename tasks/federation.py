"""Prefect tasks on the aggregator's side of a DiLoCo round."""
from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NONE

from lensemble.federation.outer import aggregate_and_step
from lensemble.federation.transport import RoundContext, Transport
from lensemble.gauge import drift, effective_dim, sample_pairs
from lensemble.seeds import derive_seed


@task(name="aggregate", cache_policy=NONE, retries=1)
def aggregate_round(ctx: RoundContext, transport: Transport, payloads: Mapping[str, bytes], params: dict, momentum: dict | None,
                    lr: float, beta: float) -> tuple[dict, dict, float]:
    """Verify, average and take the outer Nesterov step (self-checked); returns (params, momentum, seconds).

    `retries=1`: a NonDeterministicAggregation aborts the attempt and the task recomputes once.
    """
    t0 = time.perf_counter()
    new_params, new_buf = aggregate_and_step(ctx, transport, payloads, params, momentum, lr, beta)
    return new_params, new_buf, time.perf_counter() - t0


@task(name="gauge-round", cache_policy=NONE)
def gauge_round(run_seed: int, round_idx: int, site_probes: Mapping[str, torch.Tensor], global_probe: torch.Tensor, num_pairs: int) -> dict:
    """Drift of sampled site pairs and the effective dimension of the new global model's probe embeddings."""
    t0 = time.perf_counter()
    sites = sorted(site_probes)
    rng = np.random.default_rng(derive_seed(run_seed, "gauge/pairs", round_idx))
    pairs = {f"{a}|{b}": drift(site_probes[a], site_probes[b]) for a, b in sample_pairs(sites, num_pairs, rng)}
    return {"pairs": pairs, "effective_dim": effective_dim(global_probe), "seconds": time.perf_counter() - t0}
