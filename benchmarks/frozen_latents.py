"""What the frozen-encoder latent cache (`lensemble.training.FrozenLatents`) saves a training step, on the run's data.

    python benchmarks/frozen_latents.py [params.yaml] [--steps 200] [--repeats 3] [--threads N]

After `dvc repro prepare` (reads data/sites). A pooled model of the params trains past its encoder's freeze step,
then blocks of `--steps` frozen steps alternate with the cache and without it (`train_steps(reuse_frozen_latents=)`),
`--repeats` times each; prints the best ms a step of each, the cache's build seconds, and the matmul peak of this
machine measured in the same run. Then two fresh models train the same short schedule across the freeze step, one
with the cache and one without, and it prints whether every parameter and AdamW moment is the same bit for bit.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lensemble.config import load_params  # noqa: E402
from lensemble.federation.outer import state_hash  # noqa: E402
from lensemble.paths import Layout  # noqa: E402
from lensemble.perf import matmul_peak_gflops  # noqa: E402
from lensemble.training import FrozenLatents, encoder_learns, make_optimizer, set_trainable, train_steps  # noqa: E402
from lensemble.workflow import build_model, load_site, sampler_for, site_embodiment, site_names  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: run.torch_threads)")
    args = ap.parse_args(argv)
    p = load_params(args.params)
    torch.set_num_threads(args.threads or p.run.torch_threads)
    layout = Layout(Path(args.params).resolve().parent)
    samplers = [(site_embodiment(p, s), sampler_for(load_site(layout, p, s), p)) for s in site_names(p)]
    total = p.centralized.steps
    frozen_from = next(s for s in range(total + 1) if s == total or not encoder_learns(p.train, s, total))

    def train(model, opt, first: int, steps: int, reuse: bool) -> float:
        t0 = time.perf_counter()
        train_steps(model, opt, samplers, steps, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=-1,
                    data_key="pooled", schedule=(first, total), reuse_frozen_latents=reuse)
        return time.perf_counter() - t0

    model = build_model(p, "centralized")
    opt = make_optimizer(model, p.train)
    first = min(frozen_from, total - 2 * args.steps * args.repeats - 5)
    train(model, opt, first, 5, False)  # warm-up, and the encoder frozen from here on
    best = {True: float("inf"), False: float("inf")}
    for r in range(args.repeats):
        for reuse in (False, True):
            first += 5
            best[reuse] = min(best[reuse], train(model, opt, first, args.steps, reuse) / args.steps)
            first += args.steps - 5
    set_trainable(model.encoder, False)
    t0 = time.perf_counter()
    built = FrozenLatents.build(model.encoder, samplers, None, p.train.batch_size, 0, torch.device("cpu"), p.train.precision)
    build_s = time.perf_counter() - t0
    print(f"frozen step, {torch.get_num_threads()} threads: {best[False] * 1e3:.1f} ms encoding its frames, {best[True] * 1e3:.1f} ms "
          f"from the cache ({1 - best[True] / best[False]:.0%} less); cache build {build_s:.2f} s "
          f"({'exact' if built is not None else 'refused: bits differ'}); matmul peak {matmul_peak_gflops():.0f} GFLOP/s")
    hashes, passes = [], []
    frames = sum(s.num_frames for _, s in samplers)
    frozen_steps = 2 * frames // (p.train.batch_size * p.data.num_steps) + 10  # enough that the cache pays (FrozenLatents.pays)
    short = round(frozen_steps / (1 - p.train.freeze_encoder_at))  # learning, then frozen, in the run's proportion
    for reuse in (False, True):
        model = build_model(p, "centralized")
        opt = make_optimizer(model, p.train)
        calls = [0]
        model.encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        train_steps(model, opt, samplers, short, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=-1,
                    data_key="pooled", schedule=(0, short), reuse_frozen_latents=reuse)
        hashes.append(state_hash({**model.state_dict(), **{f"opt.{i}.{k}": v for i, s in enumerate(opt.state.values())
                                                             for k, v in s.items()}}))
        passes.append(calls[0])
    same = hashes[0] == hashes[1] and passes[1] < passes[0]
    print(f"{short} steps across the freeze, encoder passes {passes[0]} without the cache, {passes[1]} with it: "
          f"parameters and AdamW moments {'the same bit for bit' if hashes[0] == hashes[1] else 'DIFFER'} ({hashes[0][:12]})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
