"""The CPU-bound work of a site's Prefect tasks (tasks/train.py), importable without Prefect: a worker
process (orchestration/workers.py) runs these by name, and a worker never imports Prefect (whose logging
setup would take over the worker's records) or pays for its import.
"""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from lensemble.config import Params
from lensemble.data.audit import load_index
from lensemble.data.residency import ResidencyGuard
from lensemble.dynamics import round_dynamics
from lensemble.federation.dp import clip_update, update_clip
from lensemble.federation.transport import param_spec
from lensemble.gauge import drift, effective_dim, pool_tokens
from lensemble.model.world_model import federated_state, load_federated, local_state
from lensemble.observability.progress import Progress
from lensemble.paths import Layout
from lensemble.training import encode_frames, make_optimizer, train_steps
from lensemble.workflow import (
    build_model,
    load_probe_episodes,
    load_site,
    place,
    probe_frames_labelled,
    sampler_for,
    site_embodiment,
    warm_start,
)
from orchestration.workers import background_turn


def loss_progress(progress: Progress, step: int, losses) -> None:
    """`train_steps`' on_step hook: count the step, show its prediction loss when a line is printed."""
    progress.update(step + 1, {"loss/pred": losses["loss/pred"]})


def loss_progress_yielding(progress: Progress, step: int, losses) -> None:
    """`loss_progress`, then (in a background worker) wait for a core the site work leaves free before the next step."""
    loss_progress(progress, step, losses)
    background_turn()


def local_only_body(params: Params, layout: Layout, site: str, model_path: Path) -> dict:
    """`train_local_only`'s work, and the baseline's effective dimension (RankMe) on its robot's probe rows at the
    federation's round marks (`effective_dim_curve`: after (r + 1)·H of its steps for round r, the point of training
    the federated model's round r is at), which the gauge reads each round's federated robot against."""
    model = build_model(params, f"local/{site}")
    warm_start(model, params, layout)
    place(model, params)
    opt = make_optimizer(model, params.train)
    embodiment = site_embodiment(params, site)
    sampler = sampler_for(load_site(layout, params, site), params)
    steps = params.federate.rounds * params.federate.inner_steps
    progress = Progress(f"{site} local-only", steps)
    probe, labels, _ = probe_frames_labelled(layout, params)
    probe = probe[torch.tensor([label == embodiment for label in labels])]
    marks = {params.federate.inner_steps * (r + 1): r for r in range(params.federate.rounds)}
    curve: list[dict] = []

    def on_step(step: int, losses) -> None:
        if step + 1 in marks:  # read before this worker gives its core back (no draw, no gradient: training is unchanged)
            curve.append({"round": marks[step + 1], "rankme": effective_dim(pool_tokens(encode_frames(model, probe)))["rankme"]})
            model.train()
        loss_progress_yielding(progress, step, losses)

    log = train_steps(model, opt, [(embodiment, sampler)], steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=-2, data_key=site, on_step=on_step, schedule=(0, steps))
    torch.save(model.state_dict(), model_path)
    return {"steps": steps, **log.mean(), "embodiment": embodiment, "effective_dim_curve": curve}


def site_train_body(params: Params, layout: Layout, site: str, round_idx: int, global_state: dict, probe: torch.Tensor,
                    global_probe: torch.Tensor, state_path: Path, delta_path: Path) -> dict:
    """H inner steps at one site from the round's global parameters.

    Site-local state (action head, full model, AdamW moments) is read from and written to
    `state_path`; Δ_c is kept at the site in `delta_path` until the round is committed. What leaves:
    scalar metrics and the pooled embedding of the public probe - both through the residency guard.
    """
    t_task = time.perf_counter()
    embodiment = site_embodiment(params, site)
    model = place(build_model(params, f"site/{site}"), params)
    opt = make_optimizer(model, params.train)
    if state_path.is_file():
        saved = torch.load(state_path, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    load_federated(model, global_state)
    eps = load_site(layout, params, site)
    # the global model entering this round (= the last round's result) with this site's head, read on the public probe
    t0 = time.perf_counter()
    dyn = round_dynamics(params, model, eps, load_probe_episodes(layout, params, embodiment))
    dyn_seconds = time.perf_counter() - t0
    sampler = sampler_for(eps, params)
    # one line a round (45 in a default run), more only when a round is slow
    progress = Progress(f"{site} round {round_idx:02d}", params.federate.inner_steps, every_fraction=None)
    t0 = time.perf_counter()
    log = train_steps(model, opt, [(embodiment, sampler)], params.federate.inner_steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=round_idx, data_key=site, probe_PCHW=probe,
                      global_probe_PND=global_probe, on_step=partial(loss_progress, progress),
                      schedule=(round_idx * params.federate.inner_steps, params.federate.rounds * params.federate.inner_steps))
    train_seconds = time.perf_counter() - t0
    local = federated_state(model)
    delta = {n: local[n] - global_state[n] for n in sorted(global_state)}
    delta, clip_metrics = clip_update(delta, update_clip(params))  # DP / bounded influence; untouched when neither is set
    private = load_index(layout.site_episodes(site), eps).with_tensors(local_state(model))
    guard = ResidencyGuard(site, param_spec(global_state), layout.site_audit(site), probe_rows=probe.shape[0], private=private,
                           probe_dim=model.latent_dim)
    guard.release("update", delta)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, state_path)
    torch.save(delta, delta_path)
    site_probe = pool_tokens(encode_frames(model, probe))
    gauge = drift(site_probe, pool_tokens(global_probe))
    metrics = {**log.mean(), "train_seconds": train_seconds, "steps": params.federate.inner_steps,
               **{f"gauge/{k}": v for k, v in gauge.items()}, **dyn, "dynamics_seconds": dyn_seconds, **clip_metrics}
    metrics = guard.release("metrics", metrics)  # fp32-rounded: at most 32 bits per value leave
    site_probe = guard.release("public_probe_embedding", site_probe)
    task_seconds = guard.release("metrics", {"task_seconds": time.perf_counter() - t_task})["task_seconds"]
    return {"metrics": metrics, "probe_embedding": site_probe, "task_seconds": task_seconds}


def adapt_head_body(params: Params, layout: Layout, site: str, global_state: dict, state_path: Path) -> dict:
    """After the last round: the site fits its LOCAL action head to the final global encoder and predictor.

    The head was last trained against the site's own pre-averaging parameters; a few head-only steps
    re-align it with the model the site will plan with. Nothing leaves the site.
    """
    embodiment = site_embodiment(params, site)
    model = place(build_model(params, f"site/{site}"), params)
    saved = torch.load(state_path, map_location="cpu", weights_only=True)
    model.load_state_dict(saved["model"])
    load_federated(model, global_state)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(f"action_heads.{embodiment}."))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=params.train.lr, weight_decay=params.train.weight_decay, foreach=True)
    sampler = sampler_for(load_site(layout, params, site), params)
    progress = Progress(f"{site} head re-fit", params.federate.head_adapt_steps, every_fraction=None)
    log = train_steps(model, opt, [(embodiment, sampler)], params.federate.head_adapt_steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=params.federate.rounds, data_key=site,
                      on_step=partial(loss_progress, progress))
    for p in model.parameters():
        p.requires_grad_(True)
    torch.save({"model": model.state_dict(), "optimizer": saved["optimizer"]}, state_path)
    return {"steps": params.federate.head_adapt_steps, **log.mean()}
