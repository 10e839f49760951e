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
    """A simulator adapter. Subclasses set `name`, `action_dim`, `proprio_dim`."""

    name: str = ""
    action_dim: int = 0
    proprio_dim: int = 0

    def __init__(self, image_size: int = 64) -> None:
        self.image_size = int(image_size)

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

    def random_action(self, rng: np.random.Generator) -> np.ndarray:
        """A uniform action in the normalized box."""
        return rng.uniform(-1.0, 1.0, size=self.action_dim).astype(np.float32)

    def close(self) -> None:
        """Release simulator resources (renderers, physics spaces)."""
