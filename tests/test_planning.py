"""CEM planner, receding-horizon helpers and the success-rate interval."""
from __future__ import annotations

import math

import pytest
import torch

from lensemble.evaluation import wilson_interval
from lensemble.planning.cem import CEMConfig, cem_plan, shift_plan


def test_cem_finds_the_minimum_of_a_quadratic_through_callables():
    target = torch.tensor([[0.3, -0.5], [0.1, 0.7], [-0.2, 0.0]])  # [H, K]

    def rollout(actions_SHK):
        return actions_SHK  # the "world model": identity on the action sequence

    def cost(final_SHK):
        return (final_SHK - target).square().sum(dim=(1, 2))

    cfg = CEMConfig(samples=256, elites=16, iterations=8, horizon=3)
    best, best_cost = cem_plan(rollout, cost, 2, cfg, torch.Generator().manual_seed(0))
    assert best.shape == (3, 2)
    assert torch.allclose(best, target, atol=0.05) and best_cost < 0.01


def test_cem_respects_the_action_box_and_is_seed_reproducible():
    target = torch.full((2, 3), 5.0)  # outside [-1, 1]: the best plan sits on the boundary

    def cost(a):
        return (a - target).square().sum(dim=(1, 2))

    cfg = CEMConfig(samples=64, elites=8, iterations=4, horizon=2)
    a1, _ = cem_plan(lambda a: a, cost, 3, cfg, torch.Generator().manual_seed(1))
    a2, _ = cem_plan(lambda a: a, cost, 3, cfg, torch.Generator().manual_seed(1))
    assert torch.equal(a1, a2)
    assert a1.max() <= 1.0 and a1.min() >= -1.0 and a1.mean() > 0.9


def test_shift_plan_drops_the_executed_action():
    plan = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(shift_plan(plan), torch.tensor([[2.0, 3.0], [4.0, 5.0], [4.0, 5.0]]))


def test_wilson_interval_closed_form():
    low, high = wilson_interval(5, 10)
    z = 1.959964
    centre = (0.5 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.25 / 10 + z * z / 400) / (1 + z * z / 10)
    assert low == pytest.approx(centre - half) and high == pytest.approx(centre + half)
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12) and wilson_interval(10, 10)[1] == pytest.approx(1.0)
