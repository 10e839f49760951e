"""Closed-loop success of the pipeline's own models over several CEM seeds: how much of a success-rate difference
between two runs is the planner's draw.

    python benchmarks/plan_seeds.py [params.yaml] --site site_c [--site ...] [--models centralized,federated]
        [--cem-seeds 0,1,2] [--execute-steps N] [--json OUT]

After `dvc repro`: each model (`orchestration.evaluation.MODEL_LOADERS`: centralized, federated, local_only, oracle,
random) plans the site's evaluation episodes once per CEM seed offset, with the run's CEM settings; offset 0 is the
evaluate stage's own draw, so its rates are `reports/eval.json`'s. Prints, per site and model, the rate at each offset,
their mean, and a 95% Wilson interval of all the episodes together (offsets × `evaluate.episodes`, not independent
episodes: the same starts and goals each time). `--execute-steps` replans after N executed actions instead of
`evaluate.cem.execute_steps`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lensemble.config import Params, load_params  # noqa: E402
from lensemble.errors import ConfigError, LensembleError  # noqa: E402
from lensemble.paths import Layout  # noqa: E402
from lensemble.stats import wilson_interval  # noqa: E402
from lensemble.workflow import site_embodiment, site_names  # noqa: E402
from orchestration.evaluation import MODEL_LOADERS, cem_generator, closed_loop, planning_env  # noqa: E402
from orchestration.workers import thread_split  # noqa: E402


def parse_list(text: str, convert=str) -> list:
    return [convert(x) for x in text.split(",") if x.strip()]


def plan_over_seeds(params: Params, layout: Layout, site: str, models: list[str], offsets: list[int],
                    execute_steps: int | None = None) -> dict[str, dict]:
    """Per model: success rate at each CEM seed offset, their mean, and the pooled count's Wilson interval."""
    unknown = [m for m in models if m not in MODEL_LOADERS]
    if unknown:
        raise ConfigError(f"unknown model {unknown[0]!r}; known: {', '.join(MODEL_LOADERS)}")
    if site not in site_names(params):
        raise ConfigError(f"unknown site {site!r}; params.yaml has {', '.join(site_names(params))}")
    if execute_steps is not None and not 1 <= execute_steps <= params.evaluate.cem.horizon:
        raise ConfigError(f"--execute-steps must be 1..evaluate.cem.horizon ({params.evaluate.cem.horizon}), got {execute_steps}")
    loaded = {m: MODEL_LOADERS[m](params, layout, site) for m in models}  # DataError before any episode
    torch.set_num_threads(thread_split(params.run.torch_threads, params.run.workers)[1])  # a site worker's threads, as evaluate plans
    embodiment = site_embodiment(params, site)
    env = planning_env(params, embodiment)
    out = {}
    try:
        for name, model in loaded.items():
            runs = [closed_loop(params, env, embodiment, model, cem_generator(params, name, site, k), execute_steps) for k in offsets]
            wins = sum(round(r["success_rate"] * r["episodes"]) for r in runs)
            n = int(sum(r["episodes"] for r in runs))
            low, high = wilson_interval(wins, n)
            out[name] = {"rates": [r["success_rate"] for r in runs], "mean": wins / n, "successes": wins, "episodes": n,
                         "ci_low": low, "ci_high": high}
    finally:
        env.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("params", nargs="?", default="params.yaml", type=Path)
    ap.add_argument("--site", action="append", required=True, help="site id from params.yaml (repeatable)")
    ap.add_argument("--models", default="centralized,federated", help="comma-separated: " + ", ".join(MODEL_LOADERS))
    ap.add_argument("--cem-seeds", default="0,1,2", help="comma-separated CEM seed offsets (0: the evaluate stage's)")
    ap.add_argument("--execute-steps", type=int, default=None, help="actions executed per plan (default evaluate.cem.execute_steps)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    try:
        params = load_params(args.params)
        try:
            offsets = parse_list(args.cem_seeds, int)
        except ValueError:
            raise ConfigError(f"--cem-seeds must be comma-separated integers, got {args.cem_seeds!r}") from None
        if not offsets:
            raise ConfigError("--cem-seeds names no offset")
        layout = Layout(args.params.resolve().parent)
        results = {}
        for site in args.site:
            results[site] = plan_over_seeds(params, layout, site, parse_list(args.models), offsets, args.execute_steps)
            for name, r in results[site].items():
                print(f"{site} {name}: {' / '.join(f'{x:.4g}' for x in r['rates'])} (CEM seeds {args.cem_seeds}); mean {r['mean']:.3f},"
                      f" {r['successes']}/{r['episodes']} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]", flush=True)
    except LensembleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
