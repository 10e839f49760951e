"""What a perfect model would score on the dynamics diagnostics, and what the true state explains of the
pooled model's latent (lensemble/counterfactual.py), per embodiment of the default run.

    python benchmarks/latent_ceiling.py [params.yaml] [--model models/centralized.pt] [--data data]
        [--episodes 6] [--readout-steps 3000]

Reads what `dvc repro` wrote: the pooled model and the sites' episodes. Prints, per embodiment:
- the share of the horizon's motion the actions explain (true simulator, shuffled / copy), per step and
  over the horizon, in proprioception, pixels and the model's latent; the action sensitivity a model with
  the pooled model's measured real-action error would reach if its errors ignored the actions' effect;
- the held-out error of an MLP predicting the latent's one-step change from (z_t, q_t, a_t) and from
  (z_t, q_t, q_t+1) (the true next state), over copying, beside the pooled predictor's own 1-step figure;
- for a robot that pushes its world (PushT), the push capture (`lensemble.dynamics.push_capture`) an MLP reaches
  reading a push's latent change from the TRUE states: before the step with its action (the predictor's task, with
  the state it can only estimate given exactly), and before and after the step (the push's outcome given), fitted on
  `--push-episodes` episodes' pushes and read on the evaluate stage's push windows, beside the pooled model's own.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from lensemble.config import parse_params
from lensemble.counterfactual import counterfactual_windows, motion_share, push_readout_capture, state_readout_error
from lensemble.data.episodes import Episodes, read_episodes
from lensemble.data.windows import frames_to_tensor, proprio_features
from lensemble.dynamics import encode_episodes, push_capture, push_windows, push_windows_for, rollout_diagnostics
from lensemble.seeds import derive_seed
from lensemble.sim.registry import make_embodiment
from lensemble.workflow import build_model


def readout_sets(model, eps: Episodes, proprio_width: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Features [(E·(L−1)), F] per feature set and the latent's one-step change [(E·(L−1)), N·D]."""
    z_ELF = encode_episodes(model, eps.frames_ELHWC).flatten(2)
    q_ELQ = proprio_features(eps.proprio_ELP, eps.embodiment, proprio_width)[..., : eps.proprio_ELP.shape[-1]]
    a_ELK = torch.from_numpy(np.array(eps.actions_ELK))
    y = (z_ELF[:, 1:] - z_ELF[:, :-1]).flatten(0, 1)
    sets = {"z_t, q_t, a_t": (z_ELF[:, :-1], q_ELQ[:, :-1], a_ELK[:, :-1]), "z_t, q_t, q_t+1": (z_ELF[:, :-1], q_ELQ[:, :-1], q_ELQ[:, 1:])}
    return {name: (torch.cat(parts, -1).flatten(0, 1), y) for name, parts in sets.items()}


def push_sets(model, env, windows) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Readout features of push windows (true state before the step + its action; true states before and after) and
    each push's latent change z(true next frame) − z(pushed nothing), [W, N·D]."""
    before = np.stack([env.state_vector(b) for b, _ in windows.snapshots_W])
    after = np.stack([env.state_vector(a) for _, a in windows.snapshots_W])
    x = {"state_and_action": np.concatenate([before, windows.actions_WCK[:, -1]], 1), "states_before_and_after": np.concatenate([before, after], 1)}
    with torch.no_grad():
        z_true = encode_episodes(model, windows.next_frames_WHWC[:, None])[:, 0].flatten(1)
        z_held = encode_episodes(model, windows.held_frames_WHWC[:, None])[:, 0].flatten(1)
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in x.items()}, z_true - z_held


def push_ceiling(model, p, embodiment: str, episodes: int, steps: int) -> dict:
    """{} for an embodiment that pushes nothing; else the pooled model's push capture and an MLP's from the true states."""
    env = make_embodiment(embodiment, p.data.image_size)
    try:
        held = push_windows_for(env, p)
        if held is None:
            return {}
        d, c = p.data, p.evaluate.cem
        train = push_windows(env, derive_seed(p.run.seed, "push_readout"), c.context, d.episode_length, d.expert_noise, d.random_fraction,
                             d.segment_length, episodes=episodes)
        (x_tr, y_tr), (x_te, y_te) = push_sets(model, env, train), push_sets(model, env, held)
    finally:
        env.close()
    readout = {k: round(push_readout_capture(x_tr[k], y_tr, x_te[k], y_te, seed=p.run.seed, steps=steps), 3) for k in x_tr}
    return {"push_windows": {"train": len(y_tr), "held_out": len(y_te)},
            "pooled_push_capture": round(push_capture(model, held, p.model.proprio_dim)["push_capture"], 3),
            "push_capture_readout_from_true_states": readout}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("--model", default="models/centralized.pt")
    ap.add_argument("--data", default="data")
    ap.add_argument("--episodes", type=int, default=6, help="counterfactual episodes per embodiment")
    ap.add_argument("--readout-steps", type=int, default=3000)
    ap.add_argument("--push-episodes", type=int, default=160, help="episodes whose pushes train the push readout")
    args = ap.parse_args(argv)
    p = parse_params(yaml.safe_load(Path(args.params).read_text()))
    torch.set_num_threads(p.run.torch_threads)
    model = build_model(p, "centralized")
    model.load_state_dict(torch.load(args.model, map_location="cpu", weights_only=True))
    model.eval()
    c, d = p.evaluate.cem, p.data
    for site in p.data.sites:
        emb, t0 = site.embodiment, time.perf_counter()
        env = make_embodiment(emb, d.image_size)
        seeds = [derive_seed(p.run.seed, f"counterfactual/{emb}", participant=str(i)) % (2**32) for i in range(args.episodes)]
        cf = counterfactual_windows(env, seeds, d.episode_length, d.expert_noise, d.random_fraction, d.segment_length,
                                    c.context, c.horizon, perm_seed=p.run.seed)
        env.close()
        W, T = cf.real_frames_WTHWC.shape[:2]
        with torch.no_grad():
            z = encode_episodes(model, np.concatenate([cf.real_frames_WTHWC, cf.shuffled_frames_WTHWC, cf.copy_frames_WHWC[:, None]], 1))
        pixels = [frames_to_tensor(x) for x in (cf.shuffled_frames_WTHWC, cf.real_frames_WTHWC, cf.copy_frames_WHWC)]
        q = [proprio_features(x, emb, x.shape[-1]) for x in (cf.shuffled_proprio_WTP, cf.real_proprio_WTP, cf.copy_proprio_WP)]
        share = {"proprio": motion_share(*q), "pixels": motion_share(*pixels), "latent": motion_share(z[:, T : 2 * T], z[:, :T], z[:, 2 * T])}
        train = read_episodes(Path(args.data) / "sites" / site.name / "episodes.parquet", d.image_size)
        held = read_episodes(Path(args.data) / "probe" / f"{emb}.parquet", d.image_size)
        diag = rollout_diagnostics(model, held, c.context, c.horizon, p.model.proprio_dim, p.run.seed)
        r = float(np.mean(diag["rollout_vs_copy"]))
        tr, te = readout_sets(model, train, p.model.proprio_dim), readout_sets(model, held, p.model.proprio_dim)
        readout = {name: round(state_readout_error(*tr[name], *te[name], seed=p.run.seed, steps=args.readout_steps), 3) for name in tr}
        push = push_ceiling(model, p, emb, args.push_episodes, args.readout_steps)
        print(json.dumps({
            "embodiment": emb, "windows": W, "replay_error": cf.replay_error,
            "action_share": {k: {"per_step": [round(x, 3) for x in v[0]], "horizon": round(v[1], 3)} for k, v in share.items()},
            "pooled_rollout_vs_copy": [round(x, 3) for x in diag["rollout_vs_copy"]],
            "pooled_action_sensitivity": round(diag["action_sensitivity"], 3),
            "sensitivity_if_errors_ignored_actions": round((r + share["latent"][1]) / r, 2),
            "latent_change_readout_vs_copy": readout, **push, "seconds": round(time.perf_counter() - t0, 1),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
