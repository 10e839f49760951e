"""Dynamics diagnostics scored on planted models with known answers.

The planted world: grid_point episodes whose frames carry the agent's position in the RGB of pixel
(0, 0), read by a one-pixel "encoder" (z = 2p − 1, one token). A predictor that applies the grid's
true dynamics predicts exactly; one that copies its input ignores the actions.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lensemble.data.episodes import Episodes, generate_episodes
from lensemble.dynamics import probe_r2, ridge_r2, rollout_diagnostics, world_probe_r2, world_probe_scores, world_probe_set
from lensemble.model.predictor import KVCache
from lensemble.sim.gridworld import ARENA_HIGH, ARENA_LOW, PointAgent

Q = 4  # padded proprio width
STEP = PointAgent.step_size
SCALE = PointAgent.proprio_scale[0]


class PixelEncoder(nn.Module):
    """z = the RGB of pixel (0, 0) in [-1, 1]: one token of width 3."""

    def forward(self, frames_BTCHW: torch.Tensor) -> torch.Tensor:
        return frames_BTCHW[:, :, :, 0, 0][:, :, None]  # [B, T, 1, 3]


class PlantedPredictor(nn.Module):
    """The grid's true step on the latent (z = 2p − 1) and proprio (p / scale), or a copy when `copy`."""

    max_steps = 64

    def __init__(self, copy: bool) -> None:
        super().__init__()
        self.copy = copy

    def forward(self, z_BTND, q_BTQ, act_BTA, cache=None, return_cache=False):
        if self.copy:
            return z_BTND, q_BTQ, KVCache([], 0)
        p = ((z_BTND[..., :2] + 1) / 2 + STEP * act_BTA[:, :, None, :2]).clamp(ARENA_LOW, ARENA_HIGH)  # [B, T, 1, 2]
        z = torch.cat([2 * p - 1, z_BTND[..., 2:]], dim=-1)
        q = torch.cat([p[:, :, 0] / SCALE, q_BTQ[..., 2:]], dim=-1)
        return z, q, KVCache([], 0)


class Planted(nn.Module):
    def __init__(self, copy: bool = False, constant_encoder: bool = False) -> None:
        super().__init__()
        self.encoder = PixelEncoder()
        self.predictor = PlantedPredictor(copy)
        self.action_heads = nn.ModuleDict({"grid_point": nn.Identity()})
        self.constant = constant_encoder
        if constant_encoder:
            self.encoder = ConstantEncoder()

    def predictor_for(self, embodiment: str) -> nn.Module:
        return self.predictor  # as WorldModel's for an embodiment without a proprio adapter


class ConstantEncoder(nn.Module):
    def forward(self, frames_BTCHW: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*frames_BTCHW.shape[:2], 1, 3)


def planted_episodes(seed: int, count: int) -> Episodes:
    env = PointAgent(image_size=8)
    eps = generate_episodes(env, seed, "planted", count, 16, noise=0.3, random_fraction=0.5, segment=4)
    frames = eps.frames_ELHWC.copy()
    frames[:, :, 0, 0, :2] = np.round(eps.proprio_ELP * 255).astype(np.uint8)  # position in pixel (0, 0)
    frames[:, :, 0, 0, 2] = 0
    return Episodes(eps.embodiment, frames, eps.actions_ELK, eps.proprio_ELP)


def test_a_model_with_the_true_dynamics_beats_copying_and_needs_its_actions():
    diag = rollout_diagnostics(Planted(), planted_episodes(1, 6), context=2, horizon=4, proprio_width=Q, seed=0)
    assert max(diag["rollout_vs_copy"]) < 0.01  # only the pixel quantization (1/255) is left
    assert max(diag["rollout_vs_copy_proprio"]) < 0.01
    assert diag["action_sensitivity"] > 20 and diag["action_sensitivity_proprio"] > 20


def test_a_model_that_ignores_actions_scores_one_on_both():
    diag = rollout_diagnostics(Planted(copy=True), planted_episodes(2, 6), context=2, horizon=4, proprio_width=Q, seed=0)
    assert diag["rollout_vs_copy"] == pytest.approx([1.0] * 4)
    assert diag["action_sensitivity"] == pytest.approx(1.0) and diag["action_sensitivity_proprio"] == pytest.approx(1.0)


def test_probe_recovers_a_state_the_embedding_carries_and_not_one_it_does_not():
    train, held = planted_episodes(3, 8), planted_episodes(4, 4)
    assert probe_r2(Planted(), train, held) > 0.999
    assert probe_r2(Planted(constant_encoder=True), train, held) < 0.05


def test_ridge_r2_closed_form_on_a_linear_target():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 5))
    w = rng.standard_normal((5, 2))
    y = x @ w + 0.3
    assert ridge_r2(x[:150], y[:150], x[150:], y[150:]) > 0.999
    noise = rng.standard_normal((200, 2))
    assert ridge_r2(x[:150], noise[:150], x[150:], noise[150:]) < 0.1


def test_the_report_equals_its_parts_with_the_held_out_frames_encoded_once():
    from lensemble.dynamics import dynamics_report

    train, held = planted_episodes(5, 6), planted_episodes(6, 3)
    report = dynamics_report(Planted(), train, held, context=2, horizon=3, proprio_width=Q, seed=1)
    assert report == {**rollout_diagnostics(Planted(), held, 2, 3, Q, 1), "probe_r2": probe_r2(Planted(), train, held)}


def test_world_probe_scores_a_planted_linear_code_near_one_and_noise_near_zero():
    rng = np.random.default_rng(0)
    targets = {"block_xy": rng.uniform(0.2, 0.8, (400, 2)), "block_angle": rng.standard_normal((400, 2))}
    y = np.concatenate(list(targets.values()), axis=1)  # [400, 4]
    planted = np.concatenate([y @ rng.standard_normal((4, 12)), rng.standard_normal((400, 20))], axis=1) + 1e-3 * rng.standard_normal((400, 32))
    scores = world_probe_scores(planted, targets)
    assert scores["block_xy"] > 0.99 and scores["block_angle"] > 0.99
    noise = world_probe_scores(rng.standard_normal((400, 32)), targets)
    assert max(noise.values()) < 0.1


def _centroid(frames_PHWC: np.ndarray, rgb: tuple[int, int, int], tol: int) -> np.ndarray:
    """Centroid (x, y) and area of the pixels within `tol` of a colour: where the frame shows that object."""
    hit = np.abs(frames_PHWC.astype(int) - np.array(rgb)).max(-1) < tol  # [P, H, W]
    ys, xs = np.mgrid[: frames_PHWC.shape[1], : frames_PHWC.shape[2]]
    n = hit.sum((1, 2)).clip(1)
    return np.stack([(hit * xs).sum((1, 2)) / n, (hit * ys).sum((1, 2)) / n, n], axis=1)


def test_world_probe_states_are_the_simulators_own_and_the_frames_show_them():
    from lensemble.sim.mujoco_envs import MujocoPointMass
    from lensemble.sim.pusht import WORKSPACE, PushT

    pusht = PushT(64)
    frames, targets = world_probe_set(pusht, seed=3, count=300)
    assert frames.shape == (300, 64, 64, 3) and set(targets) == {"block_xy", "block_angle"}
    pose = pusht.block_pose()  # the last state drawn is the one the simulator holds
    np.testing.assert_allclose(targets["block_xy"][-1] * WORKSPACE, pose[:2], atol=1e-6)
    np.testing.assert_allclose(targets["block_angle"][-1], [np.cos(pose[2]), np.sin(pose[2])], atol=1e-6)
    again, same = world_probe_set(pusht, seed=3, count=300)
    assert np.array_equal(again, frames) and all(np.array_equal(same[k], targets[k]) for k in targets)  # seeded
    # the labels are what the frame shows: the block's grey pixels' centroid gives its position (measured R² 0.90 / 0.91 at
    # seeds 0 / 3), but not its angle linearly (0.03 / 0.13): a probe on an encoder must find the angle in its features
    assert world_probe_scores(_centroid(frames, (119, 136, 153), 20), targets)["block_xy"] > 0.8
    pusht.close()

    point = MujocoPointMass(64)
    frames, targets = world_probe_set(point, seed=3, count=300)
    np.testing.assert_allclose(targets["target_xy"][-1], point.goal_xy)
    assert np.abs(targets["target_xy"]).max() <= point.arena + 1e-9
    assert world_probe_scores(_centroid(frames, (230, 38, 38), 60), targets)["target_xy"] > 0.99  # the red target: 0.99997
    point.close()


def test_an_embodiment_without_world_state_beyond_proprio_has_no_world_probe():
    frames, targets = world_probe_set(PointAgent(image_size=8), seed=0)
    assert frames.shape[0] == 0 and targets == {}
    assert world_probe_r2(Planted(), frames, targets) == {}
    with pytest.raises(NotImplementedError, match="no world probe"):
        PointAgent(image_size=8).world_probe_state(np.random.default_rng(0))
