"""What the garbage collector costs a Lensemble process, with and without its long-lived heap frozen (orchestration/heap.py).

    python benchmarks/gc_cost.py [--repeats 3] [--steps 200]

Training: `--steps` pooled training steps of the default params on the sites' episodes (after `dvc repro`) in a process
that holds what a stage imports, the time its collections took (gc.callbacks) beside the steps' own time, with the
heap as imported and frozen after the imports.

Exit: how long a process takes to exit, with and without the interpreter's last collection, beside the floor:
`os._exit`, which skips every handler and all teardown.

Each case is a fresh process that imports what a stage imports (`flows.federate`, `flows.evaluate`: torch,
Prefect, MLflow, the simulators) and builds the default params' model; the figure is the median wall time from
its last statement to its end as its parent sees it. A pool's close (two site workers after one call each) is
timed the same way, as the coordinator's stage pays it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE = ("import flows.federate, flows.evaluate\n"
         "from lensemble.config import load_params\nfrom lensemble.workflow import build_model\n"
         f"model = build_model(load_params({str(REPO / 'params.yaml')!r}), 'federated')\n")
ENDINGS = {
    "plain exit": "",
    "skip_final_collection": "from orchestration.heap import skip_final_collection\nskip_final_collection()\n",
    "floor (os._exit)": None,
}
POOL = ("import time\nfrom orchestration.workers import WorkerPool\nimport os\n"
        "if __name__ == '__main__':\n"
        "    pool = WorkerPool(2, 1, ('orchestration.site_work',))\n"
        "    pool.wait_ready()\n"
        "    [pool.call(os.getpid) for _ in range(2)]\n"
        "    t = time.perf_counter(); pool.close(); print(time.perf_counter() - t)\n")


def exit_seconds(code: str, floor: bool) -> float:
    tail = "import os, sys, time\nsys.stdout.write(repr(time.time())); sys.stdout.flush()\n" + ("os._exit(0)\n" if floor else "")
    done = subprocess.run([sys.executable, "-c", code + tail], capture_output=True, text=True, cwd=REPO, check=True)
    return time.time() - float(done.stdout.strip().splitlines()[-1])


TRAIN = (STAGE + "import gc, sys, time\nimport torch\n"
         "from lensemble.paths import Layout\nfrom lensemble.training import make_optimizer, train_steps\n"
         "from lensemble.workflow import load_site, sampler_for\n"
         f"p = load_params({str(REPO / 'params.yaml')!r})\ntorch.set_num_threads(p.run.torch_threads)\n"
         f"layout = Layout({str(REPO)!r})\n"
         "samplers = [(s.embodiment, sampler_for(load_site(layout, p, s.name), p)) for s in sorted(p.data.sites, key=lambda s: s.embodiment)]\n"
         "if sys.argv[2] == 'frozen':\n    from orchestration.heap import freeze_long_lived\n    freeze_long_lived()\n"
         "spent, began = [0.0], [0.0]\n"
         "gc.callbacks.append(lambda phase, info: began.__setitem__(0, time.perf_counter()) if phase == 'start' "
         "else spent.__setitem__(0, spent[0] + time.perf_counter() - began[0]))\n"
         "model = build_model(p, 'centralized')\nsteps = int(sys.argv[1])\nt = time.perf_counter()\n"
         "train_steps(model, make_optimizer(model, p.train), samplers, steps, train=p.train, objective=p.objective, run_seed=0,"
         " round_idx=0, data_key='gc', schedule=(0, steps))\n"
         "print(time.perf_counter() - t, spent[0], len(gc.get_objects()), gc.get_freeze_count())\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    if not (REPO / "data" / "sites").is_dir():
        raise SystemExit("gc_cost: no data/sites here; run `dvc repro` first")
    for heap in ("as imported", "frozen"):
        wall, gc_s, tracked, frozen = (float(x) for x in subprocess.run(
            [sys.executable, "-c", TRAIN, str(args.steps), heap.split()[0]], capture_output=True, text=True, cwd=REPO,
            check=True).stdout.split())
        print(f"training {args.steps} steps, heap {heap:11s}: {wall:.2f} s, of which collections {gc_s:.3f} s ({100 * gc_s / wall:.1f}%);"
              f" {int(tracked):,} objects tracked, {int(frozen):,} frozen")
    for name, ending in ENDINGS.items():
        runs = [exit_seconds(STAGE + (ending or ""), ending is None) for _ in range(args.repeats)]
        print(f"stage process, {name:22s}: exit {statistics.median(runs):.2f} s (runs {', '.join(f'{r:.2f}' for r in runs)})")
    with tempfile.TemporaryDirectory() as tmp:
        pool = Path(tmp) / "pool_close.py"
        pool.write_text(POOL)  # spawned workers re-import the main module: it must be a file
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        runs = [float(subprocess.run([sys.executable, str(pool)], capture_output=True, text=True, cwd=REPO, env=env,
                                     check=True).stdout.split()[-1]) for _ in range(args.repeats)]
    print(f"a pool of 2 site workers, close (the workers skip it): {statistics.median(runs):.2f} s (runs {', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
