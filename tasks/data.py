"""Prefect tasks of the prepare stage: one task run per site, one for the public probe."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import Params
from lensemble.data.episodes import data_manifest, generate_episodes, write_episodes
from lensemble.sim.registry import make_embodiment


@task(name="generate-site", cache_policy=NONE)
def generate_site(params: Params, site: str, embodiment: str, episodes: int, out_path: Path) -> dict:
    """Generate one site's episodes into `out_path`; returns its data manifest (counts and hashes)."""
    env = make_embodiment(embodiment, params.data.image_size)
    d = params.data
    eps = generate_episodes(env, params.run.seed, f"site/{site}", episodes, d.episode_length, d.expert_noise, d.random_fraction, d.segment_length)
    env.close()
    write_episodes(eps, out_path)
    return data_manifest(eps, out_path)


@task(name="generate-probe", cache_policy=NONE)
def generate_probe(params: Params, embodiment: str, out_path: Path) -> dict:
    """The public probe of one embodiment, from its own public seed namespace."""
    env = make_embodiment(embodiment, params.data.image_size)
    d = params.data
    eps = generate_episodes(env, params.run.seed, f"public-probe/{embodiment}", d.probe_episodes, d.episode_length, d.expert_noise, d.random_fraction, d.segment_length)
    env.close()
    write_episodes(eps, out_path)
    return data_manifest(eps, out_path)
