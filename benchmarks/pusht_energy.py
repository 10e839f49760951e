"""Does PushT's planning energy see the block? The energy to the goal observation near each evaluation goal, when
the block or the agent is moved off the goal by the success tolerance (20 px, π/9) and twice it.

    python benchmarks/world_model_check.py params.yaml --no-closed-loop --save /tmp/pooled.pt
    python benchmarks/pusht_energy.py /tmp/pooled.pt [params.yaml] [--goals 16] [--draws 4]

Prints, per perturbation, the median visual and proprio terms of the planner's energy (`evaluation.goal_energy` at
one planned step, with PushT's `energy_weights`: visual weight 1 and agent-position weights), for the saved model, the same architecture untrained and the
pixels themselves. If the block's rows are far below the agent's, the planner cannot tell a displaced block from the
goal; if they are alike, a planner that still knocks the block away has a predictor that does not predict the push
(`eval/push_capture`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

from lensemble.config import parse_params
from lensemble.data.windows import frames_to_tensor, proprio_features
from lensemble.evaluation import energy_weights, goal_energy
from lensemble.sim.pusht import SUCCESS_ANGLE, SUCCESS_DIST_PX, PushT
from lensemble.workflow import build_model, eval_seeds

PERTURBATIONS = (("block", 1.0), ("block", 2.0), ("block turned", 1.0), ("block turned", 2.0), ("agent", 1.0), ("agent", 2.0))


def perturbed_states(env: PushT, seeds: list[int], draws: int, rng: np.random.Generator) -> tuple[dict, np.ndarray, np.ndarray]:
    """Per perturbation, `draws` frames and proprio around each seed's DINO-WM goal; the goal frames and proprio (repeated)."""
    out = {p: ([], []) for p in PERTURBATIONS}
    goal_f, goal_q = [], []
    for seed in seeds:
        env.reset_eval(seed)
        goal = env.goal_state.copy()
        for _ in range(draws):
            goal_f.append(env.goal_frame())
            goal_q.append(env.goal_proprio())
        for what, scale in PERTURBATIONS:
            for _ in range(draws):
                agent, block = goal[:2].copy(), goal[2:].copy()
                direction = rng.normal(size=2)
                direction /= np.linalg.norm(direction)
                if what == "agent":
                    agent += scale * SUCCESS_DIST_PX * direction
                elif what == "block":
                    block[:2] += scale * SUCCESS_DIST_PX * direction
                else:
                    block[2] += scale * SUCCESS_ANGLE * rng.choice([-1.0, 1.0])
                env.set_state(agent, block, env.goal_pose)
                out[(what, scale)][0].append(env.render())
                out[(what, scale)][1].append(env.proprio())
    return {k: (np.stack(f), np.stack(q)) for k, (f, q) in out.items()}, np.stack(goal_f), np.stack(goal_q)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a state dict written by benchmarks/world_model_check.py --save")
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("--goals", type=int, default=16, help="evaluation goals (the evaluate stage's PushT seeds)")
    ap.add_argument("--draws", type=int, default=4, help="perturbations of each kind per goal")
    args = ap.parse_args(argv)
    p = parse_params(yaml.safe_load(Path(args.params).read_text()))
    torch.set_num_threads(p.run.torch_threads)
    env = PushT(p.data.image_size)
    env.set_success_criterion("dino_wm")
    states, goal_f, goal_q = perturbed_states(env, list(eval_seeds(p, "pusht"))[: args.goals], args.draws, np.random.default_rng(0))
    env.close()
    visual_weight, proprio_weights = energy_weights(PushT, p.model.proprio_dim)
    trained = build_model(p, "centralized")
    trained.load_state_dict(torch.load(args.model, map_location="cpu", weights_only=True), strict=False)  # a PushT-only model has one head
    encoders = {"model": trained.encoder.eval(), "untrained": build_model(p, "centralized").encoder.eval(), "pixels": None}

    @torch.no_grad()
    def embed(name: str, frames: np.ndarray) -> torch.Tensor:
        x = frames_to_tensor(frames)
        return x.flatten(1)[:, None] if encoders[name] is None else encoders[name](x[:, None])[:, 0]  # [P, N, D]

    def terms(z_PND: torch.Tensor, q_PQ: torch.Tensor, z_goal_PND: torch.Tensor, q_goal_PQ: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The planner's own energy (`goal_energy`, one planned step) to each state's goal, its visual and proprio terms apart."""
        P, draws = len(z_PND), args.draws
        vis, prop = [], []
        for g in range(0, P, draws):  # one goal per `draws` consecutive states
            states = (z_PND[g : g + draws, None], q_PQ[g : g + draws, None])
            vis.append(goal_energy(z_goal_PND[g], q_goal_PQ[g], visual_weight, torch.zeros_like(proprio_weights))(states))
            prop.append(goal_energy(z_goal_PND[g], q_goal_PQ[g], 0.0, proprio_weights)(states))
        return torch.cat(vis).numpy(), torch.cat(prop).numpy()

    q_goal = proprio_features(goal_q, "pusht", p.model.proprio_dim)
    print(f"PushT energy to the goal, median over {args.goals} goals x {args.draws} draws (tolerance: {SUCCESS_DIST_PX:.0f} px, "
          f"{np.rad2deg(SUCCESS_ANGLE):.0f} deg)")
    print(f"{'moved off the goal':<26}" + "".join(f"{n + ' visual':>18}" for n in encoders) + f"{'proprio':>10}")
    for (what, scale), (frames, proprio) in states.items():
        q = proprio_features(proprio, "pusht", p.model.proprio_dim)
        rows = [terms(embed(n, frames), q, embed(n, goal_f), q_goal) for n in encoders]
        label = f"{what} {scale:g}x tolerance"
        print(f"{label:<26}" + "".join(f"{np.median(vis):>18.4f}" for vis, _ in rows) + f"{np.median(rows[0][1]):>10.4f}")

if __name__ == "__main__":
    main(sys.argv[1:])
