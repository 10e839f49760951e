"""DeepMind Control Suite tasks as embodiments: point_mass-easy (2-D force) and reacher-easy (2 torques).

Each adapter holds one suite environment, `dm_control.suite.load(domain, task, task_kwargs={'random': seed})`,
and reseeds its task's RandomState at every `reset(seed)`, so episode `seed` starts exactly where a suite
environment loaded with `random=seed` starts after `reset()` (tests/test_dmc.py holds the two together).
The physics is stepped directly (`frame_skip` suite control steps of 20 ms per env step), not through
`Environment.step`, which would end the episode at the suite's 20 s time limit.

Success is the suite's own reward condition (the in-bounds region of its `rewards.tolerance`), read from
dm_control/suite/point_mass.py and reacher.py:
- point_mass-easy: mass-to-target distance ≤ the target's radius, 0.015 m (the target sits at the origin);
- reacher-easy: fingertip-to-target distance ≤ target radius + finger radius, 0.05 + 0.01 = 0.06 m.
An episode whose start already satisfies it is redrawn from the same seeded stream (no episode is won at
step 0, for any agent). `goal_distance()` is that distance divided by the tolerance: ≤ 1 is success.

The goal is an observation: `goal_frame()` renders a second `Physics` (sharing the model, so the target
is drawn where the episode has it) placed at a goal configuration that puts the mass or the fingertip on
the target centre, and `goal_proprio()` is the suite observation there. Frames come from the suite's
top-down "fixed" camera, which shows the whole 0.6 m arena: at 64×64 the point mass is a 2×2-pixel dot
on a 2×2-pixel target, the reacher's arm and 5 cm target are plainly visible. Shadows are turned off at
render time: on Mesa's llvmpipe they cost ~30 ms of a ~37 ms frame (point mass, 64×64), and the bodies
are centimetres above a plane seen from straight above.

dm_control 1.0.50's generated struct tables list nine flex fields that mujoco 4.0 no longer has, and
building any suite `Physics` fails on them; `_drop_unknown_struct_fields` removes those entries (named
indexing of flex arrays, which neither task has) before the first environment is built.
"""
from __future__ import annotations

import numpy as np

from lensemble.sim.base import Embodiment
from lensemble.sim.mujoco_envs import gl_error, mujoco, wrap_angle  # sets MUJOCO_GL before dm_control reads it


def _drop_unknown_struct_fields() -> None:
    """Remove from dm_control's size tables the MjModel/MjData fields the installed mujoco lacks."""
    from dm_control.mujoco.wrapper.mjbindings import sizes

    model = mujoco.MjModel.from_xml_string("<mujoco/>")
    for struct, obj in (("mjmodel", model), ("mjdata", mujoco.MjData(model))):
        table = sizes.array_sizes[struct]
        for field in [f for f in table if not hasattr(obj, f)]:
            del table[field]


_drop_unknown_struct_fields()
from dm_control import suite  # noqa: E402  (after the table fix above)

_STATE = mujoco.mjtState.mjSTATE_INTEGRATION  # qpos, qvel, act, ctrl, warm start, time: a bit-exact replay


class _DmcEmbodiment(Embodiment):
    """Shared suite plumbing; subclasses name the task, its success geometry, goal configuration and expert."""

    domain: str = ""
    task: str = ""
    frame_skip: int = 1  # suite control steps (20 ms each) per env step
    camera = "fixed"
    target_geom = "target"
    effector_geom = ""  # the geom whose distance to the target the suite's reward measures

    def __init__(self, image_size: int = 64) -> None:
        super().__init__(image_size)
        self._env = suite.load(self.domain, self.task, task_kwargs={"random": 0})
        self.physics = self._env.physics
        vis = self.physics.model.vis.global_
        vis.offwidth, vis.offheight = max(int(vis.offwidth), self.image_size), max(int(vis.offheight), self.image_size)
        self._goal_physics = self.physics.copy(share_model=True)  # rendered by goal_frame, never stepped
        self.goal_qpos = np.zeros(self.physics.model.nq)

    # -- the suite's task geometry --------------------------------------------------------------
    def target_xy(self) -> np.ndarray:
        """World xy of the target centre (set by the suite's episode initialisation)."""
        return self.physics.named.model.geom_pos[self.target_geom, :2].copy()

    def tolerance(self) -> float:
        """The distance within which the suite's reward is 1 (metres)."""
        raise NotImplementedError

    def distance_to_goal(self) -> float:
        """Effector-centre-to-target-centre distance in metres, as the suite's reward reads it."""
        xpos = self.physics.named.data.geom_xpos
        return float(np.linalg.norm(xpos[self.target_geom, :2] - xpos[self.effector_geom, :2]))

    def success(self) -> bool:
        return self.distance_to_goal() <= self.tolerance()  # rewards.tolerance's bounds are closed

    def goal_distance(self) -> float:
        return self.distance_to_goal() / self.tolerance()

    # -- episodes -------------------------------------------------------------------------------
    def goal_configuration(self) -> np.ndarray:
        """qpos that puts the effector centre on the target centre (the goal observation's pose)."""
        raise NotImplementedError

    def reset(self, seed: int) -> None:
        self._env.task.random.seed(seed)  # the stream suite.load(..., task_kwargs={'random': seed}) starts with
        self._env.reset()
        while self.success():  # the suite would count this episode won at step 0
            self._env.reset()
        self._place_goal(self.goal_configuration())

    def _place_goal(self, goal_qpos: np.ndarray) -> None:
        self.goal_qpos = np.asarray(goal_qpos, dtype=np.float64).copy()
        self._goal_physics.data.qpos[:] = self.goal_qpos
        self._goal_physics.data.qvel[:] = 0.0
        self._goal_physics.forward()

    def step(self, action_A: np.ndarray) -> None:
        action_A = np.asarray(action_A, dtype=np.float64)
        if action_A.shape != (self.action_dim,):
            raise ValueError(f"{self.name} takes actions of shape ({self.action_dim},), got {action_A.shape}")
        self.physics.set_control(np.clip(action_A, -1.0, 1.0))
        self.physics.step(self.frame_skip)  # dm_control's step leaves position-dependent fields current

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(integration state, target position, goal qpos): the episode's randomness lives in the model too."""
        return self.physics.get_state(_STATE), self.physics.model.geom_pos.copy(), self.goal_qpos.copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        state, geom_pos, goal_qpos = snap
        self.physics.model.geom_pos[:] = geom_pos
        self.physics.set_state(state, _STATE)
        self.physics.forward()
        if not np.array_equal(goal_qpos, self.goal_qpos):
            self._place_goal(goal_qpos)

    # -- observations ---------------------------------------------------------------------------
    def _render(self, physics) -> np.ndarray:
        try:
            frame = physics.render(self.image_size, self.image_size, camera_id=self.camera,
                                   render_flag_overrides={"shadow": False})
        except (ImportError, RuntimeError, AttributeError, mujoco.FatalError) as exc:  # GL failures
            raise gl_error(exc) from exc
        return np.ascontiguousarray(frame)  # [H, W, 3] uint8

    def render(self) -> np.ndarray:
        return self._render(self.physics)

    def goal_frame(self) -> np.ndarray:
        return self._render(self._goal_physics)

    def proprio(self) -> np.ndarray:
        return self._proprio(self.physics)

    def goal_proprio(self) -> np.ndarray:
        return self._proprio(self._goal_physics)

    def _proprio(self, physics) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        for physics in (self._goal_physics, self.physics):
            physics.free()


class DmcPointMass(_DmcEmbodiment):
    """dm_control point_mass-easy: a 0.3 kg mass on a damped plane, action = planar force (±0.1 N per axis).

    Success (the suite's reward condition): the mass centre within the target's radius, 0.015 m, of the
    target centre; the target is the suite's, fixed at the origin, and the start is drawn uniformly in the
    joints' ±0.29 m range. proprio = the suite's observation [position x, y, velocity x, y] (m, m/s).
    At full force the mass reaches 0.1 m/s with a 0.3 s time constant, so one env step of 0.4 s moves it
    up to 4 cm (4 px at 64×64) and the farthest start is ~11 steps away. The goal energy weighs position
    only, and the goal image carries no weight: the target is drawn in every frame.
    """

    name = "dmc_point_mass"
    domain, task = "point_mass", "easy"
    action_dim = 2
    proprio_dim = 4
    proprio_scale = (0.15, 0.15, 0.05, 0.05)
    goal_proprio_weights = (1.0, 1.0, 0.0, 0.0)
    goal_visual_weight = 0.0
    state_components = (0, 1)
    success_criteria = {"target": "point_mass-easy: mass centre within the target radius (0.015 m) of the target"}
    frame_skip = 20
    effector_geom = "pointmass"

    def tolerance(self) -> float:
        return float(self.physics.named.model.geom_size[self.target_geom, 0])

    def goal_configuration(self) -> np.ndarray:
        # The slide joints' zero puts the mass geom right above the target's geom (both at the origin).
        return self.target_xy()

    def _proprio(self, physics) -> np.ndarray:
        return np.concatenate([physics.position(), physics.velocity()]).astype(np.float32)

    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        # PD on position: saturates beyond ~4 cm and brakes on the approach so it settles on the target.
        error = self.goal_qpos - self.physics.position()
        action = 25.0 * error - 2.0 * self.physics.velocity() + noise * rng.standard_normal(2)
        return np.clip(action, -1.0, 1.0).astype(np.float32)


class DmcReacher(_DmcEmbodiment):
    """dm_control reacher-easy: a planar 2-link arm (12 + 12 cm), shoulder and wrist torques; goal: a fingertip position.

    Success (the suite's reward condition): the fingertip centre within target radius + finger radius,
    0.05 + 0.01 = 0.06 m, of the target centre; the suite draws the target at 5–20 cm from the shoulder
    and the joints uniformly (wrist within ±160°). proprio = the suite's observation with the angles as
    (cos, sin) because the shoulder turns freely: [cos q_s, sin q_s, cos q_w, sin q_w, to_target x, y,
    q̇_s, q̇_w], where to_target is the suite's target-minus-fingertip vector. The goal configuration is the
    inverse kinematics of the target on the start's elbow side, so the goal observation has to_target = 0,
    and the goal energy weighs to_target only: exactly the distance the suite's reward measures.
    One env step is 2 suite steps (40 ms): the arm is light and quick (up to ~6 rad/s under the expert), and
    at 4 (80 ms) random actions flailing through 20 steps already won 12.5% of 200 episodes, at 2 they win 4.5%.
    """

    name = "dmc_reacher"
    domain, task = "reacher", "easy"
    action_dim = 2
    proprio_dim = 8
    proprio_scale = (1.0, 1.0, 1.0, 1.0, 0.15, 0.15, 5.0, 5.0)
    goal_proprio_weights = (0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0)
    goal_visual_weight = 0.0
    state_components = (4, 5)
    success_criteria = {"fingertip": "reacher-easy: fingertip within target + finger radius (0.06 m) of the target"}
    frame_skip = 2
    effector_geom = "finger"
    links = (0.12, 0.12)  # shoulder → wrist → fingertip (reacher.xml)

    def tolerance(self) -> float:
        return float(self.physics.named.model.geom_size[[self.target_geom, self.effector_geom], 0].sum())

    def goal_configuration(self) -> np.ndarray:
        (l1, l2), (x, y) = self.links, self.target_xy()
        cos_w = np.clip((x * x + y * y - l1 * l1 - l2 * l2) / (2 * l1 * l2), -1.0, 1.0)
        wrist = np.arccos(cos_w) * (1.0 if self.physics.position()[1] >= 0 else -1.0)
        shoulder = np.arctan2(y, x) - np.arctan2(l2 * np.sin(wrist), l1 + l2 * np.cos(wrist))
        return np.array([shoulder, wrist])

    def _proprio(self, physics) -> np.ndarray:
        (shoulder, wrist), to_target = physics.position(), physics.finger_to_target()
        angles = [np.cos(shoulder), np.sin(shoulder), np.cos(wrist), np.sin(wrist)]
        return np.concatenate([angles, to_target, physics.velocity()]).astype(np.float32)

    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        # Joint-space PD towards the goal configuration; the shoulder takes the short way round.
        error = self.goal_qpos - self.physics.position()
        error[0] = wrap_angle(error[0])
        action = 3.0 * error - 0.3 * self.physics.velocity() + noise * rng.standard_normal(2)
        return np.clip(action, -1.0, 1.0).astype(np.float32)
