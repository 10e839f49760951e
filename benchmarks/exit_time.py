"""How long a Lensemble process takes to exit, with and without the interpreter's last garbage collection
(orchestration/quick_exit.py), beside the floor: `os._exit`, which skips every handler and all teardown.

    python benchmarks/exit_time.py [--repeats 3]

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
    "skip_final_collection": "from orchestration.quick_exit import skip_final_collection\nskip_final_collection()\n",
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
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
