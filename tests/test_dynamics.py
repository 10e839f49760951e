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
from lensemble.dynamics import probe_r2, ridge_r2, rollout_diagnostics
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
