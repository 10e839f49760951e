"""dvc.yaml's code deps are exactly what each stage's flow imports: nothing missing, nothing stale.

DVC reruns a stage only when one of its deps changed, and the deps are written by hand, so a module a
stage imports but does not list lets an edit to it go unnoticed (a stale result), and a listed
module it no longer imports reruns it for nothing. Each stage's command is `lensemble run <stage>`,
which runs `flows/<stage>.py`; its import closure over the repository's own packages is read with
`ast` from the files as they are now: top-level and function-level imports alike (flows import
lazily), modules named by a dotted string (the simulator registry imports them by name) and the C
sources a module compiles. A directory dep covers the files under it; data deps are not checked.
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lensemble", "flows", "tasks", "orchestration", "benchmarks")
STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
SOURCE_SUFFIXES = (".c", ".h", ".cu", ".cpp")  # sources a module compiles at run time


def module_path(name: str) -> Path | None:
    """The repository file of module `name` (a module or a package's __init__), None outside the packages."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = REPO.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(text: str) -> bool:
    parts = text.split(".")
    return len(parts) > 1 and all(part.isidentifier() for part in parts)


def imported_names(path: Path) -> set[str]:
    """Every module name `path` imports anywhere in its body, with the packages a dotted import executes."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from ..y import z`
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _dotted(node.value):
            names.add(node.value)  # imported by name (importlib), as the embodiment registry does
    parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
    return names | parents


def unresolved(path: Path) -> list[str]:
    """Modules of the repository's packages that `path` imports by an import statement but that have no file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return sorted(n for n in names if n.split(".")[0] in PACKAGES and module_path(n) is None)


def resources(path: Path) -> set[Path]:
    """Files beside module `path` that it names in a string (`Path(__file__).with_name("fused_step.c")`)."""
    strings = {node.value for node in ast.walk(ast.parse(path.read_text(), str(path)))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return {path.parent / s for s in strings if "/" not in s and s.endswith(SOURCE_SUFFIXES)
            and (path.parent / s).is_file()}


@cache
def closure(entry: Path) -> frozenset[Path]:
    """The repository files `entry` imports, transitively, itself included, with the sources they compile."""
    seen, todo = set(), [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path.suffix == ".py":
            seen |= resources(path)
            todo += [p for p in map(module_path, imported_names(path)) if p is not None and p not in seen]
    return frozenset(seen)


def is_trivial(path: Path) -> bool:
    """An __init__ with nothing but a docstring: importing it cannot change a result."""
    if path.name != "__init__.py":
        return False
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in ast.parse(path.read_text()).body)


def is_code(dep: str) -> bool:
    return Path(dep).parts[0] in PACKAGES


def covers(dep: str, path: Path) -> bool:
    target = REPO / dep
    return path == target or (target.is_dir() and path.is_relative_to(target))


def entry_point(stage: str) -> Path:
    cmd = STAGES[stage]["cmd"]
    match = re.fullmatch(r"lensemble run ([a-z_]+)", cmd.strip())
    assert match, f"stage {stage!r}: command {cmd!r} is not `lensemble run <stage>`"
    assert match[1] == stage, f"stage {stage!r} runs the {match[1]!r} flow"
    entry = REPO / "flows" / f"{stage}.py"
    assert entry.is_file(), f"stage {stage!r}: its flow {entry.relative_to(REPO)} does not exist"
    return entry


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_module_a_stage_imports_is_a_dep(stage: str) -> None:
    deps = STAGES[stage]["deps"]
    imported = closure(entry_point(stage))
    broken = {str(p.relative_to(REPO)): unresolved(p) for p in imported if p.suffix == ".py" and unresolved(p)}
    assert not broken, f"stage {stage!r}: imports of the repository's packages that name no file: {broken}"
    missing = sorted(str(p.relative_to(REPO)) for p in imported
                     if not is_trivial(p) and not any(covers(d, p) for d in deps))
    assert not missing, f"dvc.yaml stage {stage!r} imports these but does not list them as deps: {missing}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_code_dep_of_a_stage_is_imported(stage: str) -> None:
    imported = [p for p in closure(entry_point(stage)) if not is_trivial(p)]
    stale = [d for d in STAGES[stage]["deps"] if is_code(d) and not any(covers(d, p) for p in imported)]
    assert not stale, f"dvc.yaml stage {stage!r} lists code deps it does not import: {stale}"


def test_the_closure_follows_lazy_imports_imports_by_name_and_compiled_sources() -> None:
    lib = REPO / "lensemble"
    workflow = closure(lib / "workflow.py")
    assert lib / "model" / "warm_start.py" in workflow  # imported inside `warm_start` only
    assert lib / "sim" / "gridworld.py" in workflow  # named in the embodiment registry, imported by importlib
    assert lib / "federation" / "fused_step.c" in closure(lib / "federation" / "native.py")  # compiled at run time
    assert module_path("lensemble.sim") == lib / "sim" / "__init__.py"
    assert module_name(lib / "sim" / "__init__.py") == "lensemble.sim" and module_path("numpy") is None


def test_a_code_dep_is_its_sources_not_the_bytecode_python_compiled():
    """DVC hashes a directory dep file by file: bytecode in __pycache__ changed every stage's deps whenever an interpreter
    compiled a module (a test run), and `dvc status` then called up-to-date results stale. .dvcignore leaves it out."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        assert repo.dvcignore.is_ignored_dir(str(REPO / "lensemble" / "model" / "__pycache__"))
        assert repo.dvcignore.is_ignored_file(str(REPO / "lensemble" / "model" / "__pycache__" / "vit.cpython-311.pyc"))
        for stage in STAGES.values():  # every source a stage depends on still counts
            for dep in stage["deps"]:
                if is_code(dep):
                    ignored = repo.dvcignore.is_ignored_dir if (REPO / dep).is_dir() else repo.dvcignore.is_ignored_file
                    assert not ignored(str(REPO / dep)), dep
