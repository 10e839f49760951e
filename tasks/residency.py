"""Prefect task of the residency stage (one site's audit of what may leave it), and the leak scans the
federation runs on what it wrote: the exchange's run tree before it is removed, and the stage's outputs
(reports/, the MLflow store, the Prefect database with its artifacts and logs) after it ends."""
from __future__ import annotations

import os
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from lensemble.data.audit import (
    PrivateIndex,
    index_path,
    load_index,
    scan_blobs,
    scan_paths_many,
)
from lensemble.data.residency import ResidencyGuard
from lensemble.errors import ResidencyViolation
from lensemble.workflow import load_site, site_names


def output_targets(layout) -> list:
    """Where a run's shared outputs land: the exchange area, reports/, the MLflow store, and the Prefect
    database (flow and task runs, their logs and the artifacts the flows publish; `PREFECT_HOME`, the
    project's .prefect/ by default)."""
    prefect_home = Path(os.environ.get("PREFECT_HOME", layout.root / ".prefect"))
    prefect_db = sorted(prefect_home.glob("prefect.db*")) if prefect_home.is_dir() else []
    return [layout.exchange, layout.reports, layout.root / "mlflow.db", layout.root / "mlartifacts", *prefect_db]


@task(name="audit-site", task_run_name="audit-{site}", cache_policy=NONE)
def audit_site(params, layout, site: str, manifest: dict) -> dict:
    """Guard the site's manifest (counts and hashes only) and fingerprint its private rows."""
    index = load_index(layout.site_episodes(site), load_site(layout, params, site))
    guard = ResidencyGuard(site, None, layout.site_audit(site), private=index)
    guard.release("manifest", manifest)
    return {"site": site, "fingerprints": len(index), "index_sha256": index.digest()}


@task(name="scan-outputs", cache_policy=NONE)
def scan_outputs(params, layout) -> int:
    """The shared areas scanned once for every site's private rows (`check_outputs`).

    One pass reads and parses each file once for all sites: a scan per site read the Prefect database and
    the MLflow store once per site, and both grow with every run (in a workspace after ~30 runs: 23 s a
    site, 26 s for all three together; with `text_scan.c` and one pre-filter for all sites, 5.7 s where the
    Prefect database had grown to 171 MB and the regular expressions took 37.9 s)."""
    return check_outputs(params, layout)


def site_indexes(params, layout) -> dict[str, PrivateIndex]:
    """Every site's private index that this machine holds (the stored one, else built from its episodes).

    In the one-machine product the coordinator reaches every site's folder; a site whose store is not
    here (a sovereign site on its own machine) is left out: it scans at home.
    """
    out = {}
    for s in site_names(params):
        store = layout.site_episodes(s)
        if index_path(store).is_file():
            out[s] = PrivateIndex.load(index_path(store))
        elif store.exists():
            out[s] = load_index(store, load_site(layout, params, s))
    for j in params.join.sites:  # a site that joined after the federation (`lensemble join`) is scanned for too
        if index_path(layout.join_episodes(j.name)).is_file():
            out[j.name] = PrivateIndex.load(index_path(layout.join_episodes(j.name)))
    return out


def check_exchange_tree(params, layout, ex, rel: str) -> int:
    """Scan every object under `rel` in the exchange for every site's private rows; returns the objects scanned.

    ResidencyViolation naming the objects on a hit; the tree is left in place for inspection.
    """
    blobs = list(ex.walk(rel))
    if not blobs:
        return 0
    leaks = scan_blobs(blobs, site_indexes(params, layout))
    if leaks:
        raise ResidencyViolation(f"exchange {ex.url}: private rows found in {sorted(leaks)[:3]}; {rel} kept for inspection")
    return len(blobs)


def check_outputs(params, layout) -> int:
    """After a stage: scan reports/, the MLflow store and the exchange area for every site's private rows.

    Returns the number of sites scanned against; ResidencyViolation naming the files on a hit.
    """
    indexes = site_indexes(params, layout)
    leaks = scan_paths_many(output_targets(layout), indexes)
    if leaks:
        raise ResidencyViolation(f"private rows found in {sorted(leaks)[:3]}")
    return len(indexes)
