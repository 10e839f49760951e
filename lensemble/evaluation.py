"""Closed-loop evaluation: plan in latent space, act in the simulator, replan; success with a 95% CI."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from lensemble.data.windows import frames_to_tensor
from lensemble.model.predictor import rollout
from lensemble.model.world_model import WorldModel
from lensemble.planning.cem import CEMConfig, cem_plan, shift_plan
from lensemble.sim.base import Embodiment


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95% interval for a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def latent_cost(goal_ND: torch.Tensor):
    """Energy: mean squared distance of each predicted final latent to the goal latent."""

    def cost(final_SND: torch.Tensor) -> torch.Tensor:
        return (final_SND - goal_ND[None]).square().mean(dim=(1, 2))

    return cost


def model_rollout_fn(model: WorldModel, embodiment: str, z0_ND: torch.Tensor):
    """Callable for CEM: actions [S, H, K] → predicted final latents [S, N, D]."""

    def run(actions_SHK: torch.Tensor) -> torch.Tensor:
        act = model.action_heads[embodiment](actions_SHK)
        z0 = z0_ND[None].expand(actions_SHK.shape[0], -1, -1)
        return rollout(model.predictor, z0, act)[:, -1]

    return run


@torch.no_grad()
def run_episode(env: Embodiment, seed: int, max_steps: int, model: WorldModel | None, cfg: CEMConfig, gen: torch.Generator,
                execute_steps: int = 1) -> tuple[bool, list[float]]:
    """One closed-loop episode; random actions when `model` is None. Returns (success, plan seconds).

    Receding horizon: plan H actions, execute the first `execute_steps` in the simulator, replan
    from the new observation with the rest of the plan as the warm start.
    """
    env.reset(seed)
    rng = np.random.default_rng(seed)
    plan_seconds: list[float] = []
    plan = None
    queued: list[np.ndarray] = []
    goal = None
    if model is not None:
        model.eval()
        goal = model.encoder(frames_to_tensor(env.goal_frame())[None, None])[0, 0]  # [N, D]
    for _ in range(max_steps):
        if env.success():
            return True, plan_seconds
        if model is None:
            action = env.random_action(rng)
        else:
            if not queued:
                t0 = time.perf_counter()
                z0 = model.encoder(frames_to_tensor(env.render())[None, None])[0, 0]
                plan, _ = cem_plan(model_rollout_fn(model, env.name, z0), latent_cost(goal), env.action_dim, cfg, gen, plan)
                plan_seconds.append(time.perf_counter() - t0)
                queued = [plan[i].numpy() for i in range(execute_steps)]
                for _ in range(execute_steps):
                    plan = shift_plan(plan)
            action = queued.pop(0)
        env.step(action)
    return env.success(), plan_seconds


def evaluate(env: Embodiment, seeds: Sequence[int], max_steps: int, model: WorldModel | None, cfg: CEMConfig, gen: torch.Generator,
             execute_steps: int = 1) -> dict[str, float]:
    """Success rate, its Wilson 95% CI and mean plan time over the given episode seeds."""
    wins, times = 0, []
    for seed in seeds:
        ok, t = run_episode(env, seed, max_steps, model, cfg, gen, execute_steps)
        wins += int(ok)
        times.extend(t)
    low, high = wilson_interval(wins, len(seeds))
    return {
        "success_rate": wins / len(seeds),
        "ci_low": low,
        "ci_high": high,
        "episodes": float(len(seeds)),
        "plan_seconds": float(np.mean(times)) if times else 0.0,
    }
