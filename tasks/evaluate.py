"""Prefect tasks of the gauge and evaluate stages."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import Params
from lensemble.gauge import drift, effective_dim, embodiment_spread, pool_tokens
from lensemble.paths import Layout
from lensemble.training import encode_frames
from lensemble.workflow import probe_frames_labelled, site_names
from orchestration.evaluation import (
    REFERENCES,
    evaluate_models,
    evaluated_models,
    load_centralized,
    load_federated_for_site,
)
from orchestration.workers import site_pool


@task(name="gauge-final", task_run_name="gauge-final", cache_policy=NONE)
def gauge_final(params: Params, layout: Layout) -> dict:
    """Final-model diagnostics on the probe: Stage A vs Stage B frame drift and effective dimensions, over the whole probe
    and per embodiment."""
    probe, labels, _ = probe_frames_labelled(layout, params)
    central = pool_tokens(encode_frames(load_centralized(params, layout), probe))
    sites = site_names(params)
    fed = pool_tokens(encode_frames(load_federated_for_site(params, layout, sites[0]), probe))
    return {
        "federated_vs_centralized": drift(fed, central),
        "effective_dim": {"centralized": effective_dim(central), "federated": effective_dim(fed)},
        "latent_dim": int(central.shape[1]),
        "probe_frames": int(probe.shape[0]),
        "effective_dim_by_embodiment": {"centralized": embodiment_spread(central, labels)["by_embodiment"],
                                        "federated": embodiment_spread(fed, labels)["by_embodiment"]},
    }


@task(name="evaluate-site", task_run_name="evaluate-{site}", cache_policy=NONE)
def evaluate_site(params: Params, layout: Layout, site: str) -> dict:
    """Closed-loop success of Stage A, Stage B, the local-only baseline (if trained), the oracle and random actions on one site's embodiment."""
    return site_pool(params, warm=("orchestration.evaluation",)).call(evaluate_models, params, layout, site, evaluated_models(params) + REFERENCES)
