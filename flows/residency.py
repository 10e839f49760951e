"""Stage `residency`: audit what may leave each site before any training starts.

Checks every site's data manifest through the residency guard (counts and hashes only), and scans
the exchange area, `reports/` and the MLflow store for any site's private rows (whole frames,
action and proprioception value pairs; see `lensemble.data.audit`); a finding fails the stage with
ResidencyViolation naming the files.
"""
from __future__ import annotations

from prefect import flow

from flows.runs import STAGE_RUN
from lensemble.workflow import site_names
from orchestration.runner import stage_run
from tasks.residency import audit_site


@flow(name="residency", **STAGE_RUN)
def residency_flow(root: str = ".") -> None:
    with stage_run("residency", root) as ctx:
        sites = site_names(ctx.params)
        futures = [audit_site.submit(ctx.params, ctx.layout, s, ctx.data_manifests.get(s, {})) for s in sites]
        results = [f.result() for f in futures]
        ctx.out.write_json("reports/residency.json", {"sites": results, "status": "clean"})
