"""PushT (gym-pusht): a disk agent pushes a T-shaped block onto a goal pose in a 512×512 workspace.

Action: a normalized target position for the agent, a ∈ [-1, 1]^2 ↦ (a + 1) / 2 · 512 px, which
the env's PD controller tracks for 10 physics substeps (one env step = 0.1 s). The frame is the
env's 512×512 drawing (white floor, green goal T, grey block, blue agent) reduced to
image_size×image_size by area averaging (cv2.INTER_AREA: an exact block mean when image_size
divides 512), not the env's own bilinear 96×96 resize, which aliases thin edges.

Goal: PushT's fixed pose (256, 256, π/4) unless `random_goal=True`, which draws the goal pose from
the reset seed (the env reads `goal_pose` for drawing and coverage, so overriding it is sound).
`success()` is the literature's criterion on the block's pose (origin within 20 px, angle within
π/9), computed from the physics state rather than the env's 95 %-coverage termination.

Pinned to gym-pusht 0.1.x: rendering uses its `_draw()` and the goal canvas its `_setup()`.
"""
from __future__ import annotations

import os

os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # pygame prints a banner on import

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import pygame  # noqa: E402
from gym_pusht.envs.pusht import PushTEnv  # noqa: E402

from lensemble.sim.base import Embodiment  # noqa: E402

WORKSPACE = 512.0  # px; the env's action space is [0, 512]^2
STANDARD_GOAL = np.array([256.0, 256.0, np.pi / 4])  # x, y, θ of the block's origin
GOAL_LOW, GOAL_HIGH = 140.0, 372.0  # random goals keep the whole T (≤ 121 px from its origin) inside
SUCCESS_DIST_PX, SUCCESS_ANGLE = 20.0, np.pi / 9
BLOCK_REACH = 95.0  # px from the block's centre of gravity that clears the T plus the agent's radius
ORBIT_STEP = 0.6  # rad the pusher walks round the block per step
PUSH_TURNS = np.deg2rad([0, 20, -20, 40, -40, 60, -60, 80, -80, 100, -100, 120, -120])


def wrap_angle(a: float) -> float:
    """An angle mapped to [-π, π)."""
    return float((a + np.pi) % (2.0 * np.pi) - np.pi)


def pose_success(block_pose: np.ndarray, goal_pose: np.ndarray) -> bool:
    """Block origin within 20 px of the goal and orientation within π/9 (T has no symmetry)."""
    close = np.linalg.norm(np.asarray(block_pose[:2]) - goal_pose[:2]) < SUCCESS_DIST_PX
    return bool(close and abs(wrap_angle(block_pose[2] - goal_pose[2])) < SUCCESS_ANGLE)


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

    def __init__(self, image_size: int = 64, random_goal: bool = False) -> None:
        super().__init__(image_size)
        self.random_goal = random_goal
        self.env = PushTEnv(obs_type="state", render_mode="rgb_array")
        self._canvas = PushTEnv(obs_type="state", render_mode="rgb_array")  # draws goal frames only
        self._canvas._setup()
        self.goal_pose = STANDARD_GOAL.copy()
        self.agent_start = np.full(2, WORKSPACE / 2)
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
        action_A = np.asarray(action_A, dtype=np.float64)
        if action_A.shape != (self.action_dim,):
            raise ValueError(f"{self.name} takes actions of shape ({self.action_dim},), got {action_A.shape}")
        self.env.step((np.clip(action_A, -1.0, 1.0) + 1.0) / 2.0 * WORKSPACE)

    def _frame(self, env: PushTEnv) -> np.ndarray:
        screen = env._draw()  # [512, 512] pygame surface, goal T included
        full = np.frombuffer(pygame.image.tobytes(screen, "RGB"), dtype=np.uint8)
        full = full.reshape(int(WORKSPACE), int(WORKSPACE), 3)  # [H, W, 3], row = workspace y
        size = (self.image_size, self.image_size)
        return cv2.resize(full, size, interpolation=cv2.INTER_AREA)  # [image_size, image_size, 3]

    def render(self) -> np.ndarray:
        return self._frame(self.env)

    def goal_frame(self) -> np.ndarray:
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

    def success(self) -> bool:
        return pose_success(self.block_pose(), self.goal_pose)

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
