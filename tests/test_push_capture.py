"""Push capture: how much of a push (a step that moves PushT's block) a world model's 1-step prediction carries.

Scored on known answers: the projection's closed form, the simulator windows themselves (the held frame is
the next step's agent with the previous step's block), and the untrained world model, which says nothing
moves, on windows planted so that "nothing moves" is exactly the pushed-nothing frame (0) or the true one (1).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lensemble.config import parse_params
from lensemble.dynamics import PUSH_MIN_MOTION, capture_shares, push_capture, push_windows
from lensemble.sim.gridworld import PointAgent
from lensemble.sim.pusht import SUCCESS_ANGLE, SUCCESS_DIST_PX, PushT
from lensemble.workflow import build_model

CONTEXT = 2


@pytest.fixture(scope="module")
def pusht():
    env = PushT(32)
    yield env
    env.close()


@pytest.fixture(scope="module")
def windows(pusht):
    return push_windows(pusht, seed=5, context=CONTEXT, length=24, noise=0.5, random_fraction=0.3, segment=8, episodes=6)


def test_capture_share_is_the_projection_on_the_push():
    gen = torch.Generator().manual_seed(0)
    held, true = torch.randn(5, 12, generator=gen), torch.randn(5, 12, generator=gen)
    push = true - held
    side = torch.randn(5, 12, generator=gen)
    side = side - (side * push).sum(1, keepdim=True) / push.square().sum(1, keepdim=True) * push  # orthogonal to the push
    torch.testing.assert_close(capture_shares(held, true, held), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(capture_shares(true, true, held), torch.ones(5, dtype=torch.float64))
    # half the push, plus an error across it (the agent mispredicted): still half
    torch.testing.assert_close(capture_shares(held + 0.5 * push + 3.0 * side, true, held), torch.full((5,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(capture_shares(held - push, true, held), torch.full((5,), -1.0, dtype=torch.float64))  # pushed the wrong way


def test_world_motion_reads_the_block_in_units_of_the_success_tolerance(pusht):
    before = ((100.0, 100.0), (0.0, 0.0), (200.0, 200.0), 0.3, (0.0, 0.0), 0.0)
    moved = ((120.0, 100.0), (5.0, 0.0), (210.0, 200.0), 0.3, (1.0, 0.0), 0.0)
    turned = ((100.0, 100.0), (0.0, 0.0), (200.0, 200.0), 0.3 + 2 * SUCCESS_ANGLE, (0.0, 0.0), 0.5)
    assert pusht.world_motion(before, before) == 0.0
    np.testing.assert_allclose(pusht.state_vector(moved), [120 / 512, 100 / 512, 5 / 512, 0.0, 210 / 512, 200 / 512, np.cos(0.3), np.sin(0.3)])
    assert pusht.world_motion(before, moved) == pytest.approx(10.0 / SUCCESS_DIST_PX)  # the agent's own motion does not count
    assert pusht.world_motion(before, turned) == pytest.approx(2.0)
    wrapped = ((100.0, 100.0), (0.0, 0.0), (200.0, 200.0), np.pi - 0.01, (0.0, 0.0), 0.0)
    across = ((100.0, 100.0), (0.0, 0.0), (200.0, 200.0), -np.pi + 0.01, (0.0, 0.0), 0.0)
    assert pusht.world_motion(wrapped, across) == pytest.approx(0.02 / SUCCESS_ANGLE)  # through ±π, not 2π − 0.02


def test_push_windows_are_pushes_and_their_held_frame_is_the_next_agent_with_the_previous_block(pusht, windows):
    W = len(windows.motion_W)
    assert W >= 10 and windows.motion_W.min() >= PUSH_MIN_MOTION and len(windows.snapshots_W) == W
    assert all(pusht.world_motion(b, a) == m for (b, a), m in zip(windows.snapshots_W, windows.motion_W))  # each window's own step
    assert windows.context_frames_WCHWC.shape == (W, CONTEXT, 32, 32, 3) and windows.actions_WCK.shape == (W, CONTEXT, 2)
    assert windows.next_frames_WHWC.shape == windows.held_frames_WHWC.shape == (W, 32, 32, 3)
    # the block moved, so every held frame differs from what the step showed
    assert all((windows.next_frames_WHWC[i] != windows.held_frames_WHWC[i]).any() for i in range(W))
    again = push_windows(pusht, seed=5, context=CONTEXT, length=24, noise=0.5, random_fraction=0.3, segment=8, episodes=6)
    assert np.array_equal(again.held_frames_WHWC, windows.held_frames_WHWC) and np.array_equal(again.motion_W, windows.motion_W)
    # world_held: the agent of `after` (position and velocity), the block of `before`, at rest
    pusht.reset(11)
    before = pusht.snapshot()
    for _ in range(3):
        pusht.step(np.array([0.0, 0.0]))
    after = pusht.snapshot()
    pusht.restore(pusht.world_held(before, after))
    assert np.allclose(pusht.proprio(), [after[0][0] / 256 - 1, after[0][1] / 256 - 1, after[1][0] / 512, after[1][1] / 512], atol=1e-6)
    np.testing.assert_allclose(pusht.block_pose(), [*before[2], before[3]])
    assert tuple(pusht.env.block.velocity) == (0.0, 0.0) and pusht.env.block.angular_velocity == 0.0


def test_a_model_that_says_nothing_moves_scores_zero_on_pushes_it_misses_and_one_where_nothing_moving_is_the_truth(windows):
    params = parse_params({"data": {"image_size": 32, "sites": [{"name": "a", "embodiment": "pusht", "episodes": 4}]},
                           "model": {"encoder": "nano8", "patch_size": 16, "predictor_width": 32, "predictor_heads": 2}})
    model = build_model(params, "centralized")  # zero-initialised outputs: predicts the last context frame's latent
    last = windows.context_frames_WCHWC[:, -1]
    blind = dataclasses.replace(windows, held_frames_WHWC=last)  # the push is all that happened: "nothing moves" misses it
    seen = dataclasses.replace(windows, next_frames_WHWC=last)  # nothing moved, and the held frame is another one
    assert push_capture(model, blind, params.model.proprio_dim) == {"push_capture": pytest.approx(0.0, abs=1e-9), "push_closer": 0.0}
    assert push_capture(model, seen, params.model.proprio_dim) == {"push_capture": pytest.approx(1.0, abs=1e-9), "push_closer": 1.0}


def test_an_embodiment_that_pushes_nothing_has_no_push_windows():
    env = PointAgent(image_size=8)
    assert not env.pushable
    with pytest.raises(ValueError, match="grid_point has no pushable world"):
        push_windows(env, seed=0, context=2, length=8, noise=0.3, random_fraction=0.5, segment=4)
    with pytest.raises(NotImplementedError, match="no pushable world"):
        env.world_held(None, None)
