"""The world models the gauge and evaluate stages read, and the closed-loop comparison of any of them on one site."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from lensemble.config import Params
from lensemble.dynamics import dynamics_report, push_capture, push_windows_for, world_probe_r2, world_probe_set
from lensemble.errors import DataError
from lensemble.evaluation import ORACLE, energy_terms, evaluate, planning_energy
from lensemble.model.world_model import WorldModel, load_federated
from lensemble.paths import Layout
from lensemble.planning.cem import CEMConfig
from lensemble.seeds import generator
from lensemble.sim.registry import make_embodiment
from lensemble.workflow import (
    build_model,
    eval_seeds,
    load_probe_episodes,
    load_site,
    place,
    site_embodiment,
)


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(f"{what} {path} does not exist: run its stage first (dvc repro)")
    return path


def load_centralized(params: Params, layout: Layout) -> WorldModel:
    """The Stage A model."""
    model = build_model(params, "centralized")
    model.load_state_dict(torch.load(_require(layout.models / "centralized.pt", "Stage A model"), map_location="cpu", weights_only=True))
    return place(model, params).eval()


def load_federated_for_site(params: Params, layout: Layout, site: str) -> WorldModel:
    """The Stage B global encoder + predictor with `site`'s own local action head."""
    model = build_model(params, f"site/{site}")
    saved = torch.load(_require(layout.site_state(site), f"site {site!r} state"), map_location="cpu", weights_only=True)
    model.load_state_dict(saved["model"])
    load_federated(model, torch.load(_require(layout.models / "federated.pt", "Stage B model"), map_location="cpu", weights_only=True))
    return place(model, params).eval()


def load_local_only(params: Params, layout: Layout, site: str) -> WorldModel:
    """The site's no-federation baseline."""
    model = build_model(params, f"local/{site}")
    model.load_state_dict(torch.load(_require(layout.models / "local" / f"{site}.pt", f"site {site!r} local-only model"), map_location="cpu", weights_only=True))
    return place(model, params).eval()


MODEL_LOADERS = {
    "centralized": lambda params, layout, site: load_centralized(params, layout),
    "federated": load_federated_for_site,
    "local_only": load_local_only,
    "oracle": lambda params, layout, site: ORACLE,
    "random": lambda params, layout, site: None,
}
REFERENCES = ("oracle", "random")  # the protocol's ceiling and floor, read beside every model
log = logging.getLogger("lensemble.progress")


def evaluate_models(params: Params, layout: Layout, site: str, names: tuple[str, ...]) -> dict:
    """Closed-loop success of the named agents (keys of MODEL_LOADERS) on `site`'s embodiment, same seeds, starts
    and goals for all; and the dynamics diagnostics of every world model among them."""
    embodiment = site_embodiment(params, site)
    models = {name: MODEL_LOADERS[name](params, layout, site) for name in names}  # DataError before any episode
    train_eps, held_out = load_site(layout, params, site), load_probe_episodes(layout, params, embodiment)
    c = params.evaluate.cem
    diagnostics = {name: dynamics_report(m, train_eps, held_out, c.context, c.horizon, params.model.proprio_dim, params.run.seed)
                   for name, m in models.items() if isinstance(m, WorldModel)}
    env = planning_env(params, embodiment)
    energy = planning_energy(env, params.evaluate.energy)
    out = {}
    try:
        probe_frames, probe_targets = world_probe_set(env, params.run.seed)  # the same states for every model
        pushes = push_windows_for(env, params)  # the same simulator windows for every model
        for name, d in diagnostics.items():
            d["world_probe_r2"] = world_probe_r2(models[name], probe_frames, probe_targets)
            if pushes is not None:
                d.update(push_capture(models[name], pushes, params.model.proprio_dim))
        for i, (name, model) in enumerate(models.items(), start=1):
            t0 = time.monotonic()
            out[name] = closed_loop(params, env, embodiment, model, cem_generator(params, name, site))
            log.info(f"evaluate {site}: agent {i}/{len(models)} {name}, success {out[name]['success_rate']:.2f} over "
                     f"{int(out[name]['episodes'])} episodes, {time.monotonic() - t0:.1f} s")
    finally:
        env.close()
    return {"embodiment": embodiment, "success_criterion": f"{env.criterion}: {env.success_criteria[env.criterion]}",
            "max_steps": params.evaluate.max_steps, "energy": energy, "energy_terms": energy_terms(env), "diagnostics": diagnostics, **out}


def planning_env(params: Params, embodiment: str):
    """The embodiment's simulator as the planner meets it: at the run's image size, judged by its configured success criterion."""
    env = make_embodiment(embodiment, params.data.image_size)
    env.set_success_criterion(params.evaluate.success.get(embodiment, env.criterion))
    return env


def closed_loop(params: Params, env, embodiment: str, model, gen: torch.Generator, execute_steps: int | None = None) -> dict:
    """One agent's closed loop on the embodiment's evaluation episodes: `evaluation.evaluate` with the run's CEM settings
    and the agent's CEM draws `gen`, every `execute_steps` planned actions executed before replanning (default
    `evaluate.cem.execute_steps`). The evaluate stage, `lensemble join` and `benchmarks/plan_seeds.py` plan through it."""
    c = params.evaluate.cem
    return evaluate(env, eval_seeds(params, embodiment), params.evaluate.max_steps, model, CEMConfig(c.samples, c.elites, c.iterations, c.horizon),
                    gen, c.execute_steps if execute_steps is None else execute_steps, c.context, params.model.proprio_dim,
                    planning_energy(env, params.evaluate.energy))


def cem_generator(params: Params, name: str, site: str, cem_seed_offset: int = 0) -> torch.Generator:
    """Agent `name`'s CEM draws at `site`; offset 0 is the evaluate stage's own."""
    return generator(params.run.seed + cem_seed_offset, f"cem/{name}", participant=site)


def evaluated_models(params: Params) -> tuple[str, ...]:
    """The world models the evaluate stage compares: the local-only baseline only when federate trained it."""
    return ("centralized", "federated", "local_only") if params.federate.local_only else ("centralized", "federated")
