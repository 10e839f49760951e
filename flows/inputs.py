"""What each stage reads before it can start, checked by `lensemble run STAGE` before Prefect starts.

A missing input is otherwise found by the stage's flow, after the Prefect server's start (~30 s) and
under a Prefect traceback; here it is one line naming every missing file and the stage that makes it.
The table follows what the flows and tasks open (dvc.yaml declares the same files, some as folders).
"""
from __future__ import annotations

from pathlib import Path

from lensemble.config import Params
from lensemble.errors import DataError
from lensemble.paths import Layout


def _sites(p: Params, layout: Layout) -> list[tuple[Path, str]]:
    return [(layout.site_episodes(s.name), "prepare") for s in sorted(p.data.sites, key=lambda s: s.name)]


def _probes(p: Params, layout: Layout) -> list[tuple[Path, str]]:
    return [(layout.probe(e), "prepare") for e in sorted({s.embodiment for s in p.data.sites})]


def _models(p: Params, layout: Layout, all_sites: bool) -> list[tuple[Path, str]]:
    names = sorted(s.name for s in p.data.sites)
    needed = [(layout.models / "centralized.pt", "centralized"), (layout.models / "federated.pt", "federate")]
    needed += [(layout.site_state(s), "federate") for s in (names if all_sites else names[:1])]
    if all_sites and p.federate.local_only:
        needed += [(layout.models / "local" / f"{s}.pt", "federate") for s in names]
    return needed


def required_inputs(stage: str, p: Params, layout: Layout) -> list[tuple[Path, str]]:
    """(path, the stage that writes it) for every file `stage` reads; sovereign sites' data is at the sites."""
    sites = [] if p.federate.execution == "sovereign" else _sites(p, layout)
    reports = layout.reports
    table = {
        "prepare": [],
        "residency": _sites(p, layout),
        "centralized": _sites(p, layout) + _probes(p, layout),
        "federate": sites + _probes(p, layout),
        "gauge": _probes(p, layout) + _models(p, layout, all_sites=False)
        + [(reports / "federate.json", "federate"), (reports / "centralized.json", "centralized")],
        "evaluate": _sites(p, layout) + _probes(p, layout) + _models(p, layout, all_sites=True),
        "report": [(reports / f"{name}.json", stage_of) for name, stage_of in
                   (("centralized", "centralized"), ("federate", "federate"), ("gauge", "gauge"), ("eval", "evaluate"))]
        + [(reports / "plots" / "centralized_loss.json", "centralized")],
    }
    return table[stage]


def check_inputs(stage: str, p: Params, root: Path) -> None:
    """DataError naming every missing input of `stage`, relative to the project root, and the stages that write them."""
    layout = Layout(root)
    missing = [(path, by) for path, by in required_inputs(stage, p, layout) if not path.exists()]
    if not missing:
        return
    shown = ", ".join(str(path.relative_to(layout.root)) for path, _ in missing[:4])
    more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    producers = list(dict.fromkeys(f"`lensemble run {by}`" for _, by in missing))
    producers = ", ".join(producers[:-1]) + " and " + producers[-1] if len(producers) > 1 else producers[0]
    raise DataError(f"stage {stage} cannot start: missing {shown}{more}; run {producers} first (or `dvc repro {stage}`)")
