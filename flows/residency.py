"""Stage `residency`: audit what may leave each site before any training starts.

Checks every site's data manifest through the residency guard (counts and hashes only), and scans
the exchange area, `reports/` and the MLflow store for any site's private rows (whole frames,
action and proprioception value pairs; see `lensemble.data.audit`); a finding fails the stage with
ResidencyViolation naming the files.
"""
from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NONE

from lensemble.data.audit import load_index, scan_paths
from lensemble.data.residency import ResidencyGuard
from lensemble.errors import ResidencyViolation
from lensemble.workflow import load_site, site_names
from tasks.runner import stage_run


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


@flow(name="residency")
def residency_flow(root: str = ".") -> None:
    with stage_run("residency", root) as ctx:
        sites = site_names(ctx.params)
        results = [f.result() for f in [audit_site.submit(ctx.params, ctx.layout, s, ctx.data_manifests.get(s, {})) for s in sites]]
        ctx.out.write_json("reports/residency.json", {"sites": results, "status": "clean"})
