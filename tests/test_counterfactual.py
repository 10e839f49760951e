"""The counterfactual ceiling (lensemble/counterfactual.py): the motion share's closed forms, windows that
replay the recorded episode, a planted world whose actions change nothing, and the state readout on a
planted smooth function and on noise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lensemble.counterfactual import counterfactual_windows, motion_share, push_readout_capture, state_readout_error
from lensemble.data.episodes import exploration_episode
from lensemble.sim.gridworld import PointAgent
from lensemble.sim.registry import make_embodiment


class DriftAgent(PointAgent):
    """A planted world: the agent drifts at a fixed velocity whatever the action."""

    def displacement(self, action_A: np.ndarray) -> np.ndarray:
        return np.array([0.05, -0.03])


def test_motion_share_closed_forms():
    gen = torch.Generator().manual_seed(0)
    copy_W = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    real_WT = copy_W[:, None] + torch.randn(7, 4, 3, generator=gen, dtype=torch.float64)
    assert motion_share(real_WT.clone(), real_WT, copy_W) == ([0.0] * 4, 0.0)
    per, whole = motion_share(copy_W[:, None].expand_as(real_WT), real_WT, copy_W)
    assert per == pytest.approx([1.0] * 4, abs=1e-12) and whole == pytest.approx(1.0, abs=1e-12)
    # halfway between the real outcome and the copy: a quarter of the squared motion
    per, whole = motion_share(real_WT + 0.5 * (copy_W[:, None] - real_WT), real_WT, copy_W)
    assert per == pytest.approx([0.25] * 4, abs=1e-12) and whole == pytest.approx(0.25, abs=1e-12)
    with pytest.raises(ValueError, match="nothing moves"):
        motion_share(real_WT, copy_W[:, None].expand_as(real_WT), copy_W)


def test_snapshots_leave_the_episode_unchanged():
    env = PointAgent(16)
    plain = exploration_episode(env, 5, 12, 0.3, 0.5, 4)
    snaps: list[object] = []
    recorded = exploration_episode(env, 5, 12, 0.3, 0.5, 4, snaps)
    assert len(snaps) == 12
    for a, b in zip(plain, recorded):
        assert np.array_equal(a, b)
    env.restore(snaps[3])
    assert np.array_equal(env.render(), recorded[0][3])


def test_windows_replay_the_recorded_episode_and_shuffle_actions():
    env = PointAgent(16)
    cf = counterfactual_windows(env, [1, 2, 3], length=14, noise=0.3, random_fraction=0.5, segment=4, context=2, horizon=4, perm_seed=0)
    # windows start at 0, 4, 8 (2 + 4 steps fit up to 14): three an episode
    assert cf.real_frames_WTHWC.shape == (9, 4, 16, 16, 3) and cf.copy_proprio_WP.shape == (9, 2)
    assert cf.replay_error < 1e-6
    frames, _, proprio = exploration_episode(env, 2, 14, 0.3, 0.5, 4)
    # episode 2's second window (start 4): the copy is step 5, its horizon steps 6..9
    assert np.array_equal(cf.copy_frames_WHWC[4], frames[5])
    assert np.array_equal(cf.real_frames_WTHWC[4], frames[6:10])
    assert np.allclose(cf.real_proprio_WTP[4], proprio[6:10], atol=1e-6)
    share = motion_share(*(torch.from_numpy(x) for x in (cf.shuffled_proprio_WTP, cf.real_proprio_WTP, cf.copy_proprio_WP)))
    assert share[1] > 0.3  # velocity control: the actions are the motion


def test_a_world_whose_actions_change_nothing_has_share_zero():
    cf = counterfactual_windows(DriftAgent(16), [4, 5], length=10, noise=0.3, random_fraction=0.5, segment=4, context=2, horizon=3,
                                perm_seed=1)
    q = [torch.from_numpy(x) for x in (cf.shuffled_proprio_WTP, cf.real_proprio_WTP, cf.copy_proprio_WP)]
    per, whole = motion_share(*q)
    assert whole == 0.0 and per == [0.0] * 3
    assert np.array_equal(cf.shuffled_frames_WTHWC, cf.real_frames_WTHWC)


def test_windows_reject_bad_shapes():
    with pytest.raises(ValueError, match="do not fit"):
        counterfactual_windows(PointAgent(16), [1], length=5, noise=0.3, random_fraction=0.5, segment=4, context=2, horizon=4, perm_seed=0)
    with pytest.raises(ValueError, match="at least 2"):
        counterfactual_windows(PointAgent(16), [1], length=6, noise=0.3, random_fraction=0.5, segment=4, context=2, horizon=4, perm_seed=0)


def test_mujoco_point_mass_restores_its_state_and_its_actions_move_it():
    env = make_embodiment("mujoco_point", 32)
    cf = counterfactual_windows(env, [7, 8], length=14, noise=0.5, random_fraction=0.3, segment=8, context=2, horizon=4, perm_seed=0)
    env.close()
    assert cf.replay_error < 1e-4  # restore + the recorded (float32) actions land where the episode went
    _, share = motion_share(*(torch.from_numpy(x) for x in (cf.shuffled_proprio_WTP, cf.real_proprio_WTP, cf.copy_proprio_WP)))
    assert share > 0.3


def test_state_readout_error_reads_a_smooth_function_and_not_noise():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1500, 4, generator=gen)
    smooth = torch.stack([torch.sin(x[:, 0]), x[:, 1] * x[:, 2]], 1)
    assert state_readout_error(x[:1000], smooth[:1000], x[1000:], smooth[1000:], seed=0, steps=1000, width=64) < 0.15
    noise = torch.randn(1500, 2, generator=gen)
    assert state_readout_error(x[:1000], noise[:1000], x[1000:], noise[1000:], seed=0, steps=500, width=64) > 0.9


def test_push_readout_capture_reads_a_push_that_is_a_smooth_function_of_the_state_and_not_one_that_is_noise():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1200, 4, generator=gen)
    smooth = torch.stack([torch.sin(x[:, 0]) + x[:, 1], x[:, 2] * x[:, 3], torch.cos(x[:, 1]) - 1.0], dim=1)  # [1200, 3]
    noise = torch.randn(1200, 3, generator=gen)
    assert push_readout_capture(x[:1000], smooth[:1000], x[1000:], smooth[1000:], seed=0, steps=1000, width=64) > 0.85
    assert abs(push_readout_capture(x[:1000], noise[:1000], x[1000:], noise[1000:], seed=0, steps=500, width=64)) < 0.15
