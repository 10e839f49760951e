"""Prefect tasks of the gauge and evaluate stages."""
from __future__ import annotations

import torch
from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import Params
from lensemble.gauge import dimension_against_alone, drift, effective_dim, pool_tokens
from lensemble.paths import Layout
from lensemble.training import encode_frames
from lensemble.workflow import probe_frames_labelled, site_embodiment, site_names
from orchestration.evaluation import (
    REFERENCES,
    evaluate_models,
    evaluated_models,
    load_centralized,
    load_federated_for_site,
    load_local_only,
)
from orchestration.workers import site_pool


@task(name="gauge-final", task_run_name="gauge-final", cache_policy=NONE)
def gauge_final(params: Params, layout: Layout) -> dict:
    """Final-model diagnostics on the probe: Stage A vs Stage B frame drift and effective dimensions, and (when federate
    trained the local-only baselines) each robot's effective dimension against its site's encoder trained alone."""
    probe, labels, _ = probe_frames_labelled(layout, params)
    central = pool_tokens(encode_frames(load_centralized(params, layout), probe))
    sites = site_names(params)
    fed = pool_tokens(encode_frames(load_federated_for_site(params, layout, sites[0]), probe))
    out = {
        "federated_vs_centralized": drift(fed, central),
        "effective_dim": {"centralized": effective_dim(central), "federated": effective_dim(fed)},
        "latent_dim": int(central.shape[1]),
        "probe_frames": int(probe.shape[0]),
    }
    if params.federate.local_only:
        alone = {}
        for site in sites:
            emb = site_embodiment(params, site)
            rows = torch.tensor([label == emb for label in labels])
            alone[site] = (emb, pool_tokens(encode_frames(load_local_only(params, layout, site), probe[rows])))
        out["dimension_against_alone"] = dimension_against_alone(central, fed, labels, alone)
    return out


@task(name="evaluate-site", task_run_name="evaluate-{site}", cache_policy=NONE)
def evaluate_site(params: Params, layout: Layout, site: str) -> dict:
    """Closed-loop success of Stage A, Stage B, the local-only baseline (if trained), the oracle and random actions on one site's embodiment."""
    return site_pool(params, warm=("orchestration.evaluation",)).call(evaluate_models, params, layout, site, evaluated_models(params) + REFERENCES)
