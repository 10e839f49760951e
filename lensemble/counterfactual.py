"""Counterfactual windows in the true simulator: how much of a window's motion its actions explain, and
how much of a latent's change the true next state explains.

The dynamics targets (DESIGN.md; `lensemble.dynamics`) read a model's rollout error against copying the
last context observation, and its action sensitivity (the error with shuffled actions over the error with
the real ones). Neither says what a perfect model would score. This module measures it in the simulator:

- `motion_share`: E|x(shuffled actions) − x(real actions)|² / E|x(copy) − x(real actions)|², per step
  of the horizon, for x = proprioception, pixels, or any encoder's latent. A model whose real-action
  error is r × copy, with errors independent of the actions' effect, has an action sensitivity of about
  (r + share) / r: a target of 2 needs r ≤ share.
- `state_readout_error`: how well the latent's one-step change is predicted from the TRUE state (a small
  MLP fitted on training windows, read on held-out ones), over copying. A predictor cannot be expected to
  beat what the true next state explains; when this stays near 1 the representation, not the predictor,
  limits the rollout.

Shape legend: W windows, T horizon steps, P proprio components, K action dim, F features, Y targets.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lensemble.data.episodes import exploration_episode
from lensemble.dynamics import capture_shares
from lensemble.sim.base import Embodiment


@dataclass(frozen=True)
class CounterfactualWindows:
    """Each window's last context observation (the copy), its horizon under its own actions and under
    another window's, all simulated from the same saved state."""

    embodiment: str
    copy_frames_WHWC: np.ndarray  # [W, H, W, 3] uint8: the last context frame
    copy_proprio_WP: np.ndarray  # [W, P]
    real_frames_WTHWC: np.ndarray  # [W, T, H, W, 3] uint8
    real_proprio_WTP: np.ndarray  # [W, T, P]
    shuffled_frames_WTHWC: np.ndarray  # [W, T, H, W, 3] uint8
    shuffled_proprio_WTP: np.ndarray  # [W, T, P]
    replay_error: float  # max |replayed − recorded| proprio over the real branch: 0 up to float rounding


def _simulate(env: Embodiment, snap: object, actions_TK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    env.restore(snap)
    frames, proprio = [], []
    for a in actions_TK:
        env.step(a)
        frames.append(env.render())
        proprio.append(env.proprio())
    return np.stack(frames), np.stack(proprio)


def counterfactual_windows(env: Embodiment, seeds: Sequence[int], length: int, noise: float, random_fraction: float,
                           segment: int, context: int, horizon: int, perm_seed: int) -> CounterfactualWindows:
    """Exploration episodes as the sites record them (`exploration_episode`), cut into windows of
    `context` + `horizon` steps (stride `horizon`, as `dynamics.rollout_errors`); each window's horizon is
    simulated again from the state at its last context step, under its own actions and under those of the
    window a seeded permutation assigns it."""
    if context < 1 or horizon < 1 or context + horizon > length:
        raise ValueError(f"windows of {context} context + {horizon} horizon steps do not fit episodes of {length}")
    starts, actions = [], []  # (snapshot, recorded proprio [T, P]) and actions [T, K] per window
    for seed in seeds:
        snaps: list[object] = []
        _, acts_LK, prop_LP = exploration_episode(env, seed, length, noise, random_fraction, segment, snaps)
        for s in range(0, length - context - horizon + 1, horizon):
            k = s + context - 1  # the last context step: its action is the first the horizon's first frame depends on
            starts.append((snaps[k], prop_LP[k + 1 : k + 1 + horizon]))
            actions.append(acts_LK[k : k + horizon])
    if len(starts) < 2:
        raise ValueError(f"{len(starts)} window(s): shuffling actions needs at least 2; add seeds or lengthen episodes")
    perm = np.random.default_rng(perm_seed).permutation(len(starts))
    copy_f, copy_q, real_f, real_q, shuf_f, shuf_q = [], [], [], [], [], []
    replay = 0.0
    for w, (snap, recorded_TP) in enumerate(starts):
        env.restore(snap)
        copy_f.append(env.render())
        copy_q.append(env.proprio())
        f, q = _simulate(env, snap, actions[w])
        replay = max(replay, float(np.abs(q - recorded_TP).max()))
        real_f.append(f)
        real_q.append(q)
        f, q = _simulate(env, snap, actions[perm[w]])
        shuf_f.append(f)
        shuf_q.append(q)
    return CounterfactualWindows(env.name, np.stack(copy_f), np.stack(copy_q), np.stack(real_f), np.stack(real_q),
                                 np.stack(shuf_f), np.stack(shuf_q), replay)


def motion_share(shuffled_WT: torch.Tensor, real_WT: torch.Tensor, copy_W: torch.Tensor) -> tuple[list[float], float]:
    """(per horizon step, over all steps) E|shuffled − real|² / E|copy − real|²; inputs [W, T, ...] and the
    copy [W, ...] (broadcast over T). 0: the actions change nothing; 1: as much as the whole motion."""
    real_WT, shuffled_WT = real_WT.double(), shuffled_WT.double()
    copy_WT = copy_W.double()[:, None].expand_as(real_WT)
    dims = [0, *range(2, real_WT.dim())]
    num_T = (shuffled_WT - real_WT).square().mean(dim=dims)
    den_T = (copy_WT - real_WT).square().mean(dim=dims)
    if float(den_T.min()) <= 0.0:
        raise ValueError("nothing moves in these windows (copy error 0): the share is undefined")
    return [float(x) for x in num_T / den_T], float(num_T.mean() / den_T.mean())


def _readout_checkpoints(x_train_NF: torch.Tensor, y_train_NY: torch.Tensor, x_test_NF: torch.Tensor, seed: int, steps: int,
                         width: int, batch: int):
    """Fit a 2-hidden-layer GELU MLP f by AdamW on (x, y) (features standardised on train); yield f(x_test) [M, Y] every
    500 steps and at the last."""
    gen = torch.Generator().manual_seed(seed)
    mu, sd = x_train_NF.mean(0), x_train_NF.std(0) + 1e-6
    xt, xs = (x_train_NF - mu) / sd, (x_test_NF - mu) / sd
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(xt.shape[1], width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                            nn.Linear(width, y_train_NY.shape[1]))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    for step in range(steps):
        i = torch.randint(0, len(xt), (batch,), generator=gen)
        loss = (net(xt[i]) - y_train_NY[i]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 500 == 0 or step + 1 == steps:
            with torch.no_grad():
                yield net(xs)


def state_readout_error(x_train_NF: torch.Tensor, y_train_NY: torch.Tensor, x_test_NF: torch.Tensor, y_test_NY: torch.Tensor,
                        seed: int, steps: int = 3000, width: int = 256, batch: int = 128) -> float:
    """Held-out E|f(x) − y|² / E|y|² of a 2-hidden-layer GELU MLP f fitted by AdamW on (x, y) (features
    standardised on train), the lowest of its checkpoints every 500 steps: with y a latent's one-step
    change, the error of predicting it from x over the error of copying (predicting no change). The
    checkpoint is chosen on the held-out set, so the figure is optimistic: the safe side for a ceiling."""
    copy = float(y_test_NY.square().mean())
    return min(float((f - y_test_NY).square().mean()) / copy
               for f in _readout_checkpoints(x_train_NF, y_train_NY, x_test_NF, seed, steps, width, batch))


def push_readout_capture(x_train_NF: torch.Tensor, push_train_NY: torch.Tensor, x_test_NF: torch.Tensor, push_test_NY: torch.Tensor,
                         seed: int, steps: int = 3000, width: int = 256, batch: int = 128) -> float:
    """The push capture (`dynamics.capture_shares`, median over held-out windows) of the same MLP fitted to read a push's
    latent change y = z(true next frame) − z(pushed nothing) from x, the highest of its checkpoints (the safe side
    for a ceiling): how much of a push the latent lets any smooth function of x predict."""
    zero = torch.zeros_like(push_test_NY)
    return max(float(capture_shares(f, push_test_NY, zero).median())
               for f in _readout_checkpoints(x_train_NF, push_train_NY, x_test_NF, seed, steps, width, batch))
