"""A world model trained on the public probe episodes only: a starting point every site may share.

    python benchmarks/public_init.py ROOT OUT [--steps 300] [--threads 1]

ROOT is a project whose `prepare` stage has run. The model trains STEPS steps of the run's objective
(no anchor) on `data/probe/<embodiment>.parquet` of every embodiment, round-robin, from the run's seed,
and its state dict goes to OUT: set `model.warm_start: OUT` and Stage A, the federation's global model
and the local-only baselines all start from its encoder (lensemble/model/warm_start.py). The probe is
public by design (the anchor already sends its embeddings to every site), so no site's data is used.
Caveat: the evaluate stage's dynamics diagnostics read the same probe episodes as held-out data, so a run
warm-started from this checkpoint no longer has held-out diagnostics; a product start would need public
episodes of its own.

It prints the probe's effective dimension per embodiment and the share of its variance between the
embodiments' centroids, for the random initialisation and for the trained start: the federation's
round 0 averages the sites' first updates from this point (issue 14: round 0 reads 0.17x pooled from
a random start, where each robot's spread shrinks to 0.25-0.84 rms while the centroids stay put).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lensemble.config import load_params
from lensemble.errors import LensembleError
from lensemble.gauge import effective_dim, embodiment_spread, pool_tokens
from lensemble.paths import Layout
from lensemble.training import encode_frames, make_optimizer, train_steps
from lensemble.workflow import (
    build_model,
    embodiments,
    load_probe_episodes,
    probe_frames_labelled,
    sampler_for,
)


def spread_line(name: str, model, probe: torch.Tensor, labels: list[str]) -> str:
    z = pool_tokens(encode_frames(model, probe))
    s = embodiment_spread(z, labels)
    by = ", ".join(f"{e} {v:.1f} (rms {s['within_rms'][e]:.2f})" for e, v in s["by_embodiment"].items())
    return f"{name}: whole-probe RankMe {effective_dim(z)['rankme']:.2f}; per embodiment {by}; between-centroid share {s['between_fraction']:.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.steps < 1:
        sys.exit(f"--steps {args.steps}: give at least 1 training step")
    torch.set_num_threads(args.threads)
    try:
        params = load_params(args.root / "params.yaml")
        layout = Layout(args.root)
        probe, labels, _ = probe_frames_labelled(layout, params)
        samplers = [(e, sampler_for(load_probe_episodes(layout, params, e), params)) for e in embodiments(params)]
    except LensembleError as exc:
        sys.exit(f"{exc} (give a project root whose `dvc repro prepare` has run)")
    model = build_model(params, "centralized")
    print(spread_line("random init", model, probe, labels))
    t0 = time.perf_counter()
    log = train_steps(model, make_optimizer(model, params.train), samplers, args.steps, train=params.train, objective=params.objective,
                      run_seed=params.run.seed, round_idx=-2, data_key="public-probe")
    seconds = time.perf_counter() - t0
    print(spread_line(f"after {args.steps} steps on the public probe ({seconds:.1f} s, last-20 loss/pred {sum(log.pred[-20:]) / 20:.3f})",
                      model, probe, labels))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    torch.save(model.state_dict(), tmp)
    tmp.replace(args.out)
    print(f"wrote {args.out}: set model.warm_start to it")


if __name__ == "__main__":
    main()
