"""Train one world model on pooled episodes (Stage A's loop) and read it: dynamics diagnostics, then
closed-loop success against the oracle and random actions, per embodiment.

    python benchmarks/world_model_check.py [params.yaml] [key=value ...] [--steps N] [--eval-episodes E] [--held-out K]
        [--held-out-random-fraction F] [--train-diagnostics] [--no-closed-loop] [--closed-loop-on EMB ...] [--no-baselines] [--cache DIR]
        [--save MODEL.pt | --load MODEL.pt]

`--held-out K`: held-out episodes per embodiment for the diagnostics (default: the params' probe episodes);
`--held-out-random-fraction F`: draw them with this share of random-action segments instead of the params'
`data.random_fraction` (to read models trained on different data mixes on one held-out set);
`--save`: write the trained model's state dict; `--load`: read one instead of training (the same params
and overrides, e.g. to try planner settings on one model); `--train-diagnostics`: also the rollout diagnostics on the first 8 training episodes (how much of the
held-out gap is overfitting).

Overrides are dotted params keys (e.g. data.image_size=48 objective.sigreg_on=centered_tokens).
For searching defaults and measuring what PushT needs; the pipeline's evaluate stage reports the same
figures for the pipeline's models.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import yaml

from lensemble.config import parse_params
from lensemble.data.episodes import generate_episodes, read_episodes, write_episodes
from lensemble.dynamics import dynamics_report, push_capture, push_windows_for, rollout_diagnostics
from lensemble.evaluation import ORACLE, evaluate, planning_energy
from lensemble.planning.cem import CEMConfig
from lensemble.seeds import generator
from lensemble.sim.registry import make_embodiment
from lensemble.training import make_optimizer, train_steps
from lensemble.workflow import build_model, eval_seeds, sampler_for


def override(raw: dict, assignment: str) -> None:
    key, value = assignment.split("=", 1)
    *path, last = key.split(".")
    node = raw
    for k in path:
        node = node[k]
    node[last] = yaml.safe_load(value)


def episodes(params, emb: str, namespace: str, count: int, cache: Path):
    d = params.data
    path = cache / f"{emb}-{namespace}-{count}-{d.image_size}-{d.episode_length}-{d.expert_noise}-{d.random_fraction}-{d.segment_length}-seed{params.run.seed}.parquet"
    if not path.is_file():
        env = make_embodiment(emb, d.image_size)
        write_episodes(generate_episodes(env, params.run.seed, namespace, count, d.episode_length, d.expert_noise,
                                         d.random_fraction, d.segment_length), path)
        env.close()
    return read_episodes(path, d.image_size)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-episodes", type=int, default=8)
    ap.add_argument("--cache", default="/tmp/lensemble-wm-check")
    ap.add_argument("--no-closed-loop", action="store_true")
    ap.add_argument("--held-out", type=int, default=None)
    ap.add_argument("--held-out-random-fraction", type=float, default=None)
    ap.add_argument("--train-diagnostics", action="store_true")
    ap.add_argument("--closed-loop-on", nargs="*", default=None, help="embodiments to plan in (default: all)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the oracle and random planners")
    ap.add_argument("--save", default=None, help="write the trained model's state dict here")
    ap.add_argument("--load", default=None, help="read a state dict saved by --save instead of training")
    args = ap.parse_args(argv)
    raw = yaml.safe_load(Path(args.params).read_text())
    for o in args.overrides:
        override(raw, o)
    p = parse_params(raw)
    held_p = p
    if args.held_out_random_fraction is not None:
        held_p = parse_params({**raw, "data": {**raw["data"], "random_fraction": args.held_out_random_fraction}})
    torch.set_num_threads(p.run.torch_threads)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train = {s.embodiment: episodes(p, s.embodiment, s.name, s.episodes, cache) for s in p.data.sites}
    held = {e: episodes(held_p, e, f"probe/{e}", args.held_out or p.data.probe_episodes, cache) for e in train}
    print(f"data {time.perf_counter() - t0:.1f}s", flush=True)
    model = build_model(p, "centralized")
    steps = args.steps or p.centralized.steps
    if args.load:
        model.load_state_dict(torch.load(args.load, map_location="cpu", weights_only=True))
        print(f"loaded {args.load}", flush=True)
    else:
        t0 = time.perf_counter()
        log = train_steps(model, make_optimizer(model, p.train), [(e, sampler_for(eps, p)) for e, eps in sorted(train.items())], steps,
                          train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=0, data_key="centralized", schedule=(0, steps))
        train_s = time.perf_counter() - t0
        tail = {k: sum(v[-50:]) / len(v[-50:]) for k, v in vars(log).items() if v}
        print(f"train {steps} steps {train_s:.1f}s ({train_s / steps * 1e3:.0f} ms/step); last-50 losses {tail}", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)
    c = p.evaluate.cem
    out = {}
    for emb in sorted(train):
        if args.train_diagnostics:
            first = dataclasses.replace(train[emb], frames_ELHWC=train[emb].frames_ELHWC[:8], actions_ELK=train[emb].actions_ELK[:8],
                                        proprio_ELP=train[emb].proprio_ELP[:8])
            seen = rollout_diagnostics(model, first, c.context, c.horizon, p.model.proprio_dim, p.run.seed)
            print(emb, "train", json.dumps({k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v]) for k, v in seen.items()}))
        diag = dynamics_report(model, train[emb], held[emb], c.context, c.horizon, p.model.proprio_dim, p.run.seed)
        env = make_embodiment(emb, p.data.image_size)
        pushes = push_windows_for(env, p)  # the evaluate stage's
        if pushes is not None:
            diag.update(push_capture(model, pushes, p.model.proprio_dim))
        env.close()
        out[emb] = diag
        print(emb, json.dumps({k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v]) for k, v in diag.items()}), flush=True)
    if args.no_closed_loop:
        return
    cfg = CEMConfig(c.samples, c.elites, c.iterations, c.horizon)
    for emb in sorted(args.closed_loop_on or train):
        env = make_embodiment(emb, p.data.image_size)
        if emb in p.evaluate.success:
            env.set_success_criterion(p.evaluate.success[emb])
        seeds = list(eval_seeds(p, emb))[: args.eval_episodes]
        row = {}
        agents = (("model", model),) if args.no_baselines else (("model", model), ("oracle", ORACLE), ("random", None))
        for name, agent in agents:
            t0 = time.perf_counter()
            r = evaluate(env, seeds, p.evaluate.max_steps, agent, cfg, generator(p.run.seed, f"cem/{name}"), c.execute_steps,
                         c.context, p.model.proprio_dim, planning_energy(env, p.evaluate.energy))
            row[name] = (r["success_rate"], round(r["plan_seconds"], 3), round(time.perf_counter() - t0, 1))
        print(emb, "success (rate, plan s, wall s):", row, flush=True)
        env.close()


if __name__ == "__main__":
    main(sys.argv[1:])
