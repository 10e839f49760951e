"""The garbage collector and the long-lived heap of a Lensemble process.

A stage process or a site worker imports torch, Prefect, MLflow and the simulators: about 340,000 container
objects that live as long as the process. Every full collection walks them (in 200 pooled training steps the
collections took 3.7% of the time, 1.0% with them frozen), and so does the interpreter's last collection at
exit (0.9-1.0 s in a process that imported a stage's modules and built its model, 2.0-2.4 s in a site worker
after its calls, 3.6 s in a process that ran a federation flow). Measured on a 2-core machine,
`python benchmarks/gc_cost.py`.

- `freeze_long_lived`: once the imports are done (a stage process before its flow, a worker after its warm
  imports), collect and move what survives into the permanent generation, which no collection visits.
- `skip_final_collection`: the same at exit, after every other atexit handler. Nothing else of the exit
  changes: the handlers (MLflow's, Prefect's, logging's flushes) still run, and objects are still released as
  the interpreter tears its modules down; only garbage in reference cycles (which CPython never promises to
  finalize at exit) is left to the operating system.

Neither changes a number a stage computes. A process that runs many flows in turn (a test session) freezes
nothing mid-run: objects frozen there would never be collected once they became garbage.
"""
from __future__ import annotations

import atexit
import gc

_registered = False


def freeze_long_lived() -> None:
    """Collect, then move every surviving object into the permanent generation (call once the imports are done)."""
    gc.collect()
    gc.freeze()


def skip_final_collection() -> None:
    """Freeze the heap once every other atexit handler has run. atexit runs handlers last-registered first, so
    call this early, before the libraries register theirs; calling it again does nothing."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
