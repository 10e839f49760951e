"""CEM planner, receding-horizon helpers and the success-rate interval."""
from __future__ import annotations

import math

import pytest
import torch

from lensemble.stats import wilson_interval
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


# ------------------------------------------------------------------ goals, energy, oracle, history

import numpy as np  # noqa: E402

from lensemble.errors import DataError  # noqa: E402
from lensemble.evaluation import (  # noqa: E402
    ORACLE, GoalObservation, History, check_goal, energy_weights, evaluate, goal_energy, goal_observation, oracle_rollout_fn,
    planning_energy)
from lensemble.sim.gridworld import PointAgent  # noqa: E402


def test_a_goal_without_proprio_for_an_embodiment_that_has_it_is_refused():
    env = PointAgent(image_size=8)
    env.reset(0)
    frame = env.goal_frame()
    with pytest.raises(DataError, match="goal for grid_point has no proprioception; grid_point records 2 components"):
        check_goal(GoalObservation(frame, None), env)
    with pytest.raises(DataError, match=r"must have shape \(2,\)"):
        check_goal(GoalObservation(frame, np.zeros(3, np.float32)), env)
    with pytest.raises(DataError, match="goal frame for grid_point must be"):
        check_goal(GoalObservation(frame[:4], env.goal_proprio()), env)
    goal = goal_observation(env)
    assert np.array_equal(goal.proprio, env.goal.astype(np.float32))


def test_goal_energy_is_the_weighted_distance_in_closed_form():
    goal_z, goal_q = torch.zeros(2, 3), torch.tensor([1.0, 2.0, 0.0, 0.0])
    w = torch.tensor([0.0, 2.0, 1.0, 0.0])
    # 5 sequences of 3 predicted steps: at step h sequence s sits at s + h in every latent entry and proprio 2
    at_SH = torch.arange(5.0)[:, None] + torch.arange(3.0)[None]
    z = torch.ones(5, 3, 2, 3) * at_SH[:, :, None, None]
    q = torch.zeros(5, 3, 4)
    q[:, :, 2] = at_SH
    per_step = 0.5 * at_SH ** 2 + (2 * 4.0 + at_SH ** 2) / 3.0  # [S, H]
    assert torch.allclose(goal_energy(goal_z, goal_q, 0.5, w)((z, q)), per_step[:, -1])
    assert torch.allclose(goal_energy(goal_z, goal_q, 0.5, w, over="mean")((z, q)), per_step.mean(1))
    # the reacher's weights read the fingertip, and its joint velocities a little; never the arm's pose
    from lensemble.sim.registry import embodiment_class

    reacher = embodiment_class("mujoco_reacher")
    vis, wq = energy_weights(reacher, 16)
    assert vis == 0.0 and wq.nonzero().flatten().tolist() == [6, 7, 8, 9, 10]
    assert wq[9] == wq[10] == 1.0 and 0.0 < wq[6] == wq[7] == wq[8] <= 0.05
    _, wp = energy_weights(embodiment_class("mujoco_point"), 16)
    assert wp.nonzero().flatten().tolist() == [0, 1]


def test_the_energy_is_described_as_the_weights_it_applies():
    from lensemble.evaluation import energy_terms
    from lensemble.sim.registry import embodiment_class

    assert energy_terms(embodiment_class("mujoco_reacher")) == "proprio 9–10 ×1, 6–8 ×0.02; image ×0"
    assert energy_terms(embodiment_class("mujoco_point")) == "proprio 0–1 ×1; image ×0"
    assert energy_terms(embodiment_class("pusht")) == "proprio 0–1 ×1; image ×1"
    assert energy_terms(embodiment_class("dmc_reacher")) == "proprio 4–5 ×1; image ×0"


def test_the_reachers_energy_prefers_arriving_at_rest_and_ignores_the_arm_pose():
    """Two plans put the fingertip on the same path to the target; one arrives with the arm still, the other swinging
    (how the models' plans passed through the target and on). The reacher's energy prefers the first; a third plan
    that ends still but in another arm pose (same fingertip) costs what the first does."""
    from lensemble.sim.registry import embodiment_class

    reacher = embodiment_class("mujoco_reacher")
    vis, w = energy_weights(reacher, 16)
    goal_q = torch.zeros(16)
    goal_q[9:11] = torch.tensor([0.5, -0.5])  # the goal's fingertip; its joints at rest (velocities 0)
    path_H2 = torch.tensor([[0.0, 0.0], [0.25, -0.25], [0.5, -0.5]])  # the fingertip reaches the goal at the last step
    still, swinging, other_pose = (torch.zeros(1, 3, 16) for _ in range(3))
    for q in (still, swinging, other_pose):
        q[0, :, 9:11] = path_H2
    swinging[0, :, 6:9] = 3.0  # every joint turning at 3 rad/s
    other_pose[0, :, 0:6] = 0.7  # another cos/sin of the joint angles
    z = torch.zeros(1, 3, 2, 4)
    for over in ("final", "mean"):
        cost = goal_energy(torch.zeros(2, 4), goal_q, vis, w, over=over)
        assert float(cost((z, still))) < float(cost((z, swinging)))
        assert float(cost((z, other_pose))) == float(cost((z, still)))
    # on the goal with every joint turning at 1 rad/s costs more than still 2 cm off it, less than still 5 cm off
    # (the fingertip's proprio_scale is 0.15 m): the velocities weigh little beside the criterion
    final = goal_energy(torch.zeros(2, 4), goal_q, vis, w)
    at_goal = still.clone()
    at_goal[0, -1, 6:9] = 1.0
    off = [still.clone() for _ in range(2)]
    for q, metres in zip(off, (0.02, 0.05)):
        q[0, -1, 9] = goal_q[9] + metres / 0.15
    assert float(final((z, off[0]))) < float(final((z, at_goal))) < float(final((z, off[1])))


def test_history_context_is_the_last_observations_and_the_actions_between_them():
    h = History(2, [torch.full((1, 2), float(i)) for i in range(5)], [torch.full((3,), float(i)) for i in range(5)],
                [torch.full((2,), float(i)) for i in range(4)])
    z, q, past = h.context(3)
    assert z[:, 0, 0].tolist() == [2.0, 3.0, 4.0] and q[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert past[:, 0].tolist() == [2.0, 3.0]  # a_2 between o_2 and o_3, a_3 between o_3 and o_4
    z1, _, past1 = h.context(1)
    assert z1.shape[0] == 1 and past1.shape == (0, 2)


def test_the_oracle_plans_with_the_true_simulator_and_leaves_the_episode_untouched():
    env = PointAgent(image_size=8)
    cfg = CEMConfig(samples=32, elites=4, iterations=2, horizon=3)
    seeds = list(range(6))
    oracle = evaluate(env, seeds, 20, ORACLE, cfg, torch.Generator().manual_seed(0), execute_steps=1)
    random = evaluate(env, seeds, 20, None, cfg, torch.Generator().manual_seed(0))
    assert oracle["success_rate"] == 1.0 and random["success_rate"] < 1.0
    # planning rolls the simulator forward and restores it: the state after planning is the state before
    env.reset_eval(3)
    before = env.snapshot()
    costs = oracle_rollout_fn(env)(torch.rand(8, 3, 2) * 2 - 1)
    assert costs.shape == (8,) and np.array_equal(env.snapshot(), before)


def test_the_mean_energy_prefers_arriving_early_and_final_cannot_tell():
    """Two plans that end on the goal: one there after the first step and staying, one only at the last step.
    Read at the last step they tie; averaged over the horizon the early arrival wins, for a model's energy and for the
    oracle's true distances alike (each the mean of the distances after every prefix of the plan)."""
    env = PointAgent(image_size=8)
    env.reset_eval(0)
    env.goal, env.pos = np.array([0.5, 0.5]), np.array([0.6, 0.5])  # one step (0.1) right of the goal
    early = torch.tensor([[-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # step onto the goal, then stay
    late = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])  # wait, then step onto it
    plans = torch.stack([early, late])
    final = oracle_rollout_fn(env, "final")(plans)
    mean = oracle_rollout_fn(env, "mean")(plans)
    assert final[0] == pytest.approx(final[1], abs=1e-6) and final[0] == pytest.approx(0.0, abs=1e-6)
    assert mean[0] == pytest.approx(0.0, abs=1e-6) and mean[1] == pytest.approx(2 * 0.1 / 3, rel=1e-5)
    # the same plans as a model would predict them (proprio = position), through the model energy
    q = torch.tensor(env.pos, dtype=torch.float32) + torch.cumsum(plans * 0.1, dim=1)  # [2, 3, 2]
    z = torch.zeros(2, 3, 1, 1)
    goal_q = torch.tensor(env.goal, dtype=torch.float32)
    e_final = goal_energy(torch.zeros(1, 1), goal_q, 0.0, torch.ones(2))((z, q))
    e_mean = goal_energy(torch.zeros(1, 1), goal_q, 0.0, torch.ones(2), over="mean")((z, q))
    assert e_final[0] == pytest.approx(e_final[1], abs=1e-9) and e_mean[0] < e_mean[1]


def test_each_embodiment_reads_its_energy_its_own_way_unless_params_say_otherwise():
    from lensemble.sim.registry import embodiment_class

    assert planning_energy(embodiment_class("mujoco_point"), {}) == "mean"
    assert planning_energy(embodiment_class("mujoco_reacher"), {}) == "mean"
    assert planning_energy(embodiment_class("pusht"), {}) == "final"  # pushing must leave the goal to reach it
    assert planning_energy(embodiment_class("mujoco_point"), {"mujoco_point": "final"}) == "final"
    with pytest.raises(ValueError, match=r"unknown planning energy 'sum' \(evaluate.energy\); known: final, mean$"):
        planning_energy(embodiment_class("pusht"), {"pusht": "sum"})
    with pytest.raises(ValueError, match="unknown planning energy"):
        goal_energy(torch.zeros(1, 1), torch.zeros(2), 1.0, torch.ones(2), over="last")
