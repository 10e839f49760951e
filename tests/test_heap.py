"""The long-lived heap of a process (orchestration/heap.py): a stage process and every worker of a pool freeze it once
their imports are done, and their exit skips the interpreter's last collection (the freeze runs after every atexit
handler registered later; the CLI, every pool worker and the test session register it)."""
from __future__ import annotations

import atexit
import gc
import subprocess
import sys
from pathlib import Path

from orchestration.workers import WorkerPool

# Nothing from tests.conftest at module level: a worker that unpickles `_exit_handlers_freeze` imports this module,
# and conftest registers the freeze for the test session itself.
REPO = Path(__file__).resolve().parents[1]

PROBE = "import atexit, gc\natexit.register(lambda: print('after every handler, frozen:', gc.get_freeze_count() > 0, flush=True))\n"


def _python(code: str, cwd=REPO) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_freeze_runs_after_the_handlers_registered_later_and_once():
    out = _python(PROBE + (
        "from orchestration.heap import skip_final_collection\n"
        "before = atexit._ncallbacks()\n"
        "skip_final_collection(); skip_final_collection()\n"
        "print('registered:', atexit._ncallbacks() - before, flush=True)\n"
        "atexit.register(lambda: print('a library handler, frozen:', gc.get_freeze_count() > 0, flush=True))\n"))
    assert out.splitlines() == ["registered: 1", "a library handler, frozen: False", "after every handler, frozen: True"]


def test_without_it_the_heap_is_never_frozen():
    """The probe itself: a plain exit freezes nothing (so the test above reads the registration, not the interpreter)."""
    assert _python(PROBE).splitlines() == ["after every handler, frozen: False"]


def test_the_cli_registers_it_before_any_command(tmp_path):
    from tests.conftest import make_project, micro_params

    root = make_project(tmp_path / "proj", micro_params())
    out = _python(PROBE + "from flows.cli import main\nraise SystemExit(main(['--root', '.', 'check-params']))\n", cwd=root)
    assert "is valid" in out and out.splitlines()[-1] == "after every handler, frozen: True"


def test_a_stage_process_freezes_its_imports_before_the_flow_runs(tmp_path):
    from tests.conftest import make_project, micro_params

    root = make_project(tmp_path / "proj", micro_params())
    out = _python(
        "import gc\nimport flows.cli as cli\n"
        "cli.ensure_server = lambda home: None\n"  # no Prefect server: the flow below is a stand-in that reads the heap
        "cli.stage_flow = lambda stage, root: (lambda root: print('frozen as the flow starts:', gc.get_freeze_count() > 0))\n"
        "print('frozen before:', gc.get_freeze_count() > 0)\n"
        "raise SystemExit(cli.main(['--root', '.', 'run', 'prepare']))\n", cwd=root)
    assert out.splitlines() == ["frozen before: False", "frozen as the flow starts: True"]


def test_a_worker_freezes_its_warm_imports():
    pool = WorkerPool(1, 1, warm=("json",))
    try:
        pool.wait_ready()
        assert pool.call(gc.get_freeze_count) > 0
    finally:
        pool.close()


def _exit_handlers_freeze() -> bool:
    """In a worker: run its exit handlers now (as its exit would) and say whether they froze the heap."""
    gc.unfreeze()
    atexit._run_exitfuncs()
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    return frozen


def test_every_worker_of_a_pool_registers_it():
    pool = WorkerPool(1, 1)
    try:
        assert pool.call(_exit_handlers_freeze) is True
    finally:
        pool.close()
