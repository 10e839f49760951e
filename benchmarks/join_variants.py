"""What a joining robot's success owes to each part of `lensemble join` (orchestration/joining.py): the
joined model as the command trains it, beside variants of it, against the from-scratch model.

    python benchmarks/join_variants.py SITE [--variant adapter|head-only|finetune] [--steps N] [--scratch-steps N]
        [--episodes E] [--params params.yaml]

- `adapter` (what `lensemble join` does): a new local action head and proprio adapter on the frozen
  federated encoder and predictor;
- `head-only`: the new action head alone, no adapter on any path (the joined model before the adapter);
- `finetune`: the federated model as the initialisation, every parameter trained.

`--steps` / `--scratch-steps`: the joined and the scratch model's steps (default: `join.steps` both);
`--episodes`: the site's episode count (default: its `join.sites` entry; its own store,
data/join/SITE-E/, is generated once). Needs models/federated.pt (`dvc repro`). Prints one JSON line:
successes of joined, scratch, oracle and random over the evaluation seeds, and the training figures.
Runs at the joining site's residency guard like the command; writes no report.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lensemble.config import JoinParams, load_params
from lensemble.model.world_model import WorldModel
from lensemble.paths import Layout
from orchestration import joining
from orchestration.join_sites import join_site
from tasks.data import generate_site

VARIANTS = ("adapter", "head-only", "finetune")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site")
    ap.add_argument("--variant", choices=VARIANTS, default="adapter")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--scratch-steps", type=int)
    ap.add_argument("--episodes", type=int)
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as in the command's worker process
    params = load_params(args.params)
    site = join_site(params, args.site)
    name = site.name if args.episodes is None else f"{site.name}-{args.episodes}"
    site = site.model_copy(update={"name": name, "episodes": args.episodes or site.episodes})
    params = params.model_copy(update={"join": JoinParams(sites=(site,), steps=params.join.steps)})
    layout = Layout(Path("."))
    if not (layout.join_episodes(name) / "episodes.parquet").is_file():
        generate_site.fn(params, name, site.embodiment, site.episodes, layout.join_episodes(name))

    steps = {"joined": args.steps or params.join.steps, "scratch": args.scratch_steps or params.join.steps}
    train, joined_model = joining.train, joining.joined_model
    joining.train = lambda model, p, emb, eps, _, key: train(model, p, emb, eps, steps[key.rsplit("/", 1)[1]], key)
    if args.variant == "head-only":
        WorldModel.predictor_for = lambda self, embodiment: self.predictor

        def joined_model_variant(p, lay, emb):
            model = joined_model(p, lay, emb)
            for n, w in model.named_parameters():
                w.requires_grad_(n.startswith(f"action_heads.{emb}."))
            return model
        joining.joined_model = joined_model_variant
    elif args.variant == "finetune":
        def joined_model_variant(p, lay, emb):
            model = joined_model(p, lay, emb)
            for w in model.parameters():
                w.requires_grad_(True)
            return model
        joining.joined_model = joined_model_variant

    t0 = time.perf_counter()
    r = joining.run_join(params, layout, name)
    m = r["metrics"]
    print(json.dumps({
        "site": name, "embodiment": r["embodiment"], "episodes": site.episodes, "variant": args.variant, "steps": steps,
        "evaluation_episodes": r["evaluation_episodes"], "successes": {a: v["wins"] for a, v in r["success"].items()},
        "proprio_loss": {k: round(m[f"eval/join/loss/proprio/{k}"], 4) for k in ("joined", "scratch")},
        "trained_parameters": {k: int(m[f"eval/join/trained_parameters/{k}"]) for k in ("joined", "scratch")},
        "fisher_p": round(r["joined_vs_scratch_p"], 3), "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
