"""Prefect tasks of `lensemble join SITE`: the joining site's episodes, then its joined and from-scratch models."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import Params
from lensemble.paths import Layout
from orchestration.join_sites import join_site
from orchestration.joining import run_join
from orchestration.workers import site_pool
from tasks.data import generate_site


@task(name="join-generate", task_run_name="{site}-generate", cache_policy=NONE)
def generate_join_episodes(params: Params, layout: Layout, site: str) -> dict:
    """The joining site's episodes and private index, at the site (data/join/<site>/); its data manifest."""
    j = join_site(params, site)
    return generate_site.fn(params, site, j.embodiment, j.episodes, layout.join_episodes(site))


@task(name="join-train-evaluate", task_run_name="{site}-join", cache_policy=NONE)
def join_and_evaluate(params: Params, layout: Layout, site: str) -> dict:
    """The joined and the from-scratch model trained at the site, and both planned closed loop (in a worker)."""
    return site_pool(params, warm=("orchestration.joining",)).call(run_join, params, layout, site)
