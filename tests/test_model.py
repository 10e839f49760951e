"""Predictor: block-causal over time, rollout consistent with teacher forcing, prediction loss closed form."""
from __future__ import annotations

import torch

from lensemble.model.predictor import Predictor, block_causal_mask, rollout
from lensemble.objectives.losses import prediction_loss


def _predictor() -> Predictor:
    torch.manual_seed(0)
    return Predictor(latent_dim=16, num_tokens=4, action_embed=8, width=32, depth=2, heads=4).eval()


def test_block_causal_mask_lets_a_step_see_itself_and_the_past_only():
    m = block_causal_mask(3, 2)
    expected = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)


@torch.no_grad()
def test_future_frames_and_actions_do_not_change_earlier_predictions():
    g = _predictor()
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(2, 5, 4, 16, generator=gen)
    a = torch.randn(2, 5, 8, generator=gen)
    out = g(z, a)
    z2, a2 = z.clone(), a.clone()
    z2[:, 3:] += 10.0
    a2[:, 3:] -= 5.0
    out2 = g(z2, a2)
    assert torch.allclose(out[:, :3], out2[:, :3], atol=1e-5)
    assert not torch.allclose(out[:, 3:], out2[:, 3:], atol=1e-3)


@torch.no_grad()
def test_rollout_equals_teacher_forcing_on_its_own_predictions():
    g = _predictor()
    gen = torch.Generator().manual_seed(2)
    z0 = torch.randn(3, 4, 16, generator=gen)
    a = torch.randn(3, 4, 8, generator=gen)
    preds = rollout(g, z0, a)  # ẑ_1..ẑ_4
    history = torch.cat([z0[:, None], preds[:, :-1]], dim=1)  # z_0, ẑ_1..ẑ_3
    assert torch.allclose(g(history, a), preds, atol=1e-5)


def test_prediction_loss_without_rollout_is_the_teacher_forced_mse():
    g = _predictor()
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 4, 4, 16, generator=gen)
    a = torch.randn(2, 4, 8, generator=gen)
    expected = (g(z[:, :-1], a[:, :-1]) - z[:, 1:]).square().mean()
    assert torch.allclose(prediction_loss(g, z, a, rollout_steps=0), expected)
    with_rollout = prediction_loss(g, z, a, rollout_steps=2)
    roll = rollout(g, z[:, 0], a[:, :2])
    assert torch.allclose(with_rollout, expected + (roll - z[:, 1:3]).square().mean(), atol=1e-6)
