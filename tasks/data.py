"""Prefect tasks of the prepare stage: one task run per site, one for the public probe."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from lensemble.config import Params
from lensemble.data.audit import fingerprints, index_path
from lensemble.data.episodes import data_manifest, generate_episodes, write_episodes, write_json
from lensemble.data.lerobot import read_lerobot
from lensemble.observability.progress import Progress
from lensemble.sim.registry import make_embodiment


@task(name="generate-site", task_run_name="generate-{site}", cache_policy=NONE)
def generate_site(params: Params, site: str, embodiment: str, episodes: int, out_path: Path, index_out: Path | None = None) -> dict:
    """Generate one site's episodes into `out_path` and its private-content index into `index_out`.

    Returns the site's data manifest (counts and hashes). The index (default: `private_index.npz`
    beside the store) is what the residency guard and the leak scan recognise the site's rows by;
    it stays at the site.
    """
    env = make_embodiment(embodiment, params.data.image_size)
    d = params.data
    progress = Progress(f"generate {site}", episodes, unit="episode", every_fraction=0.25)
    eps = generate_episodes(env, params.run.seed, f"site/{site}", episodes, d.episode_length, d.expert_noise, d.random_fraction,
                            d.segment_length, progress=progress.advance)
    env.close()
    write_episodes(eps, out_path)
    fingerprints(eps).save(index_out or index_path(out_path))
    return data_manifest(eps, out_path)


@task(name="import-site", task_run_name="import-{site}", cache_policy=NONE)
def import_site(params: Params, site: str, dataset: Path, out_path: Path, index_out: Path, source_out: Path) -> dict:
    """Import one site's episodes from the LeRobot dataset at `dataset` (its `source` in params) into `out_path`.

    The store, the private-content index and the returned data manifest are exactly those of a generated
    site. The provenance (dataset, codebase version, fps, keys, info.json hash) goes to `source_out`,
    which stays at the site beside the store: the released manifest keeps its typed fields only.
    """
    s = next(x for x in params.data.sites if x.name == site)
    d = params.data
    imported = read_lerobot(dataset, s.source.camera, s.embodiment, d.image_size, d.episode_length, s.episodes,
                            state_key=s.source.state, action_key=s.source.action)
    write_episodes(imported.episodes, out_path)
    fingerprints(imported.episodes).save(index_out)
    write_json({"format": "lerobot", "dataset": str(dataset), "codebase_version": imported.codebase_version, "fps": imported.fps,
                "camera": s.source.camera, "state": s.source.state, "action": s.source.action,
                "info_sha256": imported.info_sha256, "source_episodes": imported.source_episodes,
                "episodes": imported.episodes.num_episodes, "episode_length": d.episode_length}, source_out)
    return data_manifest(imported.episodes, out_path)


@task(name="generate-probe", task_run_name="generate-probe-{embodiment}", cache_policy=NONE)
def generate_probe(params: Params, embodiment: str, out_path: Path) -> dict:
    """The public probe of one embodiment, from its own public seed namespace."""
    env = make_embodiment(embodiment, params.data.image_size)
    d = params.data
    eps = generate_episodes(env, params.run.seed, f"public-probe/{embodiment}", d.probe_episodes, d.episode_length, d.expert_noise, d.random_fraction, d.segment_length)
    env.close()
    write_episodes(eps, out_path)
    return data_manifest(eps, out_path)
