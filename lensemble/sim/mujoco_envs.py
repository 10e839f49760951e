"""MuJoCo embodiments: a planar point mass (2-D force) and a planar 3-link reacher (3 torques).

Both worlds are MJCF strings in this file, rendered offscreen by `mujoco.Renderer` through a fixed
orthographic camera looking straight down, so one pixel is the same floor distance everywhere.
Headless machines render through EGL; without a GPU that is Mesa's llvmpipe software rasterizer
(Debian packages libegl1, libopengl0, libgl1-mesa-dri). Set MUJOCO_GL=osmesa or glfw before the
first import of mujoco to override. Shadows are off on purpose: on llvmpipe the shadow map costs
~35 ms a frame, the whole 64×64 frame without it 1–4 ms (4× MSAA included).

The target is drawn in every frame as a red disk. `goal_frame()` renders a second `MjData` placed
at the goal configuration, so asking for the goal image never perturbs the simulated episode.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from lensemble.errors import ConfigError
from lensemble.sim.base import Embodiment

# The GL backend is fixed when mujoco is first imported: if it was imported before this module,
# setting the variable here is too late (an unset one meant glfw, which needs a display).
if "mujoco" in sys.modules:
    _BACKEND = f"MUJOCO_GL={os.environ.get('MUJOCO_GL', 'unset, so glfw')} when mujoco was imported earlier"
else:
    _BACKEND = f"MUJOCO_GL={os.environ.get('MUJOCO_GL', 'egl')}"
os.environ.setdefault("MUJOCO_GL", "egl")


def gl_error(exc: BaseException) -> ConfigError:
    """A ConfigError naming the GL backend in use and the system packages it needs."""
    return ConfigError(
        f"MuJoCo offscreen rendering failed ({_BACKEND}): {exc}. Headless machines: export "
        "MUJOCO_GL=egl before anything imports mujoco and `apt-get install libegl1 libgl1-mesa-dri`, "
        "or MUJOCO_GL=osmesa with `apt-get install libosmesa6`"
    )


try:
    import mujoco
except ModuleNotFoundError:
    raise  # the registry turns this into "pip install mujoco"
except (ImportError, AttributeError, RuntimeError) as _exc:  # a GL backend failing to load
    raise gl_error(_exc) from _exc

# Shared visual settings: bright headlight instead of shadow-casting lights; 4× MSAA kept because
# anti-aliased edges make sub-pixel motion visible at 64×64; coarse tessellation (12 slices) is
# invisible on 3-pixel-wide links and cuts llvmpipe's reacher frame from ~4 to ~2.5 ms.
_VISUAL = """
  <visual>
    <quality shadowsize="0" offsamples="4" numslices="12" numstacks="6"/>
    <headlight ambient=".45 .45 .45" diffuse=".55 .55 .55" specular="0 0 0"/>
  </visual>
  <default><geom contype="0" conaffinity="0"/><site group="4"/></default>
"""

POINT_MASS_XML = f"""
<mujoco model="lensemble_point_mass">
  <option timestep="0.01" gravity="0 0 0"/>{_VISUAL}
  <worldbody>
    <camera name="top" pos="0 0 1" xyaxes="1 0 0 0 1 0" projection="orthographic" fovy="0.66"/>
    <geom name="floor" type="plane" size=".33 .33 .01" rgba=".12 .14 .2 1"/>
    <geom type="box" pos="0 .315 .01" size=".33 .015 .01" rgba=".6 .6 .65 1"/>
    <geom type="box" pos="0 -.315 .01" size=".33 .015 .01" rgba=".6 .6 .65 1"/>
    <geom type="box" pos=".315 0 .01" size=".015 .33 .01" rgba=".6 .6 .65 1"/>
    <geom type="box" pos="-.315 0 .01" size=".015 .33 .01" rgba=".6 .6 .65 1"/>
    <body name="target" mocap="true" pos="0 0 .001">
      <geom type="cylinder" size=".05 .001" rgba=".9 .15 .15 1"/>
    </body>
    <body name="mass" pos="0 0 .03">
      <joint name="x" type="slide" axis="1 0 0" damping="5" limited="true" range="-.26 .26"/>
      <joint name="y" type="slide" axis="0 1 0" damping="5" limited="true" range="-.26 .26"/>
      <geom type="sphere" size=".06" mass="1" rgba=".98 .82 .2 1"/>
      <site name="tip"/>
    </body>
  </worldbody>
  <actuator>
    <motor joint="x" gear="3" ctrllimited="true" ctrlrange="-1 1"/>
    <motor joint="y" gear="3" ctrllimited="true" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""

REACHER_XML = f"""
<mujoco model="lensemble_reacher3">
  <compiler angle="radian"/>
  <option timestep="0.01" gravity="0 0 0"/>{_VISUAL}
  <default><joint damping=".02" armature=".002"/></default>
  <worldbody>
    <camera name="top" pos="0 0 1" xyaxes="1 0 0 0 1 0" projection="orthographic" fovy="0.7"/>
    <geom name="floor" type="plane" size=".35 .35 .01" rgba=".12 .14 .2 1"/>
    <body name="target" mocap="true" pos="0 0 .001">
      <geom type="cylinder" size=".045 .001" rgba=".9 .15 .15 1"/>
    </body>
    <geom type="cylinder" pos="0 0 .005" size=".025 .005" rgba=".45 .45 .5 1"/>
    <body name="link0" pos="0 0 .02">
      <joint name="j0" type="hinge" axis="0 0 1"/>
      <geom type="capsule" fromto="0 0 0 .12 0 0" size=".026" rgba=".92 .92 .92 1"/>
      <body name="link1" pos=".12 0 0">
        <joint name="j1" type="hinge" axis="0 0 1" limited="true" range="-2.6 2.6"/>
        <geom type="capsule" fromto="0 0 0 .1 0 0" size=".024" rgba=".3 .65 1 1"/>
        <body name="link2" pos=".1 0 0">
          <joint name="j2" type="hinge" axis="0 0 1" limited="true" range="-2.6 2.6"/>
          <geom type="capsule" fromto="0 0 0 .08 0 0" size=".022" rgba=".3 .95 .5 1"/>
          <body name="finger" pos=".08 0 .005">
            <geom type="sphere" size=".045" rgba=".98 .82 .2 1"/>
            <site name="tip"/>
          </body>
        </body>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor joint="j0" gear=".12" ctrllimited="true" ctrlrange="-1 1"/>
    <motor joint="j1" gear=".06" ctrllimited="true" ctrlrange="-1 1"/>
    <motor joint="j2" gear=".03" ctrllimited="true" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""


def wrap_angle(a: np.ndarray) -> np.ndarray:
    """Angles mapped to [-π, π)."""
    return (np.asarray(a) + np.pi) % (2.0 * np.pi) - np.pi


def make_renderer(model: mujoco.MjModel, image_size: int) -> mujoco.Renderer:
    """An offscreen renderer, or a ConfigError saying which GL libraries or backend to install."""
    # The offscreen framebuffer must hold the frame; MJCF's default is 640×480.
    model.vis.global_.offwidth = max(int(model.vis.global_.offwidth), image_size)
    model.vis.global_.offheight = max(int(model.vis.global_.offheight), image_size)
    try:
        return mujoco.Renderer(model, image_size, image_size)
    except (ImportError, RuntimeError, AttributeError, mujoco.FatalError) as exc:  # GL failures
        raise gl_error(exc) from exc


class _MujocoEmbodiment(Embodiment):
    """Shared MuJoCo plumbing; subclasses give the XML, start/goal sampling, proprio and expert.

    The goal is a configuration `goal_qpos`; the target `goal_xy` is where it puts the `tip` site,
    so every goal is reachable and the goal frame is exact.
    """

    xml: str = ""
    # physics steps of 10 ms per env step: one action lasts 0.2 s (5 Hz control), so one step moves the
    # puck or the fingertip ~6 cm (~3 px at 32x32): motion the next frame shows, which a world model can
    # predict better than "nothing moves". At 50 ms a step moved ~1.5 cm, under a pixel.
    frame_skip = 20
    success_radius = 0.03

    def __init__(self, image_size: int = 64) -> None:
        super().__init__(image_size)
        self.model = mujoco.MjModel.from_xml_string(self.xml)
        self.data = mujoco.MjData(self.model)
        self._goal_data = mujoco.MjData(self.model)  # rendered by goal_frame, never stepped
        self._renderer = make_renderer(self.model, self.image_size)
        self._tip = self.model.site("tip").id
        self._target = int(self.model.body("target").mocapid[0])
        self.goal_qpos = np.zeros(self.model.nq)
        self.goal_xy = np.zeros(2)

    world_probe_components = ("target_xy",)

    def sample_start_and_goal(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(start qpos, goal qpos) drawn from `rng`."""
        raise NotImplementedError

    def world_probe_state(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """A start and a goal as `reset` draws them, at rest: the target's position (metres), drawn in the frame and in no
        proprioception component."""
        qpos, goal_qpos = self.sample_start_and_goal(rng)
        self.set_state(qpos, np.zeros(self.model.nv), goal_qpos)
        return {"target_xy": self.goal_xy.copy()}

    def reset(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        mujoco.mj_resetData(self.model, self.data)
        qpos, goal_qpos = self.sample_start_and_goal(rng)
        self.set_state(qpos, np.zeros(self.model.nv), goal_qpos)

    def set_state(self, qpos: np.ndarray, qvel: np.ndarray, goal_qpos: np.ndarray) -> None:
        """Place the body and the goal directly (reset, tests, evaluation goals)."""
        self.goal_qpos = np.asarray(goal_qpos, dtype=np.float64).copy()
        self._goal_data.qpos[:] = self.goal_qpos
        mujoco.mj_forward(self.model, self._goal_data)
        self.goal_xy = self._goal_data.site_xpos[self._tip, :2].copy()
        for data in (self.data, self._goal_data):
            data.mocap_pos[self._target, :2] = self.goal_xy
        mujoco.mj_forward(self.model, self._goal_data)  # again: the target body moved
        self.data.qpos[:] = qpos
        self.data.qvel[:] = qvel
        mujoco.mj_forward(self.model, self.data)

    def step(self, action_A: np.ndarray) -> None:
        action_A = np.asarray(action_A, dtype=np.float64)
        if action_A.shape != (self.action_dim,):
            raise ValueError(f"{self.name} takes actions of shape ({self.action_dim},), got {action_A.shape}")
        self.data.ctrl[:] = np.clip(action_A, -1.0, 1.0)
        mujoco.mj_step(self.model, self.data, nstep=self.frame_skip)
        # mj_step leaves positions-derived fields one substep stale; refresh them for render/success.
        mujoco.mj_forward(self.model, self.data)

    def goal_proprio(self) -> np.ndarray:
        return self._proprio(self._goal_data)

    def proprio(self) -> np.ndarray:
        return self._proprio(self.data)

    def _proprio(self, data: mujoco.MjData) -> np.ndarray:
        raise NotImplementedError

    def goal_distance(self) -> float:
        return self.distance_to_goal()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.data.qpos.copy(), self.data.qvel.copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        self.data.qpos[:], self.data.qvel[:] = snap
        self.data.ctrl[:] = 0.0
        mujoco.mj_forward(self.model, self.data)

    def _render(self, data: mujoco.MjData) -> np.ndarray:
        self._renderer.update_scene(data, camera="top")
        return self._renderer.render().copy()  # [H, W, 3] uint8

    def render(self) -> np.ndarray:
        return self._render(self.data)

    def goal_frame(self) -> np.ndarray:
        return self._render(self._goal_data)

    def tip_xy(self) -> np.ndarray:
        """World xy of the tip site (the mass centre, or the reacher's fingertip)."""
        return self.data.site_xpos[self._tip, :2].copy()

    def distance_to_goal(self) -> float:
        """Tip-to-target distance in metres."""
        return float(np.linalg.norm(self.tip_xy() - self.goal_xy))

    def success(self) -> bool:
        return self.distance_to_goal() < self.success_radius

    def close(self) -> None:
        self._renderer.close()


class MujocoPointMass(_MujocoEmbodiment):
    """A 1 kg puck on a damped plane; action = planar force (±3 N per axis). Goal: a position.

    proprio = [x, y, vx, vy] (metres, m/s). Damping gives a 0.2 s velocity time constant, so the
    puck carries momentum across ~4 env steps: the world model must learn dynamics, not teleports.
    The goal energy weighs position only (success is a position); the goal's velocity is zero anyway.
    The goal image adds nothing the goal proprioception lacks (the target is drawn in every frame of the
    episode), so its latent distance carries no weight, as for the reacher: with the frame latent
    spread to unit scale, a 0.1 weight let its prediction error steer the plan (federated model,
    16 episodes: 0.56 at 0.1, 0.63 at 0.01, 0.81 at 0).
    """

    name = "mujoco_point"
    action_dim = 2
    proprio_dim = 4
    proprio_scale = (0.15, 0.15, 0.2, 0.2)
    goal_proprio_weights = (1.0, 1.0, 0.0, 0.0)
    goal_visual_weight = 0.0
    goal_energy_over = "mean"  # a reaching task: arrive early and stay (see params.yaml evaluate.energy)
    state_components = (0, 1)
    success_criteria = {"position": "puck centre within 0.03 m of the target"}
    xml = POINT_MASS_XML
    success_radius = 0.03
    arena = 0.24  # start and goal are drawn inside [-arena, arena]^2, away from the joint limits

    def sample_start_and_goal(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        while True:  # a start already at the goal teaches nothing
            start, goal = rng.uniform(-self.arena, self.arena, size=(2, 2))
            if np.linalg.norm(start - goal) > 4 * self.success_radius:
                return start, goal

    def _proprio(self, data: mujoco.MjData) -> np.ndarray:
        return np.concatenate([data.qpos, data.qvel]).astype(np.float32)

    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        # PD on position: saturates beyond ~8 cm, damps the approach so it settles on the target.
        error = self.goal_xy - self.data.qpos
        action = 12.0 * error - 1.5 * self.data.qvel + noise * rng.standard_normal(2)
        return np.clip(action, -1.0, 1.0).astype(np.float32)


class MujocoReacher(_MujocoEmbodiment):
    """A planar 3-link arm (12, 10, 8 cm) with joint torques; goal: a fingertip position.

    The goal is drawn as a joint configuration and the target is its fingertip, so it is reachable
    and `goal_frame()` shows the exact arm pose. The base joint turns freely; the elbow and wrist
    stop at ±2.6 rad. proprio = [cos q, sin q, q̇] for the three joints, then the fingertip's (x, y)
    (the end-effector, metres). The goal energy weighs the fingertip, and the joint velocities a little
    (the goal is at rest): success needs the fingertip on the target, and the goal image's whole arm pose
    is one of many that put it there, so the joint angles do not count. With the fingertip alone the
    models' plans swing the arm through the target: their failed episodes pass within 3.1-5.7 cm of it
    (the pipeline's pooled model, 6 of 16) and swing on, where the oracle, planning on the true distance,
    stops. Weighing the velocities 0.02 (in the energy's units: the fingertip's distance over its
    `proprio_scale`, 0.2 at the success radius, against joint speeds in rad/s) has the plan arrive slowly.
    `benchmarks/plan_seeds.py --site site_c --models centralized,federated,local_only` on one run's
    models, CEM seeds 0,1,2, successes of 48 (pooled / federated / local-only), by velocity weight:
    0: 28 / 31 / 35; 0.01: 33 / 39 / 36; 0.02: 32 / 38 / 42; 0.03: 35 / 35 / 38; 0.1: 24 / 34 / 37;
    0.3: 14 / 20 / 21 (2026-12-07). The point mass gains nothing from it (0.05: 47 / 43 / 48 against
    48 / 45 / 48) and keeps position only.
    """

    name = "mujoco_reacher"
    action_dim = 3
    proprio_dim = 11
    proprio_scale = (1.0,) * 9 + (0.15, 0.15)
    goal_proprio_weights = (0.0,) * 6 + (0.02,) * 3 + (1.0, 1.0)  # cos q, sin q: 0; q̇: 0.02 (class docstring); fingertip: 1
    goal_visual_weight = 0.0
    goal_energy_over = "mean"  # a reaching task: arrive early and stay (see params.yaml evaluate.energy)
    state_components = (9, 10)
    success_criteria = {"fingertip": "fingertip within 0.03 m of the target"}
    xml = REACHER_XML
    success_radius = 0.03

    def sample_start_and_goal(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        while True:
            start, goal = (
                np.concatenate([rng.uniform(-np.pi, np.pi, 1), rng.uniform(-2.3, 2.3, 2)]) for _ in range(2)
            )
            self.set_state(start, np.zeros(3), goal)
            if self.distance_to_goal() > 4 * self.success_radius:
                return start, goal

    def _proprio(self, data: mujoco.MjData) -> np.ndarray:
        q, qd = data.qpos, data.qvel
        return np.concatenate([np.cos(q), np.sin(q), qd, data.site_xpos[self._tip, :2]]).astype(np.float32)

    def expert_action(self, rng: np.random.Generator, noise: float) -> np.ndarray:
        # Joint-space PD towards the goal configuration; the base joint takes the short way round.
        error = self.goal_qpos - self.data.qpos
        error[0] = wrap_angle(error[0])
        action = 3.0 * error - 0.4 * self.data.qvel + noise * rng.standard_normal(3)
        return np.clip(action, -1.0, 1.0).astype(np.float32)
