"""dm_control suite adapters (point_mass-easy, reacher-easy) behind `Embodiment`, held against the suite itself.

The reference is dm_control: episode starts equal a suite environment loaded with `random=seed`, and
`success()` equals the suite's reward being 1. Run: `pytest tests/test_dmc.py` (~10 s on 2 cores).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from lensemble.errors import ConfigError
from lensemble.evaluation import ORACLE, evaluate
from lensemble.planning.cem import CEMConfig
from lensemble.sim.dmc import DmcPointMass, DmcReacher, _DmcEmbodiment
from lensemble.sim.registry import make_embodiment
from tests.test_sim_adapters import (  # the same helpers, on these adapters
    _actions,
    _rollout,
)

NAMES = ("dmc_point_mass", "dmc_reacher")
SIZE = 64

# After reset(3) and 30 noisy expert steps (rng 0, noise 0.3): proprio, then the target xy. Update deliberately
# when an expert's gains, the frame skip or the dm_control / mujoco version changes.
GOLDEN = {
    "dmc_point_mass": ([-0.00796, 0.00282, -0.00313, -0.02369], [0.0, 0.0]),
    "dmc_reacher": ([0.28665, -0.95804, -0.45966, 0.88809, 0.00178, -0.00062, -0.78656, -0.38844], [0.12247, -0.03219]),
}


@pytest.fixture(scope="module")
def adapters() -> Iterator[dict[str, _DmcEmbodiment]]:
    made = {name: make_embodiment(name, SIZE) for name in NAMES}
    yield made
    for env in made.values():
        env.close()


def _place(env: _DmcEmbodiment, qpos: np.ndarray) -> None:
    """Put the body at `qpos` at rest, controls off (the suite's point_mass reward includes a control term)."""
    env.physics.data.qpos[:] = qpos
    env.physics.data.qvel[:] = 0.0
    env.physics.data.ctrl[:] = 0.0
    env.physics.forward()


def test_registry_builds_the_suite_adapters(adapters: dict[str, _DmcEmbodiment]) -> None:
    assert isinstance(adapters["dmc_point_mass"], DmcPointMass) and isinstance(adapters["dmc_reacher"], DmcReacher)
    assert [(adapters[n].action_dim, adapters[n].physics.model.nu) for n in NAMES] == [(2, 2), (2, 2)]


def test_missing_dm_control_names_its_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lensemble.sim.dmc")
    for module in [m for m in sys.modules if m.split(".")[0] == "dm_control"]:
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError, match="pip install dm-control"):
        make_embodiment("dmc_reacher", SIZE)


@pytest.mark.parametrize("name", NAMES)
def test_episode_starts_are_the_suites(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    from dm_control import suite

    env = adapters[name]
    for seed in (3, 11):
        env.reset(seed)
        ref = suite.load(env.domain, env.task, task_kwargs={"random": seed})
        ref.reset()
        np.testing.assert_array_equal(env.physics.get_state(), ref.physics.get_state())
        np.testing.assert_array_equal(env.target_xy(), ref.physics.named.model.geom_pos["target", :2])
        ref.close()


@pytest.mark.parametrize("name", NAMES)
def test_success_is_the_suites_reward_condition(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    """success() ⇔ the suite's reward is 1, over states scattered around the target (controls off)."""
    env = adapters[name]
    assert env.tolerance() == pytest.approx({"dmc_point_mass": 0.015, "dmc_reacher": 0.06}[name], abs=1e-12)
    rng = np.random.default_rng(0)
    hits = 0
    for seed in range(40):
        env.reset(seed)
        _place(env, env.goal_qpos + rng.normal(0.0, 0.012 if name == "dmc_point_mass" else 0.3, env.action_dim))
        reward = env._env.task.get_reward(env.physics)
        assert env.success() == (reward == 1.0), (seed, env.distance_to_goal(), reward)
        assert env.success() == (env.goal_distance() <= 1.0)
        hits += env.success()
    assert 5 <= hits <= 35  # both sides of the boundary were tested


@pytest.mark.parametrize("name", NAMES)
def test_success_at_the_goal_not_at_the_start(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    for seed in range(30):
        env.reset(seed)
        assert not env.success()  # starts that the suite would count as won are redrawn
    env.reset(7)
    _place(env, env.goal_qpos)
    assert env.success() and env.distance_to_goal() < 1e-9
    np.testing.assert_array_equal(env.render(), env.goal_frame())  # the goal image is exact
    np.testing.assert_array_equal(env.proprio(), env.goal_proprio())


@pytest.mark.parametrize("name", NAMES)
def test_frames_show_the_body_and_proprio_has_the_documented_shapes(
    adapters: dict[str, _DmcEmbodiment], name: str
) -> None:
    env = adapters[name]
    env.reset(3)
    start, goal = env.render(), env.goal_frame()
    for frame in (start, goal):
        assert frame.shape == (SIZE, SIZE, 3) and frame.dtype == np.uint8
    # At 64x64 the body is visible: moving it from the start to the goal changes pixels where it was and where it is.
    changed = np.abs(start.astype(int) - goal.astype(int)).max(-1) > 30
    assert changed.sum() >= {"dmc_point_mass": 4, "dmc_reacher": 20}[name], changed.sum()
    proprio = env.proprio()
    assert proprio.shape == (env.proprio_dim,) and proprio.dtype == np.float32
    assert len(env.proprio_scale) == len(env.goal_proprio_weights) == env.proprio_dim


@pytest.mark.parametrize("name", NAMES)
def test_goal_energy_on_proprio_is_the_success_distance(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    """The weighted proprio components separate current and goal observation by exactly the suite's distance."""
    env = adapters[name]
    env.reset(4)
    w = np.asarray(env.goal_proprio_weights, dtype=bool)
    gap = np.linalg.norm(env.proprio()[w] - env.goal_proprio()[w])
    assert abs(gap - env.distance_to_goal()) < 1e-6


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_frames_other_seed_other_frames(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    actions = _actions(env)
    first = _rollout(env, 11, actions)
    np.testing.assert_array_equal(first, _rollout(env, 11, actions))
    assert not np.array_equal(first[0], _rollout(env, 12, actions)[0])
    assert not np.array_equal(first[0], first[-1])


@pytest.mark.parametrize("name", NAMES)
def test_physics_reproduces_the_golden_run(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    env.reset(3)
    rng = np.random.default_rng(0)
    for _ in range(30):
        env.step(env.expert_action(rng, noise=0.3))
    proprio, target = GOLDEN[name]
    np.testing.assert_allclose(env.proprio(), proprio, atol=1e-4)
    np.testing.assert_allclose(env.target_xy(), target, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_restore_replays_the_same_future_bit_for_bit(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    actions = _actions(env, steps=5, seed=2)
    env.reset_eval(5)
    snap = env.snapshot()
    for a in actions:
        env.step(a)
    after = env.physics.get_state(), env.render(), env.goal_distance()
    env.reset(6)  # another episode: another target (reacher) and goal pose; restore brings them back
    env.restore(snap)
    for a in actions:
        env.step(a)
    np.testing.assert_array_equal(env.physics.get_state(), after[0])
    np.testing.assert_array_equal(env.render(), after[1])
    assert env.goal_distance() == after[2]


@pytest.mark.parametrize("name", NAMES)
def test_goal_frame_leaves_the_episode_untouched(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    actions = _actions(env, steps=4)
    plain = _rollout(env, 5, actions)
    env.reset(5)
    probed = [env.render()]
    for action in actions:
        env.goal_frame()
        env.goal_proprio()
        env.step(action)
        probed.append(env.render())
    np.testing.assert_array_equal(plain, np.stack(probed))


@pytest.mark.parametrize("name", NAMES)
def test_actions_are_clipped_to_the_box(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    big = 7.0 * np.sign(_actions(env, steps=4, seed=1))
    np.testing.assert_array_equal(_rollout(env, 2, big), _rollout(env, 2, np.clip(big, -1.0, 1.0)))
    with pytest.raises(ValueError, match=f"shape \\({env.action_dim},\\)"):
        env.step(np.zeros(env.action_dim + 1))


@pytest.mark.parametrize("name", NAMES)
def test_noiseless_expert_reaches_the_goal(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    rng = np.random.default_rng(0)
    for seed in range(6):
        env.reset(seed)
        for _ in range(25):  # measured: first success within 3-8 (point mass, 20 seeds), 3-17 (reacher, 30 seeds) steps
            if env.success():
                break
            env.step(env.expert_action(rng, noise=0.0))
        assert env.success(), f"{name} seed {seed}: {env.distance_to_goal():.3f} m left"


@pytest.mark.parametrize("name", NAMES)
def test_oracle_planner_succeeds_and_random_actions_rarely(adapters: dict[str, _DmcEmbodiment], name: str) -> None:
    env = adapters[name]
    small = CEMConfig(samples=24, elites=4, iterations=2, horizon=4)
    oracle = evaluate(env, range(4), 20, ORACLE, small, torch.Generator().manual_seed(0), execute_steps=3)
    assert oracle["success_rate"] >= 0.75, oracle
    random = evaluate(env, range(16), 20, None, small, torch.Generator().manual_seed(0))
    assert random["success_rate"] <= 0.25, random


def test_reacher_goal_pose_puts_the_fingertip_on_the_target(adapters: dict[str, _DmcEmbodiment]) -> None:
    env = adapters["dmc_reacher"]
    for seed in range(8):
        env.reset(seed)
        goal = env.goal_proprio()
        np.testing.assert_allclose(goal[4:6], 0.0, atol=1e-12)  # to_target vanishes in the goal observation
        assert abs(env.goal_qpos[1]) <= np.deg2rad(160.0)  # inside the wrist's range
        assert np.sign(env.goal_qpos[1]) == np.sign(env.physics.position()[1]) or env.physics.position()[1] == 0


def test_unknown_success_criterion_lists_the_known_ones(adapters: dict[str, _DmcEmbodiment]) -> None:
    with pytest.raises(ConfigError, match=r"unknown success criterion 'touch' for dmc_reacher; known: \['fingertip'\]"):
        adapters["dmc_reacher"].set_success_criterion("touch")
    with pytest.raises(ConfigError, match=r"known: \['target'\]"):
        adapters["dmc_point_mass"].set_success_criterion("touch")
