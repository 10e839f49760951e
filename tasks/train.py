"""Prefect tasks that train: Stage A on pooled data, and one site's inner loop in Stage B."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import Params
from lensemble.gauge import (
    effective_dim,
    embodiment_spread,
    pool_tokens,
    pooled_checkpoints,
)
from lensemble.observability.progress import Progress
from lensemble.paths import Layout
from lensemble.perf import component_latency
from lensemble.training import encode_frames, make_optimizer, train_steps
from lensemble.workflow import (
    build_model,
    load_site,
    place,
    probe_frames_labelled,
    sampler_for,
    site_embodiment,
    site_names,
    warm_start,
)
from orchestration.site_work import (
    adapt_head_body,
    local_only_body,
    loss_progress,
    site_train_body,
)
from orchestration.workers import background_pool, site_pool


@task(name="train-centralized", task_run_name="train-centralized", cache_policy=NONE)
def train_centralized(params: Params, layout: Layout, model_path: Path,
                      on_losses: Callable[[int, Mapping[str, float]], None] | None = None) -> dict:
    """Stage A: one model on the pooled episodes of every site (the upper bound); `on_losses(step, losses)` after each step."""
    torch.set_num_threads(params.run.torch_threads)
    model = build_model(params, "centralized")
    warm_start(model, params, layout)
    place(model, params)
    samplers = [(site_embodiment(params, s), sampler_for(load_site(layout, params, s), params)) for s in site_names(params)]
    opt = make_optimizer(model, params.train)
    probe, labels, probe_episodes = probe_frames_labelled(layout, params)
    marks = pooled_checkpoints(params)
    curve: list[dict] = []
    curve_seconds = 0.0
    progress = Progress("centralized", params.centralized.steps)

    def record(step: int, losses) -> None:  # the pooled model's effective dimension at the federation's round marks
        nonlocal curve_seconds
        loss_progress(progress, step, losses)
        if on_losses is not None:
            on_losses(step, losses)
        if step + 1 in marks:
            t = time.perf_counter()
            z = pool_tokens(encode_frames(model, probe))
            curve.append({"step": step + 1, **effective_dim(z), **embodiment_spread(z, labels, probe_episodes)})
            model.train()
            curve_seconds += time.perf_counter() - t

    t0 = time.perf_counter()
    log = train_steps(model, opt, samplers, params.centralized.steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=-1, data_key="pooled", on_step=record,
                      schedule=(0, params.centralized.steps))
    seconds = time.perf_counter() - t0 - curve_seconds
    torch.save(model.state_dict(), model_path)
    latency = component_latency(model, params, seconds / params.centralized.steps)
    return {"losses": {"pred": log.pred, "proprio": log.proprio, "sigreg": log.sigreg}, "mean": log.mean(), "seconds": seconds,
            "steps": params.centralized.steps, "latency": latency, "effective_dim_curve": curve}


@task(name="train-local-only", task_run_name="{site}-local-only-train", cache_policy=NONE)
def train_local_only(params: Params, layout: Layout, site: str, model_path: Path, background: bool = False) -> dict:
    """The no-federation baseline: the site trains alone for as many steps as it trains in Stage B (in a worker;
    `background`: in a background worker, on the cores the rounds leave free). Same bits either way."""
    pool = background_pool(params, warm=("orchestration.site_work",)) if background else None
    return (pool or site_pool(params)).call(local_only_body, params, layout, site, model_path)


@task(name="site-train", task_run_name="{site}-round-{round_idx:02d}-train", cache_policy=NONE)
def site_train(params: Params, layout: Layout, site: str, round_idx: int, global_state: dict, probe: torch.Tensor,
               global_probe: torch.Tensor, state_path: Path, delta_path: Path) -> dict:
    """H inner steps at one site from the round's global parameters (`site_train_body`, in a worker)."""
    return site_pool(params).call(site_train_body, params, layout, site, round_idx, global_state, probe, global_probe, state_path,
                                  delta_path)


@task(name="site-adapt-head", task_run_name="{site}-adapt-head", cache_policy=NONE)
def site_adapt_head(params: Params, layout: Layout, site: str, global_state: dict, state_path: Path) -> dict:
    """After the last round: the site re-fits its local action head (`adapt_head_body`, in a worker)."""
    return site_pool(params).call(adapt_head_body, params, layout, site, global_state, state_path)


