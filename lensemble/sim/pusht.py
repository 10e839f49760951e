"""PushT (gym-pusht): a disk agent pushes a T-shaped block onto a goal pose in a 512×512 workspace.

Action: a normalized target position for the agent, a ∈ [-1, 1]^2 ↦ (a + 1) / 2 · 512 px, which
the env's PD controller tracks for 10 physics substeps per env step (0.1 s); one model step holds it
for FRAME_SKIP = 5 env steps (0.5 s), DINO-WM's frameskip. The frame is the
env's 512×512 drawing (white floor, green goal T, grey block, blue agent) reduced to
image_size×image_size by area averaging (cv2.INTER_AREA: an exact block mean when image_size
divides 512), not the env's own bilinear 96×96 resize, which aliases thin edges.

Training episodes (`reset`): the goal is PushT's fixed pose (256, 256, π/4) unless
`random_goal=True`, which draws the goal pose from the reset seed (the env reads `goal_pose` for
drawing and coverage, so overriding it is sound); `success()` is then the literature's criterion on
the block's pose (origin within 20 px, angle within π/9), computed from the physics state rather
than the env's 95 %-coverage termination.

Evaluation episodes (`reset_eval`) follow DINO-WM's protocol: from gym-pusht's random start, the
scripted expert (no noise) runs GOAL_STEPS_AHEAD model steps (25 env steps); the state it reaches is the goal, its
rendering and the agent's proprioception there are the goal observation, and the simulator returns
to the start. Success is DINO-WM's `eval_state`: the 4-vector (agent xy, block xy) within 20 px of
the goal's and the block angle within π/9. The drawn green T stays at the fixed pose in every frame,
as in the training data.

Pinned to gym-pusht 0.1.x: rendering uses its `_draw()` and the goal canvas its `_setup()`.
"""
from __future__ import annotations

import os

os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # pygame prints a banner on import

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import pygame  # noqa: E402
import pymunk  # noqa: E402
from gym_pusht.envs.pusht import PushTEnv  # noqa: E402
from pymunk._chipmunk import lib as _cp  # noqa: E402

from lensemble.sim.base import Embodiment  # noqa: E402

WORKSPACE = 512.0  # px; the env's action space is [0, 512]^2
STANDARD_GOAL = np.array([256.0, 256.0, np.pi / 4])  # x, y, θ of the block's origin
GOAL_LOW, GOAL_HIGH = 140.0, 372.0  # random goals keep the whole T (≤ 121 px from its origin) inside
SUCCESS_DIST_PX, SUCCESS_ANGLE = 20.0, np.pi / 9
BLOCK_REACH = 95.0  # px from the block's centre of gravity that clears the T plus the agent's radius
ORBIT_STEP = 0.6  # rad the pusher walks round the block per step
PUSH_TURNS = np.deg2rad([0, 20, -20, 40, -40, 60, -60, 80, -80, 100, -100, 120, -120])
AGENT_MARKER_PX, AGENT_MARKER_RGB = 36, (65, 105, 225)  # drawn agent radius (workspace px) and gym-pusht's agent blue
FRAME_SKIP = 5  # env steps (0.1 s each) per model step, DINO-WM's frameskip
_CP_NOOP_POST_SOLVE = pymunk.Space().add_collision_handler(0, 0)._handler.postSolveFunc
"""Chipmunk's default post-solve (does nothing), read from a fresh handler before pymunk sets a Python one."""
GOAL_STEPS_AHEAD = 5  # model steps = 25 env steps: DINO-WM's goals, 25 env steps ahead of the start on an expert rollout


def wrap_angle(a: float) -> float:
    """An angle mapped to [-π, π)."""
    return float((a + np.pi) % (2.0 * np.pi) - np.pi)


def pose_success(block_pose: np.ndarray, goal_pose: np.ndarray) -> bool:
    """Block origin within 20 px of the goal and orientation within π/9 (T has no symmetry)."""
    close = np.linalg.norm(np.asarray(block_pose[:2]) - goal_pose[:2]) < SUCCESS_DIST_PX
    return bool(close and abs(wrap_angle(block_pose[2] - goal_pose[2])) < SUCCESS_ANGLE)


def dino_wm_distance(state: np.ndarray, goal_state: np.ndarray) -> tuple[float, float]:
    """(px distance of (agent xy, block xy) to the goal's, |block angle error| in rad); state = [ax, ay, bx, by, θ]."""
    pos = float(np.linalg.norm(np.asarray(state[:4]) - goal_state[:4]))
    return pos, abs(wrap_angle(state[4] - goal_state[4]))


def _rotate(v: np.ndarray, theta: float) -> np.ndarray:
    c, s = np.cos(theta), np.sin(theta)
    return np.array([c * v[0] - s * v[1], s * v[0] + c * v[1]])


def pusher_target(
    agent_xy: np.ndarray, block_pose: np.ndarray, goal_pose: np.ndarray, cog_local: np.ndarray
) -> np.ndarray:
    """Where a simple scripted pusher sends the agent next (px).

    It picks a push line: towards the goal's centre of gravity, offset sideways so the push also
    turns the block towards the goal angle (near the goal it only turns). Off the line it walks
    round the block to a point behind it; on the line it drives forward through the block.
    """
    cog = block_pose[:2] + _rotate(cog_local, block_pose[2])
    goal_cog = goal_pose[:2] + _rotate(cog_local, goal_pose[2])
    delta = goal_cog - cog
    dist = float(np.linalg.norm(delta))
    ang_err = wrap_angle(goal_pose[2] - block_pose[2])
    if dist > 15.0:
        push_u = delta / dist
        lever = -np.clip(ang_err, -1.0, 1.0) * 30.0  # off-centre push: torque (lever·perp) × push_u
    else:  # at the goal position: push the stem sideways, 50 px out from the centre, to turn
        stem = _rotate(np.array([0.0, 1.0]), block_pose[2])
        push_u = np.sign(ang_err) * np.array([-stem[1], stem[0]])
        lever = -np.sign(ang_err) * 50.0  # puts the push line through cog + 50 · stem
    # A push needs room behind the block: near a wall, turn the push line until it has some.
    for turn in PUSH_TURNS:
        u = _rotate(push_u, turn)
        perp = np.array([-u[1], u[0]])
        line_point = cog + lever * perp
        behind = line_point - u * BLOCK_REACH
        if np.all((behind > 20.0) & (behind < WORKSPACE - 20.0)):
            break
    push_u = u
    rel = agent_xy - line_point
    along, lateral = float(rel @ push_u), float(rel @ perp)
    if along < -10.0 and abs(lateral) < 20.0:  # behind the line point: keep pushing through
        return np.clip(line_point + push_u * (along + 60.0), 20.0, WORKSPACE - 20.0)  # push
    # Orbit the block towards `behind` in 35° steps so the walk round never cuts through the T.
    phi_agent = np.arctan2(*(agent_xy - cog)[::-1])
    turn = wrap_angle(np.arctan2(*(behind - cog)[::-1]) - phi_agent)
    target = behind
    if abs(turn) > ORBIT_STEP:
        phi = phi_agent + np.sign(turn) * ORBIT_STEP
        target = cog + (BLOCK_REACH + 20.0) * np.array([np.cos(phi), np.sin(phi)])
    return np.clip(target, 20.0, WORKSPACE - 20.0)


class PushT(Embodiment):
    """gym-pusht's PushT behind the Embodiment interface.

    proprio = [agent x, agent y, agent vx, agent vy], positions in the action's [-1, 1] units and
    velocities in workspaces per second (px/s ÷ 512). The block is world state, not proprio.
    The goal frame shows the block at the goal pose and the agent where the episode started.
    """

    name = "pusht"
    action_dim = 2
    proprio_dim = 4
    proprio_scale = (0.5, 0.5, 1.0, 1.0)
    goal_proprio_weights = (1.0, 1.0, 0.0, 0.0)  # the agent's position is part of DINO-WM's criterion
    goal_visual_weight = 1.0  # the block is seen only in the image
    state_components = (0, 1)
    success_criteria = {
        "dino_wm": (f"DINO-WM: (agent xy, block xy) within {SUCCESS_DIST_PX:.0f} px of the goal's and block angle within pi/9; "
                    f"goal {GOAL_STEPS_AHEAD * FRAME_SKIP} env steps ({GOAL_STEPS_AHEAD} model steps of frameskip {FRAME_SKIP}) ahead of "
                    "gym-pusht's random start on the noiseless scripted expert"),
        "pose": f"block origin within {SUCCESS_DIST_PX:.0f} px of PushT's fixed goal pose and angle within pi/9",
    }

    world_probe_components = ("block_xy", "block_angle")
    pushable = True

    def world_probe_state(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Agent and block at random (gym-pusht's start ranges), the goal region at PushT's fixed goal pose: the
        block's position (workspace units) and its angle as (cos θ, sin θ), what the planner's goal image must show."""
        agent = rng.uniform(50.0, 450.0, 2)
        block = np.array([*rng.uniform(100.0, 400.0, 2), rng.uniform(-np.pi, np.pi)])
        self.set_state(agent, block, STANDARD_GOAL)
        return {"block_xy": block[:2] / WORKSPACE, "block_angle": np.array([np.cos(block[2]), np.sin(block[2])])}

    def __init__(self, image_size: int = 64, random_goal: bool = False) -> None:
        super().__init__(image_size)
        self.random_goal = random_goal
        self.env = PushTEnv(obs_type="state", render_mode="rgb_array")
        self._canvas = PushTEnv(obs_type="state", render_mode="rgb_array")  # draws goal frames only
        self._canvas._setup()
        self.goal_pose = STANDARD_GOAL.copy()
        self.agent_start = np.full(2, WORKSPACE / 2)
        self.goal_state: np.ndarray | None = None  # [ax, ay, bx, by, θ] in an evaluation episode, else None
        self._goal_obs: tuple[np.ndarray, np.ndarray] | None = None
        self.reset(0)  # a valid state before the first explicit reset

    def reset(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        # gym-pusht's own start distribution, drawn from our generator for reproducibility.
        start = [*rng.integers(50, 450, size=2), *rng.integers(100, 400, size=2), rng.uniform(-np.pi, np.pi)]
        goal = STANDARD_GOAL.copy()
        if self.random_goal:
            goal = np.array([*rng.uniform(GOAL_LOW, GOAL_HIGH, size=2), rng.uniform(-np.pi, np.pi)])
        self.env.reset(options={"reset_to_state": np.asarray(start, dtype=np.float64)})
        self.goal_pose = goal
        self.env.goal_pose = goal.copy()
        self.agent_start = np.array(self.env.agent.position)
        self.goal_state, self._goal_obs = None, None

    def reset_eval(self, seed: int) -> None:
        """DINO-WM's protocol: the goal is where the noiseless expert is GOAL_STEPS_AHEAD steps after the start
        (criterion `pose`: PushT's fixed goal pose, as in training episodes)."""
        self.reset(seed)
        if self.criterion != "dino_wm":
            return
        start = self.snapshot()
        rng = np.random.default_rng(seed)
        for _ in range(GOAL_STEPS_AHEAD):
            self.step(self.expert_action(rng, 0.0))
        goal_state = self.state()
        self._goal_obs = (self.render(), self.proprio())
        self.restore(start)
        self.goal_state = goal_state

    def state(self) -> np.ndarray:
        """[agent x, agent y, block x, block y, block θ] (px, rad): the state DINO-WM's criterion reads."""
        return np.array([*self.env.agent.position, *self.block_pose()])

    def set_state(self, agent_xy: np.ndarray, block_pose: np.ndarray, goal_pose: np.ndarray) -> None:
        """Place agent, block and goal exactly, at rest (tests and evaluation goals)."""
        self.goal_pose = np.asarray(goal_pose, dtype=np.float64).copy()
        self.env.goal_pose = self.goal_pose.copy()
        self.agent_start = np.asarray(agent_xy, dtype=np.float64).copy()
        self._place(self.env, agent_xy, block_pose)

    @staticmethod
    def _place(env: PushTEnv, agent_xy: np.ndarray, block_pose: np.ndarray) -> None:
        env.agent.position = tuple(map(float, agent_xy))
        env.agent.velocity = (0.0, 0.0)
        # Angle first: pymunk turns a body about its centre of gravity, which would move the origin.
        env.block.angle = float(block_pose[2])
        env.block.position = tuple(map(float, block_pose[:2]))
        env.block.velocity, env.block.angular_velocity = (0.0, 0.0), 0.0
        # Refresh the shapes' cached world vertices (drawing reads them) without a physics step.
        env.space.reindex_shapes_for_body(env.agent)
        env.space.reindex_shapes_for_body(env.block)

    def step(self, action_A: np.ndarray) -> None:
        """One model step: the target position held for FRAME_SKIP env steps (0.1 s each), as DINO-WM's frameskip 5."""
        action_A = np.asarray(action_A, dtype=np.float64)
        if action_A.shape != (self.action_dim,):
            raise ValueError(f"{self.name} takes actions of shape ({self.action_dim},), got {action_A.shape}")
        target = (np.clip(action_A, -1.0, 1.0) + 1.0) / 2.0 * WORKSPACE
        for _ in range(FRAME_SKIP):
            self._env_step(target)

    def _env_step(self, target_xy: np.ndarray) -> None:
        """gym-pusht 0.1.x `PushTEnv.step`'s physics (PD on the agent, `n_steps` pymunk substeps), without
        its observation, reward, shapely coverage and contact counting (`success()` reads the state).

        The PD update is gym-pusht's Vec2d arithmetic written out on floats, the same IEEE operations in
        the same order, and the substeps call Chipmunk directly, so the state is the env's bit for bit
        (tests/test_sim_adapters.py) at ~5x less Python per substep: CEM with the true simulator (the
        oracle planner) runs ~10^5 of these an evaluation.
        """
        env = self.env
        env._last_action = target_xy
        space = env.space
        if space._add_later or space._remove_later or space._post_step_callbacks or space.threaded:
            return self._env_step_reference(target_xy)  # pymunk's own bookkeeping is needed
        self._skip_contact_counting(env)
        tx, ty = float(target_xy[0]), float(target_xy[1])
        body, cp_space = env.agent._body, space._space
        k_p, k_v, dt = env.k_p, env.k_v, env.dt
        for _ in range(int(1 / (env.dt * env.control_hz))):
            p, v = _cp.cpBodyGetPosition(body), _cp.cpBodyGetVelocity(body)
            ax = k_p * (tx - p.x) + k_v * (0 - v.x)  # k_p (target - pos) + k_v (Vec2d(0, 0) - vel)
            ay = k_p * (ty - p.y) + k_v * (0 - v.y)
            _cp.cpBodySetVelocity(body, (v.x + ax * dt, v.y + ay * dt))
            space._locked = True
            try:
                _cp.cpSpaceStep(cp_space, dt)
            finally:
                space._locked = False

    def _env_step_reference(self, target_xy: np.ndarray) -> None:
        """The same physics through pymunk's Python API (Vec2d), as gym-pusht writes it."""
        env = self.env
        target = pymunk.Vec2d(float(target_xy[0]), float(target_xy[1]))
        for _ in range(int(1 / (env.dt * env.control_hz))):
            env.agent.velocity += (env.k_p * (target - env.agent.position) + env.k_v * (pymunk.Vec2d(0, 0) - env.agent.velocity)) * env.dt
            env.space.step(env.dt)

    @staticmethod
    def _skip_contact_counting(env: PushTEnv) -> None:
        """Give the env's contact handler Chipmunk's own no-op post-solve instead of gym-pusht's Python counter.

        The counter only feeds `info["n_contacts"]` of `PushTEnv.step`, which is never called here; post-solve
        runs after the collision response, so the physics is unchanged. The env builds a new space (and
        handler) on every reset, hence the check per step.
        """
        handler = env.collision_handeler._handler
        if handler.postSolveFunc != _CP_NOOP_POST_SOLVE:
            handler.postSolveFunc = _CP_NOOP_POST_SOLVE

    def _frame(self, env: PushTEnv) -> np.ndarray:
        screen = env._draw()  # [512, 512] pygame surface, goal T included
        # The agent is a 15 px disk, under a pixel at 32-64 px frames: mark it with a larger disk of its
        # colour so the image carries where it is (the physics keeps the 15 px body). Drawn at 15 px, a PushT-only
        # model (48 episodes x 2000 steps, benchmarks/world_model_check.py) lost the agent (probe R² 0.21 against 0.76,
        # 1-step latent rollout / copy 0.96 against 0.41) and the pushes with it (push capture 0.07 against 0.25).
        pygame.draw.circle(screen, AGENT_MARKER_RGB, tuple(map(int, env.agent.position)), AGENT_MARKER_PX)
        full = np.frombuffer(pygame.image.tobytes(screen, "RGB"), dtype=np.uint8)
        full = full.reshape(int(WORKSPACE), int(WORKSPACE), 3)  # [H, W, 3], row = workspace y
        size = (self.image_size, self.image_size)
        return cv2.resize(full, size, interpolation=cv2.INTER_AREA)  # [image_size, image_size, 3]

    def render(self) -> np.ndarray:
        return self._frame(self.env)

    def goal_frame(self) -> np.ndarray:
        if self._goal_obs is not None:
            return self._goal_obs[0].copy()
        self._canvas.goal_pose = self.goal_pose.copy()
        self._place(self._canvas, self.agent_start, self.goal_pose)
        return self._frame(self._canvas)

    def block_pose(self) -> np.ndarray:
        """The block's origin pose [x, y, θ] (px, rad), as the env reports it."""
        return np.array([*self.env.block.position, self.env.block.angle])

    def proprio(self) -> np.ndarray:
        pos = np.array(self.env.agent.position) / WORKSPACE * 2.0 - 1.0
        vel = np.array(self.env.agent.velocity) / WORKSPACE
        return np.concatenate([pos, vel]).astype(np.float32)

    def goal_proprio(self) -> np.ndarray:
        if self._goal_obs is not None:
            return self._goal_obs[1].copy()
        return np.array([*(self.agent_start / WORKSPACE * 2.0 - 1.0), 0.0, 0.0], dtype=np.float32)

    def success(self) -> bool:
        if self.goal_state is not None:
            pos, angle = dino_wm_distance(self.state(), self.goal_state)
            return pos < SUCCESS_DIST_PX and angle < SUCCESS_ANGLE
        return pose_success(self.block_pose(), self.goal_pose)

    def goal_distance(self) -> float:
        """Both tolerances as one number: 1 on the edge of either, below 1 inside both."""
        if self.goal_state is not None:
            pos, angle = dino_wm_distance(self.state(), self.goal_state)
        else:
            pos = float(np.linalg.norm(self.block_pose()[:2] - self.goal_pose[:2]))
            angle = abs(wrap_angle(self.block_pose()[2] - self.goal_pose[2]))
        return max(pos / SUCCESS_DIST_PX, angle / SUCCESS_ANGLE) + 0.1 * (pos / SUCCESS_DIST_PX + angle / SUCCESS_ANGLE)

    def snapshot(self) -> tuple:
        a, b = self.env.agent, self.env.block
        return (tuple(a.position), tuple(a.velocity), tuple(b.position), b.angle, tuple(b.velocity), b.angular_velocity)

    def world_motion(self, before: tuple, after: tuple) -> float:
        """The block's displacement between two snapshots over the success tolerances (20 px, π/9), the larger of the two."""
        moved = float(np.hypot(after[2][0] - before[2][0], after[2][1] - before[2][1]))
        return max(moved / SUCCESS_DIST_PX, abs(wrap_angle(after[3] - before[3])) / SUCCESS_ANGLE)

    def state_vector(self, snap: tuple) -> np.ndarray:
        """[agent x, y, vx, vy, block x, y (workspaces, workspaces per second), cos θ, sin θ] of a snapshot."""
        (ax, ay), (avx, avy), (bx, by), angle = snap[:4]
        return np.array([*(np.array([ax, ay, avx, avy, bx, by]) / WORKSPACE), np.cos(angle), np.sin(angle)])

    def world_held(self, before: tuple, after: tuple) -> tuple:
        """`after`'s agent (position and velocity) with `before`'s block pose, the block at rest."""
        return (after[0], after[1], before[2], before[3], (0.0, 0.0), 0.0)

    def restore(self, snap: tuple) -> None:
        a_pos, a_vel, b_pos, b_angle, b_vel, b_angvel = snap
        self._place(self.env, np.array(a_pos), np.array([*b_pos, b_angle]))
        self.env.agent.velocity, self.env.block.velocity, self.env.block.angular_velocity = a_vel, b_vel, b_angvel

    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        target = pusher_target(
            np.array(self.env.agent.position),
            self.block_pose(),
            self.goal_pose,
            np.array(self.env.block.center_of_gravity),
        )
        action = target / WORKSPACE * 2.0 - 1.0 + noise * rng.standard_normal(2)
        return np.clip(action, -1.0, 1.0).astype(np.float32)

    def close(self) -> None:
        self.env.close()
        self._canvas.close()
