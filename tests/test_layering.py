"""The layers a newcomer sees in the tree hold: the library imports none of the layers above it.

`lensemble/` is pure library code, importable without Prefect, DVC or MLflow (STYLE.md, habit 1);
the stage runner and tracking live in `orchestration/`, Prefect tasks in `tasks/`, flows and the CLI
in `flows/`, benchmark suites in `benchmarks/`, and measurement primitives in `lensemble/perf.py`.
Imports are read with `ast`: statements at top level and inside functions alike, and modules imported
by name (`importlib.import_module("...")`, `__import__("...")`).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "lensemble"
FORBIDDEN = ("prefect", "prefect_dask", "mlflow", "dvc", "flows", "tasks", "orchestration", "benchmarks")


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name `path` imports anywhere in its body (relative imports stay inside the package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and _callee(node.func) in ("import_module", "__import__") and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _callee(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def test_the_library_imports_no_orchestration_tracking_or_upper_layer():
    offending = {
        str(path.relative_to(REPO)): sorted(name for name in imported_modules(path) if name.split(".")[0] in FORBIDDEN)
        for path in sorted(LIBRARY.rglob("*.py"))
    }
    offending = {path: names for path, names in offending.items() if names}
    assert not offending, f"lensemble/ must stay a library; these modules import an upper layer or a tool: {offending}"


def test_no_benchmark_module_lives_in_the_library():
    benches = sorted(str(p.relative_to(REPO)) for p in LIBRARY.rglob("bench*") if p.suffix == ".py" or p.is_dir())
    assert not benches, f"benchmark suites belong in benchmarks/, measurement primitives in lensemble/perf.py: {benches}"


def test_the_check_sees_function_level_and_by_name_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from prefect import flow\n    import mlflow.tracking\n"
                      "    importlib.import_module('dvc.repo')\n    from . import sibling\n")
    assert imported_modules(module) == {"os", "prefect", "mlflow.tracking", "dvc.repo"}
