"""The built-in 2-D world, rendered with numpy: an agent moves towards a goal.

Fast and dependency-free, for unit tests and the CPU walking skeleton. Two embodiments share the
world but not the action space:

- `PointAgent`: action (vx, vy) ∈ [-1, 1]^2, a velocity command.
- `ThrusterAgent`: three thrusters at 90°, 210° and 330°, each pushing with a force in [0, 1]
  (normalized action a ∈ [-1, 1]^3 maps to (a + 1) / 2), so one displacement has many actions.

The frame shows the agent as a disk on a dark floor; the goal is not drawn, so the goal image is
the frame with the agent at the goal. Success: distance to the goal below `success_radius`.
"""
from __future__ import annotations

import numpy as np

from lensemble.sim.base import Embodiment

ARENA_LOW, ARENA_HIGH = 0.1, 0.9
THRUSTER_ANGLES = np.deg2rad(np.array([90.0, 210.0, 330.0]))
THRUSTER_DIRS_K2 = np.stack([np.cos(THRUSTER_ANGLES), np.sin(THRUSTER_ANGLES)], axis=1)  # [3, 2]


GLOW_SIGMA = 0.3


def render_disk(pos_xy: np.ndarray, image_size: int, radius: float, color: tuple[int, int, int]) -> np.ndarray:
    """A disk at `pos_xy` (unit square, y up) with an anti-aliased edge and a wide glow; [H, W, 3] uint8.

    The glow (a Gaussian of std GLOW_SIGMA lighting the floor) makes every pixel depend smoothly on
    the agent's position, so image distance grows with spatial distance across the whole arena and
    a tiny encoder trained for minutes can plan from far away.
    """
    centers = (np.arange(image_size) + 0.5) / image_size
    xx, yy = np.meshgrid(centers, 1.0 - centers)  # row 0 is the top of the image
    dist = np.sqrt((xx - pos_xy[0]) ** 2 + (yy - pos_xy[1]) ** 2)
    alpha = np.clip((radius - dist) * image_size + 0.5, 0.0, 1.0)[..., None]  # [H, W, 1]
    glow = np.exp(-0.5 * (dist / GLOW_SIGMA) ** 2)[..., None]
    floor = np.array([20.0, 24.0, 32.0]) + glow * np.array([60.0, 50.0, 90.0])
    frame = floor * (1.0 - alpha) + np.asarray(color, dtype=np.float64) * alpha
    return np.round(frame).astype(np.uint8)


class _GridAgent(Embodiment):
    """Shared dynamics: position integrates a displacement, clipped to the arena."""

    proprio_dim = 2
    proprio_scale = (0.25, 0.25)
    goal_proprio_weights = (1.0, 1.0)
    goal_visual_weight = 1.0
    state_components = (0, 1)
    success_criteria = {"position": "agent within 0.08 of the goal (unit arena)"}
    step_size = 0.1
    success_radius = 0.08
    radius = 0.14
    color = (240, 200, 60)

    def __init__(self, image_size: int = 32) -> None:
        super().__init__(image_size)
        self.pos = np.full(2, 0.5)
        self.goal = np.full(2, 0.5)

    def reset(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.pos = rng.uniform(ARENA_LOW, ARENA_HIGH, size=2)
        self.goal = rng.uniform(ARENA_LOW, ARENA_HIGH, size=2)

    def displacement(self, action_A: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def step(self, action_A: np.ndarray) -> None:
        action_A = np.clip(np.asarray(action_A, dtype=np.float64), -1.0, 1.0)
        self.pos = np.clip(self.pos + self.step_size * self.displacement(action_A), ARENA_LOW, ARENA_HIGH)

    def render(self) -> np.ndarray:
        return render_disk(self.pos, self.image_size, self.radius, self.color)

    def proprio(self) -> np.ndarray:
        return self.pos.astype(np.float32)

    def goal_frame(self) -> np.ndarray:
        return render_disk(self.goal, self.image_size, self.radius, self.color)

    def goal_proprio(self) -> np.ndarray:
        return self.goal.astype(np.float32)

    def goal_distance(self) -> float:
        return float(np.linalg.norm(self.pos - self.goal))

    def success(self) -> bool:
        return self.goal_distance() < self.success_radius

    def snapshot(self) -> np.ndarray:
        return self.pos.copy()

    def restore(self, snap: np.ndarray) -> None:
        self.pos = np.asarray(snap, dtype=np.float64).copy()

    def set_state(self, pos: np.ndarray, goal: np.ndarray) -> None:
        """Place agent and goal directly (tests and evaluation goals)."""
        self.pos = np.asarray(pos, dtype=np.float64).copy()
        self.goal = np.asarray(goal, dtype=np.float64).copy()

    def desired_direction(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        """Unit-capped direction to the goal plus Gaussian noise."""
        delta = (self.goal - self.pos) / self.step_size
        norm = np.linalg.norm(delta)
        if norm > 1.0:
            delta = delta / norm
        return delta + noise * rng.standard_normal(2)


class PointAgent(_GridAgent):
    """2-D velocity control."""

    name = "grid_point"
    action_dim = 2

    def displacement(self, action_A: np.ndarray) -> np.ndarray:
        return action_A

    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        return np.clip(self.desired_direction(rng, noise), -1.0, 1.0).astype(np.float32)


class ThrusterAgent(_GridAgent):
    """Three fixed thrusters; the net displacement is the sum of their pushes."""

    name = "grid_thruster"
    action_dim = 3
    color = (90, 210, 240)

    def displacement(self, action_A: np.ndarray) -> np.ndarray:
        force_K = (action_A + 1.0) / 2.0  # [3] in [0, 1]
        return force_K @ THRUSTER_DIRS_K2 * (2.0 / 1.5)  # max single-direction push ≈ 1

    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        want = self.desired_direction(rng, noise) * 1.5 / 2.0
        # Non-negative least squares over 3 thrusters: the two thrusters bracketing `want` fire.
        best = np.zeros(3)
        for i in range(3):
            for j in range(i + 1, 3):
                pair = THRUSTER_DIRS_K2[[i, j]].T  # [2, 2]
                sol = np.linalg.solve(pair, want)
                if (sol >= -1e-9).all():
                    best = np.zeros(3)
                    best[[i, j]] = np.clip(sol, 0.0, 1.0)
        return (best * 2.0 - 1.0).astype(np.float32)
