"""Real-simulator adapters (PushT on pymunk, MuJoCo point mass and reacher) behind `Embodiment`.

gym-pusht and mujoco are project dependencies: these tests fail, not skip, when they are missing.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import pytest

from lensemble.errors import ConfigError
from lensemble.sim.base import Embodiment
from lensemble.sim.mujoco_envs import MujocoPointMass, MujocoReacher, wrap_angle
from lensemble.sim.pusht import GOAL_STEPS_AHEAD, STANDARD_GOAL, PushT, pose_success, pusher_target
from lensemble.sim.registry import EMBODIMENTS, embodiment_class, make_embodiment

NAMES = ("pusht", "mujoco_point", "mujoco_reacher")
SIZE = 64

# Physics goldens after reset(3) and 30 noisy expert steps (rng 0, noise 0.3; MuJoCo 0.2 s and PushT 0.5 s
# per step): proprio, then the block pose (PushT) or the target xy (MuJoCo). Pixels are not pinned: they depend on the GL driver.
# Update deliberately when a world's XML, an expert's gains or a simulator version changes.
GOLDEN = {
    "pusht": ([-0.98857, -0.34326, -0.04433, -0.07281], [176.3774, 240.2461, 2.485]),
    "mujoco_point": ([0.1327, 0.03971, -0.11017, -0.15415], [0.1446, 0.0394]),
    "mujoco_reacher": (
        [0.84367, -0.24202, 0.99466, 0.53686, -0.97027, -0.10316, 0.58627, -1.19869, 0.58018, 0.15029, -0.10852],
        [0.1192, -0.118],
    ),
}


@pytest.fixture(scope="module")
def adapters() -> Iterator[dict[str, Embodiment]]:
    """One adapter per name, shared by the module: each holds a GL context or a physics space."""
    made = {name: make_embodiment(name, SIZE) for name in NAMES}
    yield made
    for adapter in made.values():
        adapter.close()


def _rollout(env: Embodiment, seed: int, actions_TA: np.ndarray) -> np.ndarray:
    """Frames [T + 1, H, W, 3] of `actions_TA` applied from reset(seed)."""
    env.reset(seed)
    frames = [env.render()]
    for action in actions_TA:
        env.step(action)
        frames.append(env.render())
    return np.stack(frames)


def _actions(env: Embodiment, steps: int = 8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([env.random_action(rng) for _ in range(steps)])  # [T, A]


def test_registry_builds_each_adapter(adapters: dict[str, Embodiment]) -> None:
    assert isinstance(adapters["pusht"], PushT)
    assert isinstance(adapters["mujoco_point"], MujocoPointMass)
    assert isinstance(adapters["mujoco_reacher"], MujocoReacher)
    # The two MuJoCo bodies must differ in action space for the cross-embodiment experiments.
    assert (adapters["mujoco_point"].action_dim, adapters["mujoco_reacher"].action_dim) == (2, 3)
    assert all(env.name == name for name, env in adapters.items())


@pytest.mark.parametrize("name", sorted(EMBODIMENTS))
def test_class_level_dims_are_what_the_built_simulator_reports(name: str) -> None:
    """Model building reads `action_dim` off the class (no simulator built): it must be what an instance acts with."""
    cls = embodiment_class(name)
    env = make_embodiment(name, SIZE)
    try:
        assert cls.action_dim > 0 and (env.action_dim, env.proprio_dim) == (cls.action_dim, cls.proprio_dim)
        env.reset(0)
        assert env.expert_action(np.random.default_rng(0), 0.0).shape == (cls.action_dim,)
        env.step(np.zeros(cls.action_dim, dtype=np.float32))
        assert env.proprio().shape == (cls.proprio_dim,)
        if hasattr(env, "model"):  # MuJoCo: one actuator per action component
            assert env.model.nu == cls.action_dim
    finally:
        env.close()


def test_action_dims_builds_no_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    from lensemble.config import parse_params
    from lensemble.workflow import action_dims
    from tests.conftest import micro_params

    raw = micro_params()
    raw["data"]["sites"] = [{"name": f"s{i}", "embodiment": name, "episodes": 1} for i, name in enumerate(sorted(EMBODIMENTS))]
    params = parse_params(raw)

    def refuse(self: Embodiment, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{type(self).__name__} was built")

    for name in EMBODIMENTS:
        monkeypatch.setattr(embodiment_class(name), "__init__", refuse)
    assert action_dims(params) == {name: embodiment_class(name).action_dim for name in EMBODIMENTS}


def test_missing_simulator_names_its_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lensemble.sim.pusht")
    for module in [m for m in sys.modules if m.split(".")[0] == "gym_pusht"]:
        monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules: the import fails
    with pytest.raises(ConfigError, match="pip install gym-pusht"):
        make_embodiment("pusht", SIZE)


@pytest.mark.parametrize("name", NAMES)
def test_frames_and_proprio_have_the_documented_shapes(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    env.reset(3)
    for frame in (env.render(), env.goal_frame()):
        assert frame.shape == (SIZE, SIZE, 3) and frame.dtype == np.uint8
        assert frame.std() > 5.0  # something is drawn, not a blank buffer
    proprio = env.proprio()
    assert proprio.shape == (env.proprio_dim,) and proprio.dtype == np.float32


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_frames_other_seed_other_frames(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    actions = _actions(env)
    first = _rollout(env, 11, actions)
    np.testing.assert_array_equal(first, _rollout(env, 11, actions))
    assert not np.array_equal(first[0], _rollout(env, 12, actions)[0])
    assert not np.array_equal(first[0], first[-1])  # the actions moved something


@pytest.mark.parametrize("name", NAMES)
def test_physics_reproduces_the_golden_run(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    env.reset(3)
    rng = np.random.default_rng(0)
    for _ in range(30):
        env.step(env.expert_action(rng, noise=0.3))
    proprio, world = GOLDEN[name]
    np.testing.assert_allclose(env.proprio(), proprio, atol=1e-4)
    np.testing.assert_allclose(env.block_pose() if isinstance(env, PushT) else env.goal_xy, world, atol=1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_goal_frame_leaves_the_episode_untouched(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    actions = _actions(env, steps=5)
    plain = _rollout(env, 5, actions)
    env.reset(5)
    goal = env.goal_frame()
    assert not np.array_equal(goal, plain[0])
    probed = [env.render()]
    for action in actions:
        env.goal_frame()
        env.step(action)
        probed.append(env.render())
    np.testing.assert_array_equal(plain, np.stack(probed))


@pytest.mark.parametrize("name", NAMES)
def test_actions_are_clipped_to_the_box(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    big = 7.0 * np.sign(_actions(env, steps=4, seed=1))  # [T, A], far outside [-1, 1]
    np.testing.assert_array_equal(_rollout(env, 2, big), _rollout(env, 2, np.clip(big, -1.0, 1.0)))
    with pytest.raises(ValueError, match=f"shape \\({env.action_dim},\\)"):
        env.step(np.zeros(env.action_dim + 1))


@pytest.mark.parametrize("name", ["mujoco_point", "mujoco_reacher"])
def test_mujoco_success_and_goal_frame_at_the_goal(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    env.reset(7)
    assert not env.success()  # starts are drawn at least 4 success radii away
    goal_qpos = env.goal_qpos.copy()
    env.set_state(goal_qpos, np.zeros(env.model.nv), goal_qpos)
    assert env.success() and env.distance_to_goal() < 1e-9
    np.testing.assert_array_equal(env.render(), env.goal_frame())  # the goal image is exact
    # A tip 1.5 success radii away fails (for the point mass, qpos is the tip position).
    if name == "mujoco_point":
        env.set_state(goal_qpos + [1.5 * env.success_radius, 0.0], np.zeros(2), goal_qpos)
        assert not env.success()


def test_mujoco_goals_vary_with_the_seed(adapters: dict[str, Embodiment]) -> None:
    for name in ("mujoco_point", "mujoco_reacher"):
        env = adapters[name]
        goals = []
        for seed in range(4):
            env.reset(seed)
            goals.append(env.goal_xy.copy())
        assert len({tuple(np.round(g, 6)) for g in goals}) == 4


@pytest.mark.parametrize("name", ["mujoco_point", "mujoco_reacher"])
def test_mujoco_noiseless_expert_reaches_the_goal(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    rng = np.random.default_rng(0)
    for seed in range(4):
        env.reset(seed)
        start = env.distance_to_goal()
        for _ in range(60):  # measured: first success within 9–41 steps over 20 seeds
            env.step(env.expert_action(rng, noise=0.0))
        assert env.distance_to_goal() < 0.5 * start
        assert env.success(), f"{name} seed {seed}: {env.distance_to_goal():.3f} m left"


def test_pusht_success_is_the_pose_criterion() -> None:
    goal = STANDARD_GOAL
    assert pose_success(goal, goal)
    assert pose_success(goal + [19.0, 0.0, 0.0], goal)
    assert not pose_success(goal + [0.0, 21.0, 0.0], goal)
    assert pose_success(goal + [0.0, 0.0, 0.3], goal)  # 17° < 20°
    assert not pose_success(goal + [0.0, 0.0, 0.4], goal)  # 23° > 20°
    assert pose_success(goal + [0.0, 0.0, 2.0 * np.pi - 0.3], goal)  # angles wrap
    assert abs(wrap_angle(np.array(3.5)) - (3.5 - 2.0 * np.pi)) < 1e-12


def _green_pixels(frame: np.ndarray) -> int:
    """Pixels where green dominates: the goal T (LightGreen), which nothing else in PushT is."""
    rgb = frame.astype(int)
    return int(((rgb[..., 1] > rgb[..., 0] + 40) & (rgb[..., 1] > rgb[..., 2] + 40)).sum())


def test_pusht_success_and_goal_frame_from_an_exact_state(adapters: dict[str, Embodiment]) -> None:
    env = adapters["pusht"]
    assert isinstance(env, PushT)
    env.reset(4)
    assert not env.success()
    agent = np.array([60.0, 60.0])
    env.set_state(agent, STANDARD_GOAL, STANDARD_GOAL)
    assert env.success()
    # The goal image is exactly this frame, and in it the block hides the green goal T completely.
    np.testing.assert_array_equal(env.render(), env.goal_frame())
    for goal in (STANDARD_GOAL, np.array([200.0, 300.0, -2.0])):
        env.set_state(agent, goal, goal)
        assert _green_pixels(env.goal_frame()) == 0
        env.set_state(agent, STANDARD_GOAL + [0.0, 0.0, 1.0], goal)
        assert _green_pixels(env.render()) > 20  # the goal T shows beside a misplaced block
    env.set_state(agent, STANDARD_GOAL, STANDARD_GOAL)
    env.set_state(agent, STANDARD_GOAL + [25.0, 0.0, 0.0], STANDARD_GOAL)
    assert not env.success()
    env.set_state(agent, STANDARD_GOAL + [0.0, 0.0, np.pi / 6], STANDARD_GOAL)
    assert not env.success()


def test_pusht_goal_is_fixed_unless_randomized() -> None:
    fixed, moving = PushT(SIZE), PushT(SIZE, random_goal=True)
    try:
        goals = []
        for seed in range(3):
            fixed.reset(seed)
            np.testing.assert_array_equal(fixed.goal_pose, STANDARD_GOAL)
            moving.reset(seed)
            goals.append(moving.goal_pose.copy())
            assert not np.array_equal(fixed.goal_frame(), moving.goal_frame())
        assert len({tuple(g) for g in goals}) == 3
    finally:
        fixed.close()
        moving.close()


def test_pusher_pushes_along_the_line_and_walks_round_otherwise() -> None:
    cog_local = np.array([0.0, 45.0])  # the T's centre of gravity in body coordinates
    block = np.array([256.0, 300.0, 0.0])  # centre of gravity at (256, 345)
    goal = np.array([256.0, 200.0, 0.0])  # straight up (−y), same angle: no lever
    behind = pusher_target(np.array([256.0, 440.0]), block, goal, cog_local)
    np.testing.assert_allclose(behind, [256.0, 380.0])  # 60 px further along the push line
    in_front = pusher_target(np.array([256.0, 200.0]), block, goal, cog_local)
    radius = np.linalg.norm(in_front - [256.0, 345.0])
    assert abs(radius - 115.0) < 1e-9  # orbits at block reach + 20 px instead of cutting through


def test_pusht_noiseless_expert_brings_the_block_closer(adapters: dict[str, Embodiment]) -> None:
    env = adapters["pusht"]
    assert isinstance(env, PushT)
    rng = np.random.default_rng(0)
    before, after = [], []
    for seed in range(4):
        env.reset(seed)
        before.append(np.linalg.norm(env.block_pose()[:2] - env.goal_pose[:2]))
        for _ in range(120):
            env.step(env.expert_action(rng, noise=0.0))
        after.append(np.linalg.norm(env.block_pose()[:2] - env.goal_pose[:2]))
    assert np.mean(after) < 0.5 * np.mean(before), (before, after)


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_restore_replays_the_same_future(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    env.reset_eval(5)
    snap = env.snapshot()
    actions = _actions(env, steps=4, seed=2)
    for a in actions:
        env.step(a)
    after = env.proprio(), env.goal_distance()
    env.restore(snap)
    for a in actions:
        env.step(a)
    np.testing.assert_array_equal(env.proprio(), after[0])
    assert env.goal_distance() == after[1]


@pytest.mark.parametrize("name", NAMES)
def test_the_goal_observation_carries_proprio_and_success_is_distance_under_one_tolerance(adapters: dict[str, Embodiment], name: str) -> None:
    env = adapters[name]
    env.reset_eval(6)
    goal_q = env.goal_proprio()
    assert goal_q.shape == (env.proprio_dim,) and goal_q.dtype == np.float32
    assert len(env.goal_proprio_weights) == env.proprio_dim and set(env.state_components) <= set(range(env.proprio_dim))
    assert not env.success() and env.goal_distance() > 0


def test_reacher_proprio_ends_with_the_fingertip(adapters: dict[str, Embodiment]) -> None:
    env = adapters["mujoco_reacher"]
    assert isinstance(env, MujocoReacher)
    env.reset(2)
    np.testing.assert_allclose(env.proprio()[9:], env.tip_xy(), atol=1e-6)
    np.testing.assert_allclose(env.goal_proprio()[9:], env.goal_xy, atol=1e-6)  # the goal's fingertip is the target


def test_pusht_dino_wm_goal_is_the_expert_state_five_steps_ahead(adapters: dict[str, Embodiment]) -> None:
    env = adapters["pusht"]
    assert isinstance(env, PushT)
    env.set_success_criterion("dino_wm")
    env.reset_eval(7)
    start = env.state()
    goal = env.goal_state.copy()
    env.reset(7)  # same start, training-episode goal
    np.testing.assert_array_equal(env.state(), start)
    rng = np.random.default_rng(7)
    for _ in range(GOAL_STEPS_AHEAD):
        env.step(env.expert_action(rng, 0.0))
    np.testing.assert_allclose(env.state(), goal)
    # success: (agent, block) xy within 20 px and angle within pi/9 of the goal state
    env.reset_eval(7)
    env.set_state(goal[:2] + [15.0, 0.0], goal[2:], env.goal_pose)
    assert env.success()
    env.set_state(goal[:2] + [15.0, 0.0], goal[2:] + [15.0, 0.0, 0.0], env.goal_pose)
    assert not env.success()  # 21 px over the 4-vector
    env.set_state(goal[:2], goal[2:] + [0.0, 0.0, 0.4], env.goal_pose)
    assert not env.success()
    with pytest.raises(ConfigError, match="unknown success criterion 'touch' for pusht; known: \\['dino_wm', 'pose'\\]"):
        env.set_success_criterion("touch")


def test_pusht_physics_step_equals_the_env_step() -> None:
    """The fast substeps (floats, Chipmunk called directly, no contact counter) against gym-pusht's own step,
    bit for bit, through pushes (contacts), a reset (new space and handler) and a snapshot/restore."""
    a, b, c = PushT(SIZE), PushT(SIZE), PushT(SIZE)
    try:
        rng = np.random.default_rng(0)
        for seed in (3, 11):
            for env in (a, b, c):
                env.reset(seed)
            start_block = b.block_pose()
            for i in range(60):
                target = (b.expert_action(rng, 0.2).astype(np.float64) + 1.0) / 2.0 * 512.0 if i % 3 else rng.uniform(0.0, 512.0, 2)
                a.env.step(target)  # gym-pusht's own step: physics plus observation, reward, coverage
                b._env_step(target)
                c._env_step_reference(target)
                if i == 30:
                    snap = b.snapshot()
                    for env in (a, b, c):
                        env.restore(snap)
            assert np.abs(b.block_pose() - start_block).max() > 1.0  # the agent pushed the block: contacts were solved
            for other in (a, c):
                np.testing.assert_array_equal(other.state(), b.state())
                for body in ("agent", "block"):
                    np.testing.assert_array_equal(np.array(getattr(other.env, body).velocity), np.array(getattr(b.env, body).velocity))
                assert other.env.block.angular_velocity == b.env.block.angular_velocity
    finally:
        for env in (a, b, c):
            env.close()
