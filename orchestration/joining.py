"""A robot that took no part in the federation joins it (`lensemble join SITE`): the work, at the joining site.

The question a multi-embodiment federation exists to answer: does a new embodiment, with only a few
episodes of its own, do better on the federated encoder and predictor than on a model of its own?

1. The site generates its `episodes` episodes (`join.sites[]`) into data/join/<site>/ with its
   private-content index beside them, as a federation site's prepare does; they never leave the site.
2. **Joined**: the global encoder and predictor (models/federated.pt), frozen, with a new local action
   head and a new local proprio adapter for the site's embodiment, the only trained parts (`join.steps`
   AdamW steps on the site's episodes). The adapter maps the robot's proprioception into the frame the
   federated proprio encoder was trained on and the predicted change back (lensemble.model.predictor):
   without it the frozen predictor reads the new robot's components as another robot's.
3. **From scratch**: the same architecture (adapter included), freshly initialised, every parameter
   trained for the same steps on the same episodes.
4. Both plan closed loop with the same CEM on the same evaluation seeds, beside the oracle planner and
   random actions (lensemble.evaluation); success with Wilson intervals, and a Fisher exact test of
   joined against scratch.

What leaves the site is the result dict, released through the site's residency guard (scalars only).
"""
from __future__ import annotations

import time

import torch
from scipy import stats

from lensemble.config import Params
from lensemble.data.audit import load_index
from lensemble.data.episodes import read_episodes
from lensemble.data.residency import ResidencyGuard
from lensemble.errors import DataError
from lensemble.evaluation import ORACLE
from lensemble.model.world_model import WorldModel, load_federated
from lensemble.paths import Layout
from lensemble.seeds import generator
from lensemble.training import make_optimizer, train_steps
from lensemble.workflow import build_model, eval_seeds, place, sampler_for
from orchestration.evaluation import closed_loop, planning_env
from orchestration.join_sites import join_site

AGENTS = ("joined", "scratch", "oracle", "random")
TRAINED = ("joined", "scratch")
TRAINING_FIGURES = ("loss/pred", "loss/proprio", "loss/sigreg", "loss/anchor", "steps", "seconds", "trained_parameters")
JOIN_METRICS = frozenset(
    [f"eval/join/{k}/{a}" for k in ("success_rate", "ci_low", "ci_high") for a in AGENTS]
    + [f"eval/join/{k}/{m}" for k in TRAINING_FIGURES for m in TRAINED] + ["eval/join/plan_seconds", "eval/join/joined_vs_scratch_p"]
)
"""The names the joining site's guard lets leave: its result, scalars only."""


def joined_model(params: Params, layout: Layout, embodiment: str) -> WorldModel:
    """The federated encoder + predictor with a new, untrained action head and proprio adapter for `embodiment`; only those train."""
    path = layout.models / "federated.pt"
    if not path.is_file():
        raise DataError(f"Stage B model {path} does not exist: run the federation first (dvc repro)")
    model = build_model(params, f"eval/join/head/{embodiment}", extra_embodiments=(embodiment,))
    load_federated(model, torch.load(path, map_location="cpu", weights_only=True))
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith((f"action_heads.{embodiment}.", f"proprio_adapters.{embodiment}.")))
    return place(model, params)


def train(model: WorldModel, params: Params, embodiment: str, eps, steps: int, key: str) -> dict:
    """`steps` AdamW steps on the site's episodes over the model's trainable parameters; mean losses and seconds."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (make_optimizer(model, params.train) if len(trainable) == len(list(model.parameters())) else
           torch.optim.AdamW(trainable, lr=params.train.lr, weight_decay=params.train.weight_decay, foreach=True))
    t0 = time.perf_counter()
    log = train_steps(model, opt, [(embodiment, sampler_for(eps, params))], steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=-3, data_key=key)
    return {**log.mean(), "steps": steps, "seconds": time.perf_counter() - t0,
            "trained_parameters": sum(p.numel() for p in trainable)}


def run_join(params: Params, layout: Layout, name: str) -> dict:
    """Steps 2-4 of the module docstring for the joining site `name`, whose episodes are in `join_dir` (step 1)."""
    site = join_site(params, name)
    store = layout.join_episodes(name)
    eps = read_episodes(store, params.data.image_size)
    if eps.embodiment != site.embodiment:
        raise DataError(f"{store} holds {eps.embodiment} episodes, but join.sites {name} is {site.embodiment}: regenerate them")
    joined = joined_model(params, layout, site.embodiment)
    scratch = place(build_model(params, f"eval/join/scratch/{site.embodiment}", extra_embodiments=(site.embodiment,)), params)
    training = {"joined": train(joined, params, site.embodiment, eps, params.join.steps, f"eval/join/{name}/joined"),
                "scratch": train(scratch, params, site.embodiment, eps, params.join.steps, f"eval/join/{name}/scratch")}
    env = planning_env(params, site.embodiment)
    seeds = eval_seeds(params, site.embodiment)
    agents = {"joined": joined.eval(), "scratch": scratch.eval(), "oracle": ORACLE, "random": None}
    success = {}
    try:
        for agent_name, agent in agents.items():
            gen = generator(params.run.seed, f"cem/join/{agent_name}", participant=name)
            success[agent_name] = closed_loop(params, env, site.embodiment, agent, gen)
    finally:
        env.close()
    wins = {a: round(success[a]["success_rate"] * len(seeds)) for a in AGENTS}
    n = len(seeds)
    p_value = float(stats.fisher_exact([[wins["joined"], n - wins["joined"]], [wins["scratch"], n - wins["scratch"]]]).pvalue)
    numbers = {f"eval/join/success_rate/{a}": success[a]["success_rate"] for a in AGENTS}
    numbers |= {f"eval/join/ci_low/{a}": success[a]["ci_low"] for a in AGENTS} | {f"eval/join/ci_high/{a}": success[a]["ci_high"] for a in AGENTS}
    numbers |= {f"eval/join/{k}/{m}": float(v) for m, t in training.items() for k, v in t.items()}
    numbers |= {"eval/join/plan_seconds": success["joined"]["plan_seconds"], "eval/join/joined_vs_scratch_p": p_value}
    # what leaves the site: scalars, through its guard (fp32-rounded, scanned against its private rows)
    guard = ResidencyGuard(name, None, layout.site_audit(name), private=load_index(store, eps), metric_names=JOIN_METRICS)
    released = guard.release("metrics", numbers)
    scratch_rate = released["eval/join/success_rate/scratch"]
    return {
        "site": name, "embodiment": site.embodiment, "episodes": site.episodes, "steps": params.join.steps, "evaluation_episodes": n,
        "success_criterion": f"{env.criterion}: {env.success_criteria[env.criterion]}", "metrics": released,
        "success": {a: {"success_rate": released[f"eval/join/success_rate/{a}"], "ci_low": released[f"eval/join/ci_low/{a}"],
                        "ci_high": released[f"eval/join/ci_high/{a}"], "wins": wins[a]} for a in AGENTS},
        "joined_over_scratch": released["eval/join/success_rate/joined"] / scratch_rate if scratch_rate > 0 else None,
        "joined_vs_scratch_p": released["eval/join/joined_vs_scratch_p"],
    }
