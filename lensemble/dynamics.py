"""Dynamics diagnostics: does the world model predict, use its actions, and see the state?

Computed on held-out episodes (the public probe set), before any success rate is read:
- `rollout_vs_copy`: error of the H-step rollout under the episode's real actions, over the error of
  "nothing moves" (copying the last context observation), per step 1..H, for the latent and for
  the proprioception. Below 1: better than copying.
- `action_sensitivity`: the same rollout error with the actions shuffled across windows, over the
  error with the real ones. A model that ignores its actions scores 1.
- `probe_r2`: R² of a ridge probe from a frame's embedding (all its tokens) to the embodiment's
  state components (`state_components`: position, fingertip), fitted on the site's training
  episodes and scored on the held-out ones.
- `world_probe_r2`: the same probe to the world state only the frame shows (`world_probe_components`:
  PushT's block position and angle, the MuJoCo target), on simulator states drawn for the purpose.
- `push_capture`: for a robot that pushes its world (PushT's block), how much of a push the 1-step
  prediction carries: on simulator windows whose step moves the block, the prediction's projection on
  the latent change from "the step pushed nothing" (the same next frame with the block held where it
  was) to the true next frame. 0: the predictor moves the agent through the block as if it were not
  there; 1: it predicts the push. A planner whose model scores near 0 knocks the block it must place.

Shape legend: E episodes, L steps, W windows, C context, H horizon, N tokens, D latent, Q proprio width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lensemble.config import Params
from lensemble.data.episodes import Episodes, exploration_episode
from lensemble.data.windows import frames_to_tensor, proprio_features
from lensemble.device import model_device, to_device
from lensemble.model.predictor import rollout
from lensemble.model.world_model import WorldModel
from lensemble.seeds import derive_seed
from lensemble.sim.base import Embodiment
from lensemble.sim.registry import embodiment_class

RIDGE_GRID = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)


@torch.no_grad()
def encode_episodes(model: WorldModel, frames_ELHWC: np.ndarray, batch: int = 256) -> torch.Tensor:
    """Embeddings of every frame, [E, L, N, D]."""
    E, L = frames_ELHWC.shape[:2]
    flat = frames_ELHWC.reshape(E * L, *frames_ELHWC.shape[2:])
    device = model_device(model)
    out = [model.encoder(to_device(frames_to_tensor(flat[i : i + batch]), device)[:, None])[:, 0].float().cpu() for i in range(0, E * L, batch)]
    return torch.cat(out).reshape(E, L, *out[0].shape[1:])  # fp32, on the CPU


def _windows(E: int, L: int, span: int, stride: int) -> list[tuple[int, int]]:
    return [(e, s) for e in range(E) for s in range(0, L - span + 1, stride)]


@torch.no_grad()
def rollout_errors(model: WorldModel, eps: Episodes, context: int, horizon: int, proprio_width: int,
                   shuffle_gen: torch.Generator | None = None, z_ELND: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Per-step squared errors [H] of the rollout (latent, proprio) and of the copy baseline.

    With `shuffle_gen`, each window's actions are replaced by another window's (a seeded permutation).
    `z_ELND`: the episodes' embeddings when the caller has them already.
    """
    model.eval()
    if z_ELND is None:
        z_ELND = encode_episodes(model, eps.frames_ELHWC)
    q_ELQ = proprio_features(eps.proprio_ELP, eps.embodiment, proprio_width)
    p = eps.proprio_ELP.shape[-1]
    span = context + horizon
    idx = _windows(*eps.frames_ELHWC.shape[:2], span, stride=max(1, horizon))
    e = torch.tensor([i for i, _ in idx])
    steps = torch.tensor([s for _, s in idx])[:, None] + torch.arange(span)[None]  # [W, C+H]
    z, q = z_ELND[e[:, None], steps], q_ELQ[e[:, None], steps]  # [W, C+H, N, D], [W, C+H, Q]
    a = torch.tensor(eps.actions_ELK)[e[:, None], steps[:, : span - 1]]  # [W, C+H-1, K]; a copy (the store is read-only)
    if shuffle_gen is not None:
        a = a[torch.randperm(a.shape[0], generator=shuffle_gen)]
    device = model_device(model)
    z_hat, q_hat = rollout(model.predictor_for(eps.embodiment), z[:, :context].to(device), q[:, :context].to(device),
                           model.action_heads[eps.embodiment](a.to(device)))
    z_hat, q_hat = z_hat.float().cpu(), q_hat.float().cpu()
    z_true, q_true = z[:, context:], q[:, context:, :p]
    z_copy, q_copy = z[:, context - 1 : context], q[:, context - 1 : context, :p]
    return {
        "latent": (z_hat - z_true).square().mean(dim=(0, 2, 3)).numpy(),
        "proprio": (q_hat[..., :p] - q_true).square().mean(dim=(0, 2)).numpy(),
        "latent_copy": (z_copy - z_true).square().mean(dim=(0, 2, 3)).numpy(),
        "proprio_copy": (q_copy - q_true).square().mean(dim=(0, 2)).numpy(),
    }


def rollout_diagnostics(model: WorldModel, eps: Episodes, context: int, horizon: int, proprio_width: int, seed: int,
                        z_ELND: torch.Tensor | None = None) -> dict:
    """rollout_vs_copy per step (latent and proprio) and action sensitivity (latent and proprio)."""
    if z_ELND is None:
        z_ELND = encode_episodes(model, eps.frames_ELHWC)
    real = rollout_errors(model, eps, context, horizon, proprio_width, z_ELND=z_ELND)
    shuffled = rollout_errors(model, eps, context, horizon, proprio_width, torch.Generator().manual_seed(seed), z_ELND)
    return {
        "rollout_vs_copy": [float(x) for x in real["latent"] / np.maximum(real["latent_copy"], 1e-12)],
        "rollout_vs_copy_proprio": [float(x) for x in real["proprio"] / np.maximum(real["proprio_copy"], 1e-12)],
        "action_sensitivity": float(shuffled["latent"].mean() / max(real["latent"].mean(), 1e-12)),
        "action_sensitivity_proprio": float(shuffled["proprio"].mean() / max(real["proprio"].mean(), 1e-12)),
    }


def ridge_r2(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """R² on the test set of a ridge regression (features standardised on train; λ picked on a held-out
    fifth of train from RIDGE_GRID), averaged over target components."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    xt, xs = (x_train - mu) / sd, (x_test - mu) / sd
    y_mu = y_train.mean(0)

    def fit(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
        # dual form when features outnumber rows: w = Xᵀ (X Xᵀ + λI)⁻¹ y
        if x.shape[1] > x.shape[0]:
            return x.T @ np.linalg.solve(x @ x.T + lam * np.eye(x.shape[0]), y)
        return np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ y)

    def r2(y: np.ndarray, y_hat: np.ndarray) -> float:
        ss_res = ((y - y_hat) ** 2).sum(0)
        ss_tot = ((y - y.mean(0)) ** 2).sum(0) + 1e-12
        return float((1.0 - ss_res / ss_tot).mean())

    n_val = max(1, len(xt) // 5)
    best = max(RIDGE_GRID, key=lambda lam: r2(y_train[-n_val:], xt[-n_val:] @ fit(xt[:-n_val], y_train[:-n_val] - y_mu, lam) + y_mu))
    w = fit(xt, y_train - y_mu, best)
    return r2(y_test, xs @ w + y_mu)


@torch.no_grad()
def probe_r2(model: WorldModel, train: Episodes, held_out: Episodes, max_train_frames: int = 1024,
             held_out_z: torch.Tensor | None = None) -> float:
    """Linear-probe R² of the embodiment's state components from a frame's flattened token embeddings."""
    comps = list(embodiment_class(train.embodiment).state_components)
    E, L = train.frames_ELHWC.shape[:2]
    stride = max(1, (E * L) // max_train_frames)
    flat_f = train.frames_ELHWC.reshape(E * L, *train.frames_ELHWC.shape[2:])[::stride]
    flat_p = train.proprio_ELP.reshape(E * L, -1)[::stride]
    x_train = encode_episodes(model, flat_f[None])[0].flatten(1).numpy().astype(np.float64)
    if held_out_z is None:
        held_out_z = encode_episodes(model, held_out.frames_ELHWC)
    x_test = held_out_z.flatten(0, 1).flatten(1).numpy().astype(np.float64)
    y_test = held_out.proprio_ELP.reshape(-1, held_out.proprio_ELP.shape[-1])[:, comps]
    return ridge_r2(x_train, flat_p[:, comps].astype(np.float64), x_test, y_test.astype(np.float64))


WORLD_PROBE_STATES = 800


def world_probe_set(env: Embodiment, seed: int, count: int = WORLD_PROBE_STATES) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`count` frames [P, H, W, 3] of simulator states drawn from `seed` and the world state each shows (name →
    [P, k]), for `world_probe_r2`; no frames and no names when the embodiment has no world probe."""
    if not env.world_probe_components:
        return np.zeros((0, env.image_size, env.image_size, 3), np.uint8), {}
    rng = np.random.default_rng(seed)
    frames, targets = [], {name: [] for name in env.world_probe_components}
    for _ in range(count):
        state = env.world_probe_state(rng)
        frames.append(env.render())
        for name in targets:
            targets[name].append(np.asarray(state[name], dtype=np.float64))
    return np.stack(frames), {name: np.stack(v) for name, v in targets.items()}


def world_probe_scores(z_PF: np.ndarray, targets: dict[str, np.ndarray]) -> dict[str, float]:
    """R² of a ridge probe from each state's features to each named world-state quantity: fitted on the first four
    fifths of the states, scored on the last fifth."""
    n = len(z_PF) * 4 // 5
    x = np.asarray(z_PF, dtype=np.float64)
    return {name: ridge_r2(x[:n], y[:n], x[n:], y[n:]) for name, y in targets.items()}


@torch.no_grad()
def world_probe_r2(model: WorldModel, frames_PHWC: np.ndarray, targets: dict[str, np.ndarray]) -> dict[str, float]:
    """Linear-probe R² of the world state the frame alone shows (PushT's block position and angle, the target) from the
    frame's embedding: the probe of `probe_r2` reads the robot's own state, this one what the planner's goal image
    must carry beside it. {} when there are no targets."""
    if not targets:
        return {}
    return world_probe_scores(encode_episodes(model, frames_PHWC[None])[0].flatten(1).numpy(), targets)


PUSH_EPISODES = 16
PUSH_MIN_MOTION = 0.25  # of the success tolerance: PushT 5 px or 5 degrees in one model step


@dataclass(frozen=True)
class PushWindows:
    """Simulator windows whose last step moved the pushable world (W of them), with what that step would have shown
    had it pushed nothing. Drawn from the simulator for diagnostics, never from a site's episodes."""

    embodiment: str
    context_frames_WCHWC: np.ndarray  # [W, C, H, W, 3] uint8
    context_proprio_WCP: np.ndarray  # [W, C, P]
    actions_WCK: np.ndarray  # [W, C, K]: the C − 1 between the context's frames, then the pushing step's
    next_frames_WHWC: np.ndarray  # [W, H, W, 3]: what the step showed
    held_frames_WHWC: np.ndarray  # [W, H, W, 3]: the same robot, the world where it was
    motion_W: np.ndarray  # [W] the world's motion over the success tolerance (`Embodiment.world_motion`)
    snapshots_W: tuple[tuple[object, object], ...]  # the simulator's state before and after each pushing step


def push_windows(env: Embodiment, seed: int, context: int, length: int, noise: float, random_fraction: float, segment: int,
                 episodes: int = PUSH_EPISODES, min_motion: float = PUSH_MIN_MOTION) -> PushWindows:
    """Every step of `episodes` exploration episodes (the training data's expert/random mix, seeded from `seed`) that moves
    the world by at least `min_motion` of the success tolerance, with its context. ValueError when `env` pushes nothing."""
    if not env.pushable:
        raise ValueError(f"{env.name} has no pushable world: push_capture does not apply")
    ctx_f, ctx_q, acts, nxt, held, motion, snapshots = [], [], [], [], [], [], []
    for e in range(episodes):
        snaps: list[object] = []
        frames, actions, proprio = exploration_episode(env, derive_seed(seed, "push_windows", participant=str(e)) % (2**32), length,
                                                       noise, random_fraction, segment, snaps)
        for t in range(context - 1, length - 1):
            m = env.world_motion(snaps[t], snaps[t + 1])
            if m < min_motion:
                continue
            env.restore(env.world_held(snaps[t], snaps[t + 1]))
            ctx_f.append(frames[t - context + 1 : t + 1])
            ctx_q.append(proprio[t - context + 1 : t + 1])
            acts.append(actions[t - context + 1 : t + 1])
            nxt.append(frames[t + 1])
            held.append(env.render())
            motion.append(m)
            snapshots.append((snaps[t], snaps[t + 1]))
    if not motion:
        raise ValueError(f"no step of {episodes} {env.name} episodes moved its world by {min_motion} of the tolerance")
    return PushWindows(env.name, np.stack(ctx_f), np.stack(ctx_q), np.stack(acts), np.stack(nxt), np.stack(held), np.asarray(motion),
                       tuple(snapshots))


def push_windows_for(env: Embodiment, params: Params) -> PushWindows | None:
    """The evaluate stage's push windows for `env`: the run's seed, the training data's mix, the planner's context; None when
    the embodiment pushes nothing."""
    if not env.pushable:
        return None
    d = params.data
    return push_windows(env, params.run.seed, params.evaluate.cem.context, d.episode_length, d.expert_noise, d.random_fraction,
                        d.segment_length)


def capture_shares(z_hat_WF: torch.Tensor, z_true_WF: torch.Tensor, z_held_WF: torch.Tensor) -> torch.Tensor:
    """Per window, the prediction's projection on the push: <ẑ − z_held, z_true − z_held> / |z_true − z_held|², [W].
    0 where ẑ is the held frame's latent (or differs from it only across the push), 1 where it is the true one."""
    push = (z_true_WF - z_held_WF).double()
    return ((z_hat_WF - z_held_WF).double() * push).sum(1) / push.square().sum(1).clamp_min(1e-12)


@torch.no_grad()
def push_capture(model: WorldModel, windows: PushWindows, proprio_width: int) -> dict[str, float]:
    """`push_capture` (median share of each push the 1-step prediction carries, `capture_shares`) and `push_closer` (share
    of windows whose prediction is nearer the true next latent than the pushed-nothing one)."""
    model.eval()
    device = model_device(model)

    def encode(frames_WTHWC: np.ndarray) -> torch.Tensor:
        return model.encoder(to_device(frames_to_tensor(frames_WTHWC), device)).float().cpu()  # [W, T, N, D]

    z_ctx = encode(windows.context_frames_WCHWC)  # [W, C, N, D]
    z_true, z_held = encode(windows.next_frames_WHWC[:, None])[:, 0], encode(windows.held_frames_WHWC[:, None])[:, 0]
    q = proprio_features(windows.context_proprio_WCP, windows.embodiment, proprio_width)
    act = model.action_heads[windows.embodiment](to_device(torch.from_numpy(windows.actions_WCK), device))
    z_hat, _ = rollout(model.predictor_for(windows.embodiment), z_ctx.to(device), q.to(device), act)  # [W, 1, N, D]
    z_hat = z_hat[:, 0].float().cpu().flatten(1)
    z_true, z_held = z_true.flatten(1), z_held.flatten(1)
    closer = (z_hat - z_true).square().sum(1) < (z_hat - z_held).square().sum(1)
    return {"push_capture": float(capture_shares(z_hat, z_true, z_held).median()), "push_closer": float(closer.double().mean())}


def dynamics_report(model: WorldModel, train: Episodes, held_out: Episodes, context: int, horizon: int, proprio_width: int,
                    seed: int) -> dict:
    """Every diagnostic of one model on one embodiment (the held-out frames encoded once)."""
    z_ELND = encode_episodes(model, held_out.frames_ELHWC)
    diag = rollout_diagnostics(model, held_out, context, horizon, proprio_width, seed, z_ELND)
    return {**diag, "probe_r2": probe_r2(model, train, held_out, held_out_z=z_ELND)}


ROUND_DYNAMICS = ("eval/rollout_vs_copy", "eval/rollout_vs_copy_last", "eval/rollout_vs_copy_proprio", "eval/action_sensitivity",
                  "eval/action_sensitivity_proprio", "eval/probe_r2")


def round_dynamics(params: Params, model, train_eps, held_out) -> dict[str, float]:
    """The dynamics diagnostics as scalar metrics (the site releases only these): 1-step and H-step rollout
    error over copying, action sensitivity and probe R²."""
    c = params.evaluate.cem
    d = dynamics_report(model, train_eps, held_out, c.context, c.horizon, params.model.proprio_dim, params.run.seed)
    values = (d["rollout_vs_copy"][0], d["rollout_vs_copy"][-1], d["rollout_vs_copy_proprio"][0], d["action_sensitivity"],
              d["action_sensitivity_proprio"], d["probe_r2"])
    return dict(zip(ROUND_DYNAMICS, values))
