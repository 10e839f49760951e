"""Embodiment names → adapters. Simulator packages are imported only when their adapter is made."""
from __future__ import annotations

import importlib

from lensemble.errors import ConfigError
from lensemble.sim.base import Embodiment

# name → (module, class, pip package that provides the simulator or None)
EMBODIMENTS: dict[str, tuple[str, str, str | None]] = {
    "grid_point": ("lensemble.sim.gridworld", "PointAgent", None),
    "grid_thruster": ("lensemble.sim.gridworld", "ThrusterAgent", None),
    "pusht": ("lensemble.sim.pusht", "PushT", "gym-pusht"),
    "mujoco_point": ("lensemble.sim.mujoco_envs", "MujocoPointMass", "mujoco"),
    "mujoco_reacher": ("lensemble.sim.mujoco_envs", "MujocoReacher", "mujoco"),
    "dmc_point_mass": ("lensemble.sim.dmc", "DmcPointMass", "dm-control"),  # suite point_mass-easy
    "dmc_reacher": ("lensemble.sim.dmc", "DmcReacher", "dm-control"),  # suite reacher-easy
}


def embodiment_class(name: str) -> type[Embodiment]:
    """The adapter class named `name` (its declared dims, scales and energy weights, no simulator built)."""
    if name not in EMBODIMENTS:
        raise ConfigError(f"unknown embodiment {name!r}; known: {sorted(EMBODIMENTS)}")
    module_name, cls_name, package = EMBODIMENTS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        hint = f"pip install {package}" if package else "reinstall lensemble"
        raise ConfigError(f"embodiment {name!r} needs {exc.name!r}: {hint}") from None
    return getattr(module, cls_name)


def make_embodiment(name: str, image_size: int) -> Embodiment:
    """Build the adapter named `name`; ConfigError if unknown or its simulator is not installed."""
    return embodiment_class(name)(image_size=image_size)
