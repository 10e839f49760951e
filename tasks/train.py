"""Prefect tasks that train: Stage A on pooled data, and one site's inner loop in Stage B."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import Params
from lensemble.data.residency import ResidencyGuard
from lensemble.federation.transport import RoundContext, Transport, param_spec
from lensemble.gauge import drift, pool_tokens
from lensemble.model.world_model import federated_state, load_federated
from lensemble.paths import Layout
from lensemble.training import encode_frames, make_optimizer, train_steps
from lensemble.workflow import build_model, load_site, sampler_for, site_embodiment, site_names


@task(name="train-centralized", cache_policy=NONE)
def train_centralized(params: Params, layout: Layout, model_path: Path) -> dict:
    """Stage A: one model on the pooled episodes of every site (the upper bound)."""
    torch.set_num_threads(params.run.torch_threads)
    model = build_model(params, "centralized")
    samplers = [(site_embodiment(params, s), sampler_for(load_site(layout, params, s), params)) for s in site_names(params)]
    opt = make_optimizer(model, params.train)
    t0 = time.perf_counter()
    log = train_steps(model, opt, samplers, params.centralized.steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=-1, data_key="pooled")
    seconds = time.perf_counter() - t0
    torch.save(model.state_dict(), model_path)
    return {"losses": {"pred": log.pred, "sigreg": log.sigreg}, "mean": log.mean(), "seconds": seconds, "steps": params.centralized.steps}


@task(name="site-train", cache_policy=NONE)
def site_train(params: Params, layout: Layout, site: str, round_idx: int, global_state: dict, probe: torch.Tensor,
               global_probe: torch.Tensor, state_path: Path, delta_path: Path) -> dict:
    """H inner steps at one site from the round's global parameters.

    Site-local state (action head, full model, AdamW moments) is read from and written to
    `state_path`; Δ_c is kept at the site in `delta_path` until the round is committed. What leaves:
    scalar metrics and the pooled embedding of the public probe - both through the residency guard.
    """
    torch.set_num_threads(params.run.torch_threads)
    embodiment = site_embodiment(params, site)
    model = build_model(params, f"site/{site}")
    opt = make_optimizer(model, params.train)
    if state_path.is_file():
        saved = torch.load(state_path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    load_federated(model, global_state)
    sampler = sampler_for(load_site(layout, params, site), params)
    t0 = time.perf_counter()
    log = train_steps(model, opt, [(embodiment, sampler)], params.federate.inner_steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=round_idx, data_key=site, probe_PCHW=probe, global_probe_PND=global_probe)
    train_seconds = time.perf_counter() - t0
    local = federated_state(model)
    delta = {n: local[n] - global_state[n] for n in sorted(global_state)}
    guard = ResidencyGuard(site, param_spec(global_state), layout.site_audit(site), probe_rows=probe.shape[0])
    guard.release("update", delta)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, state_path)
    torch.save(delta, delta_path)
    site_probe = pool_tokens(encode_frames(model, probe))
    gauge = drift(site_probe, pool_tokens(global_probe))
    metrics = {**log.mean(), "train_seconds": train_seconds, "steps": params.federate.inner_steps,
               **{f"gauge/{k}": v for k, v in gauge.items()}}
    guard.release("metrics", metrics)
    return {"metrics": metrics, "probe_embedding": guard.release("public_probe_embedding", site_probe)}


@task(name="site-announce", cache_policy=NONE)
def site_announce(layout: Layout, site: str, delta_path: Path, transport: Transport, ctx: RoundContext) -> bytes:
    """The site's pre-encoding message (e.g. its per-block scales), through the guard."""
    delta = torch.load(delta_path, weights_only=True)
    guard = ResidencyGuard(site, ctx.spec, layout.site_audit(site))
    return guard.release("payload", transport.announce(ctx, site, delta))


@task(name="site-encode", cache_policy=NONE)
def site_encode(layout: Layout, site: str, delta_path: Path, transport: Transport, ctx: RoundContext, spec: tuple) -> tuple[bytes, float]:
    """The site serialises (quantizes, masks, signs) its Δ_c; the payload leaves through the guard."""
    delta = torch.load(delta_path, weights_only=True)
    guard = ResidencyGuard(site, spec, layout.site_audit(site))
    t0 = time.perf_counter()
    payload = transport.encode(ctx, site, delta)
    encode_seconds = time.perf_counter() - t0
    return guard.release("payload", payload), encode_seconds
