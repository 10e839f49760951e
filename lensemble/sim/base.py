"""One interface for every embodiment's simulator.

An embodiment is a robot in its world: actions live in the normalized box [-1, 1]^action_dim
(each adapter maps them to its own physical units), frames are [H, W, 3] uint8 renders, and
`success()` is the task's own criterion. Episode generation, the window loader and the latent-MPC
evaluation only ever talk to this interface, so a new simulator is one adapter file.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Embodiment(ABC):
    """A simulator adapter. Subclasses set `name`, `action_dim`, `proprio_dim` and the goal energy's weights.

    `proprio_scale` divides each proprioception component so the model sees O(1) values (fixed by the
    embodiment, never estimated from a site's data). `goal_proprio_weights` and `goal_visual_weight`
    define the planning energy to a goal observation so that it measures what `success()` measures
    (e.g. the reacher's fingertip, not its whole arm pose; position, not velocity).
    """

    name: str = ""
    action_dim: int = 0
    proprio_dim: int = 0
    proprio_scale: tuple[float, ...] = ()
    goal_proprio_weights: tuple[float, ...] = ()
    goal_visual_weight: float = 1.0
    # how the planning energy is read over the horizon (lensemble.evaluation.ENERGY_OVER): "final", the last planned
    # step's (DINO-WM's, for tasks that must leave the goal to reach it, e.g. pushing); "mean", every step's (reaching tasks)
    goal_energy_over: str = "final"
    state_components: tuple[int, ...] = ()  # proprio components the embedding's linear probe must recover (position, fingertip)
    # name → what success() measures, with its tolerance (stated in reports); the first is the default
    success_criteria: dict[str, str] = {}
    # world state the frame alone shows (PushT's block, the MuJoCo target): what `world_probe_state` returns,
    # read by the world probe (`dynamics.world_probe_r2`); empty: nothing beyond proprioception
    world_probe_components: tuple[str, ...] = ()
    # the robot moves part of its world by contact (PushT's block): `world_motion` and `world_held` are defined, and
    # `dynamics.push_capture` reads how much of a push the predictor predicts; False: the world holds still
    pushable: bool = False

    def __init__(self, image_size: int = 64) -> None:
        self.image_size = int(image_size)
        self.criterion = next(iter(self.success_criteria), "")

    def set_success_criterion(self, name: str) -> None:
        """Judge evaluation episodes by the named criterion; ConfigError naming the known ones."""
        if name not in self.success_criteria:
            from lensemble.errors import ConfigError

            raise ConfigError(f"unknown success criterion {name!r} for {self.name}; known: {list(self.success_criteria)}")
        self.criterion = name

    def world_probe_state(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Put the simulator in a state drawn from `rng` (world and robot, at rest) and return the world state the
        frame shows beside proprioception, one array per name of `world_probe_components`. Diagnostics only:
        it draws from the simulator, never from a site's episodes. Call `reset` before an episode."""
        raise NotImplementedError(f"{self.name} has no world probe (world_probe_components is empty)")

    def world_motion(self, before: object, after: object) -> float:
        """How far the pushable world moved between two snapshots, in units of the success criterion's tolerance
        (1: as far as success tolerates). Only when `pushable`."""
        raise NotImplementedError(f"{self.name} has no pushable world (pushable is False)")

    def state_vector(self, snap: object) -> np.ndarray:
        """The true state of a snapshot as numbers, robot and pushable world (diagnostics: what a model could at best read
        a push from). Only when `pushable`."""
        raise NotImplementedError(f"{self.name} has no pushable world (pushable is False)")

    def world_held(self, before: object, after: object) -> object:
        """A snapshot with the robot as in `after` and the pushable world as in `before`, at rest: the state the step
        would have reached had it pushed nothing. Diagnostics only. Only when `pushable`."""
        raise NotImplementedError(f"{self.name} has no pushable world (pushable is False)")

    @abstractmethod
    def reset(self, seed: int) -> None:
        """Start an episode: a random start state and a random goal, both from `seed`."""

    @abstractmethod
    def step(self, action_A: np.ndarray) -> None:
        """Apply one normalized action (clipped to [-1, 1]) and advance the simulation."""

    @abstractmethod
    def render(self) -> np.ndarray:
        """The current frame, [image_size, image_size, 3] uint8."""

    @abstractmethod
    def proprio(self) -> np.ndarray:
        """Proprioception of the current state, float32 [proprio_dim]."""

    @abstractmethod
    def goal_frame(self) -> np.ndarray:
        """The frame the world shows when the current goal is reached, [H, W, 3] uint8."""

    @abstractmethod
    def success(self) -> bool:
        """Whether the current state satisfies the task's success criterion."""

    @abstractmethod
    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        """A scripted expert's normalized action towards the goal, with Gaussian `noise`."""

    @abstractmethod
    def goal_proprio(self) -> np.ndarray:
        """Proprioception the robot has in the goal observation, float32 [proprio_dim]."""

    @abstractmethod
    def goal_distance(self) -> float:
        """The success criterion's own distance to the goal (0 at the goal): the oracle planner's energy."""

    @abstractmethod
    def snapshot(self) -> object:
        """The full simulator state, restorable by `restore` (the oracle planner rolls the true simulator)."""

    @abstractmethod
    def restore(self, snap: object) -> None:
        """Return to a state taken by `snapshot`."""

    def reset_eval(self, seed: int) -> None:
        """Start an evaluation episode: the start state and goal of the embodiment's evaluation protocol."""
        self.reset(seed)

    def random_action(self, rng: np.random.Generator) -> np.ndarray:
        """A uniform action in the normalized box."""
        return rng.uniform(-1.0, 1.0, size=self.action_dim).astype(np.float32)

    def close(self) -> None:
        """Release simulator resources (renderers, physics spaces)."""
