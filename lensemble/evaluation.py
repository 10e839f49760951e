"""Closed-loop evaluation: plan, act in the simulator, replan; success with a 95% CI.

Three kinds of agent run the same episodes (same seeds, same start states and goals):
- a world model: CEM in latent space from the last `context` observations (frames + proprio) and
  the actions between them, scored by the energy to the goal observation (`goal_energy`);
- the oracle: the same CEM with the true simulator as the model (snapshot, roll out, restore) and
  the success criterion's own distance as the energy: what the protocol allows a perfect model;

Both energies are read over the horizon the same way (`ENERGY_OVER`): at its last step only ("final",
DINO-WM's) or averaged over every step of it ("mean": a plan that reaches the goal early and stays
there scores best; success is checked at every step, so that is what it measures);
- random actions: the floor.

The goal is an observation (a frame and the robot's proprioception there), never simulator state;
only the oracle reads the state, by definition.

Shape legend: S CEM samples, H horizon, C context, K action dim, N tokens, D latent width, Q proprio width.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from lensemble.data.windows import frames_to_tensor, proprio_features
from lensemble.device import model_device, to_device
from lensemble.errors import DataError
from lensemble.model.predictor import rollout
from lensemble.model.world_model import WorldModel
from lensemble.planning.cem import CEMConfig, cem_plan, shift_plan
from lensemble.sim.base import Embodiment
from lensemble.stats import wilson_interval

ORACLE = "oracle"
ENERGY_OVER = ("final", "mean")
Agent = WorldModel | Literal["oracle"] | None  # None: random actions


@dataclass(frozen=True)
class GoalObservation:
    """What the planner is given as the goal: a frame [H, W, 3] uint8 and the proprioception there [p]."""

    frame: np.ndarray
    proprio: np.ndarray | None


def check_goal(goal: GoalObservation, env: Embodiment) -> None:
    """DataError naming what is wrong with a goal observation for `env`'s embodiment."""
    size = env.image_size
    if goal.frame.shape != (size, size, 3) or goal.frame.dtype != np.uint8:
        raise DataError(f"goal frame for {env.name} must be ({size}, {size}, 3) uint8, got {goal.frame.shape} {goal.frame.dtype}")
    if env.proprio_dim and goal.proprio is None:
        raise DataError(f"goal for {env.name} has no proprioception; {env.name} records {env.proprio_dim} components: give the goal's proprio")
    if goal.proprio is not None and np.shape(goal.proprio) != (env.proprio_dim,):
        raise DataError(f"goal proprioception for {env.name} must have shape ({env.proprio_dim},), got {np.shape(goal.proprio)}")


def goal_observation(env: Embodiment) -> GoalObservation:
    """The current episode's goal as an observation, checked."""
    goal = GoalObservation(env.goal_frame(), env.goal_proprio())
    check_goal(goal, env)
    return goal


def energy_weights(env: Embodiment, width: int) -> tuple[float, torch.Tensor]:
    """(visual weight, proprio weights [Q]) of the goal energy, from the embodiment's success criterion."""
    w = torch.zeros(width)
    weights = env.goal_proprio_weights or (1.0,) * env.proprio_dim
    w[: len(weights)] = torch.tensor(weights, dtype=torch.float32)
    return float(env.goal_visual_weight), w  # on the CPU; `goal_energy` puts it beside the goal


def energy_terms(env: Embodiment) -> str:
    """What the goal energy of `env` weighs, for reports: the image's weight, then each run of proprioception components
    with one weight (0-based, ends inclusive), heaviest first, e.g. "proprio 9–10 ×1, 6–8 ×0.02; image ×0"."""
    vis, w = energy_weights(env, env.proprio_dim)
    runs: list[tuple[int, int, float]] = []
    for i, x in enumerate(w.tolist()):
        if runs and runs[-1][2] == x and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, x)
        else:
            runs.append((i, i, x))
    weighed = sorted((r for r in runs if r[2] > 0), key=lambda r: (-r[2], r[0]))
    parts = [f"{a}{'' if a == b else f'–{b}'} ×{x:g}" for a, b, x in weighed]
    return (f"proprio {', '.join(parts)}; " if parts else "") + f"image ×{vis:g}"


def check_energy_over(over: str) -> None:
    """ValueError naming the choices for an unknown way of reading the energy over the horizon."""
    if over not in ENERGY_OVER:
        raise ValueError(f"unknown planning energy {over!r} (evaluate.energy); known: {', '.join(ENERGY_OVER)}")


def planning_energy(env: Embodiment, overrides: Mapping[str, str]) -> str:
    """How `env`'s planner reads the energy over the horizon: `overrides[env.name]` (params `evaluate.energy`) or its own."""
    over = overrides.get(env.name, env.goal_energy_over)
    check_energy_over(over)
    return over


def over_horizon(e_SH: torch.Tensor, over: str) -> torch.Tensor:
    """Per-step energies [S, H] → one cost per sequence [S]: the last step's ("final") or the horizon's mean ("mean")."""
    check_energy_over(over)
    return e_SH[:, -1] if over == "final" else e_SH.mean(dim=1)


def goal_energy(goal_z_ND: torch.Tensor, goal_q_Q: torch.Tensor, visual_weight: float, proprio_weights_Q: torch.Tensor,
                over: str = "final"):
    """Energy of predicted observations (ẑ [S, H, N, D], q̂ [S, H, Q]), read over the horizon by `over_horizon`; at step h
    visual_weight · mean (ẑ_h − z_g)² + Σ_j w_j (q̂_h,j − q_g,j)² / Σ_j w_j."""
    check_energy_over(over)
    w_sum = float(proprio_weights_Q.sum())
    proprio_weights_Q = proprio_weights_Q.to(goal_q_Q.device)

    def cost(predicted: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        z_SHND, q_SHQ = predicted
        e = visual_weight * (z_SHND - goal_z_ND[None, None]).square().mean(dim=(2, 3))
        if w_sum > 0:
            e = e + ((q_SHQ - goal_q_Q[None, None]).square() * proprio_weights_Q).sum(2) / w_sum
        return over_horizon(e, over)  # [S]

    return cost


def model_rollout_fn(model: WorldModel, embodiment: str, z_CND: torch.Tensor, q_CQ: torch.Tensor, past_CK: torch.Tensor):
    """Callable for CEM: actions [S, H, K] → the predicted observations after each of them (ẑ [S, H, N, D], q̂ [S, H, Q]).

    `past_CK` holds the C − 1 actions taken between the context's observations (C ≥ 1)."""

    def run(actions_SHK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        S = actions_SHK.shape[0]
        acts = torch.cat([past_CK[None].expand(S, -1, -1), actions_SHK], dim=1).to(z_CND.device)  # [S, C-1+H, K]
        return rollout(model.predictor_for(embodiment), z_CND[None].expand(S, -1, -1, -1), q_CQ[None].expand(S, -1, -1), model.action_heads[embodiment](acts))

    return run


def oracle_rollout_fn(env: Embodiment, over: str = "final"):
    """Callable for CEM: actions [S, H, K] → the success criterion's distance after the true simulator runs them, read
    over the horizon like the models' energy (`over_horizon`) [S]."""
    check_energy_over(over)

    def run(actions_SHK: torch.Tensor) -> torch.Tensor:
        start = env.snapshot()
        dist_SH = torch.empty(actions_SHK.shape[:2])
        for s, seq in enumerate(actions_SHK.numpy()):
            for h, a in enumerate(seq):
                env.step(a)
                dist_SH[s, h] = env.goal_distance()
            env.restore(start)
        return over_horizon(dist_SH, over)

    return run


@dataclass
class History:
    """The episode so far as the world model reads it: latents [t, N, D], proprio features [t, Q], actions [t, K]."""

    action_dim: int
    z: list[torch.Tensor] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    actions: list[torch.Tensor] = field(default_factory=list)

    def context(self, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last ≤ c observations [n, N, D], [n, Q] and the n − 1 actions between them [n − 1, K]."""
        n = min(c, len(self.z))
        past = self.actions[len(self.actions) - (n - 1):] if n > 1 else []
        past_CK = torch.stack(past) if past else torch.zeros(0, self.action_dim)
        return torch.stack(self.z[-n:]), torch.stack(self.q[-n:]), past_CK


@torch.no_grad()
def run_episode(env: Embodiment, seed: int, max_steps: int, agent: Agent, cfg: CEMConfig, gen: torch.Generator,
                execute_steps: int = 1, context: int = 1, proprio_width: int = 16, energy: str = "final") -> tuple[bool, list[float]]:
    """One closed-loop episode. Returns (success, plan seconds). `energy`: how the planner reads the energy over the
    horizon (`ENERGY_OVER`), for a model and the oracle alike.

    Receding horizon: plan H actions, execute the first `execute_steps` in the simulator, replan
    from the new observation history with the rest of the plan as the warm start.
    """
    check_energy_over(energy)
    env.reset_eval(seed)
    rng = np.random.default_rng(seed)
    plan_seconds: list[float] = []
    plan, queued = None, []
    is_model = isinstance(agent, WorldModel)
    hist = History(env.action_dim)
    if is_model:
        agent.eval()
        goal = goal_observation(env)
        device = model_device(agent)
        goal_z = agent.encoder(to_device(frames_to_tensor(goal.frame), device)[None, None])[0, 0]  # [N, D]
        goal_q = proprio_features(goal.proprio, env.name, proprio_width).to(device)
        cost = goal_energy(goal_z, goal_q, *energy_weights(env, proprio_width), over=energy)
    for _ in range(max_steps):
        if env.success():
            return True, plan_seconds
        if is_model:
            hist.z.append(agent.encoder(to_device(frames_to_tensor(env.render()), device)[None, None])[0, 0])
            hist.q.append(proprio_features(env.proprio(), env.name, proprio_width).to(device))
        if agent is None:
            action = env.random_action(rng)
        else:
            if not queued:
                t0 = time.perf_counter()
                if is_model:
                    z_c, q_c, past = hist.context(context)
                    plan, _ = cem_plan(model_rollout_fn(agent, env.name, z_c, q_c, past), cost, env.action_dim, cfg, gen, plan)
                else:
                    plan, _ = cem_plan(oracle_rollout_fn(env, energy), lambda d: d, env.action_dim, cfg, gen, plan)
                plan_seconds.append(time.perf_counter() - t0)
                queued = [plan[i].clone() for i in range(execute_steps)]
                for _ in range(execute_steps):
                    plan = shift_plan(plan)
            action = queued.pop(0).numpy()
        if is_model:
            hist.actions.append(torch.as_tensor(np.clip(action, -1.0, 1.0), dtype=torch.float32))
        env.step(action)
    return env.success(), plan_seconds


def evaluate(env: Embodiment, seeds: Sequence[int], max_steps: int, agent: Agent, cfg: CEMConfig, gen: torch.Generator,
             execute_steps: int = 1, context: int = 1, proprio_width: int = 16, energy: str = "final") -> dict[str, float]:
    """Success rate, its Wilson 95% CI and mean plan time over the given episode seeds."""
    wins, times = 0, []
    for seed in seeds:
        ok, t = run_episode(env, seed, max_steps, agent, cfg, gen, execute_steps, context, proprio_width, energy)
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
