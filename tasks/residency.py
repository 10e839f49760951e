"""Prefect task of the residency stage: one site's audit of what may leave it."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from lensemble.data.audit import load_index, scan_paths
from lensemble.data.residency import ResidencyGuard
from lensemble.errors import ResidencyViolation
from lensemble.workflow import load_site


@task(name="audit-site", cache_policy=NONE)
def audit_site(params, layout, site: str, manifest: dict) -> dict:
    """Guard the site's manifest and scan the shared areas for its private rows."""
    index = load_index(layout.site_episodes(site), load_site(layout, params, site))
    guard = ResidencyGuard(site, None, layout.site_audit(site), private=index)
    guard.release("manifest", manifest)
    targets = [layout.exchange, layout.reports, layout.root / "mlflow.db", layout.root / "mlartifacts"]
    leaks = scan_paths(targets, index)
    if leaks:
        raise ResidencyViolation(f"site {site!r}: private rows found in {sorted(leaks)[:3]}")
    return {"site": site, "fingerprints": len(index), "index_sha256": index.digest(), "leaks": 0}
