"""Latent-MPC: the cross-entropy method over action sequences, receding horizon.

The planner knows nothing of models: `rollout_fn(actions_SHK) -> final latents` and
`cost_fn(final latents) -> [S] costs` are callables, so the same CEM plans with any world model and
any energy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CEMConfig:
    samples: int
    elites: int
    iterations: int
    horizon: int
    init_std: float = 0.7
    min_std: float = 0.05


def cem_plan(
    rollout_fn: Callable[[torch.Tensor], torch.Tensor],
    cost_fn: Callable[[torch.Tensor], torch.Tensor],
    action_dim: int,
    cfg: CEMConfig,
    gen: torch.Generator,
    init_mean_HK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """Best action sequence [H, K] in [-1, 1] and its cost. S samples, H horizon, K action dim."""
    mean = torch.zeros(cfg.horizon, action_dim) if init_mean_HK is None else init_mean_HK.clone()
    std = torch.full((cfg.horizon, action_dim), cfg.init_std)
    best_actions, best_cost = mean.clone(), float("inf")
    for _ in range(cfg.iterations):
        noise = torch.randn(cfg.samples, cfg.horizon, action_dim, generator=gen)
        actions = (mean + std * noise).clamp(-1.0, 1.0)  # [S, H, K]
        actions[0] = mean.clamp(-1.0, 1.0)  # keep the current mean as a candidate
        costs = cost_fn(rollout_fn(actions)).cpu()  # [S]; the model may plan on a GPU, the search runs here
        order = torch.argsort(costs)
        elites = actions[order[: cfg.elites]]
        if float(costs[order[0]]) < best_cost:
            best_cost, best_actions = float(costs[order[0]]), actions[order[0]].clone()
        mean = elites.mean(0)
        std = elites.std(0, unbiased=False).clamp_min(cfg.min_std)
    return best_actions, best_cost


def shift_plan(actions_HK: torch.Tensor) -> torch.Tensor:
    """Warm start for the next replanning: drop the executed action, repeat the last."""
    return torch.cat([actions_HK[1:], actions_HK[-1:]], dim=0)
