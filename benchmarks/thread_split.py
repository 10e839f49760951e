"""Why `run.workers` splits the thread budget into single-threaded processes: training throughput of one
process with the whole budget against the same budget split into processes, on the project's own data.

    python benchmarks/thread_split.py [--steps 90] [--threads 2]

Prints, beside the fp32 matmul peak measured in the same run (one thread), the pooled training steps/s
of (a) one process with `threads` intra-op threads, (b) one process with 1 thread, (c) `threads`
single-threaded processes at once (their sum). Needs the default params' data (`dvc repro` or
`lensemble run prepare`).
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def steps_per_second(threads: int, steps: int) -> float:
    """Pooled Stage A steps/s of the default params' model on their data, with `threads` intra-op threads."""
    import torch

    from lensemble.config import load_params
    from lensemble.paths import Layout
    from lensemble.training import make_optimizer, train_steps
    from lensemble.workflow import build_model, load_site, sampler_for, site_embodiment, site_names

    torch.set_num_threads(threads)
    p, layout = load_params(ROOT / "params.yaml"), Layout(ROOT)
    model = build_model(p, "thread-split")
    samplers = [(site_embodiment(p, s), sampler_for(load_site(layout, p, s), p)) for s in site_names(p)]
    opt = make_optimizer(model, p.train)
    kw = dict(train=p.train, objective=p.objective, run_seed=0, round_idx=-1, data_key="pooled")
    train_steps(model, opt, samplers, 10, **kw)  # warm-up
    t0 = time.perf_counter()
    train_steps(model, opt, samplers, steps, **kw)
    return steps / (time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--threads", type=int, default=2)
    ns = parser.parse_args(argv)
    from lensemble.perf import matmul_peak_gflops, torch_threads

    with torch_threads(1):
        peak = matmul_peak_gflops()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        whole = pool.apply(steps_per_second, (ns.threads, ns.steps))
    with ctx.Pool(1) as pool:
        single = pool.apply(steps_per_second, (1, ns.steps))
    with ctx.Pool(ns.threads) as pool:
        split = pool.starmap(steps_per_second, [(1, ns.steps)] * ns.threads)
    print(f"matmul peak (fp32, 1 thread): {peak:.0f} GFLOP/s")
    print(f"one process, {ns.threads} threads: {whole:.1f} steps/s")
    print(f"one process, 1 thread:  {single:.1f} steps/s")
    print(f"{ns.threads} processes, 1 thread each: {sum(split):.1f} steps/s together ({', '.join(f'{s:.1f}' for s in split)})")
    print(f"split / whole: {sum(split) / whole:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
