"""Stage `residency`: audit what may leave each site before any training starts.

Checks every site's data manifest through the residency guard (counts and hashes only), and scans
the exchange area, `reports/`, the MLflow store and the Prefect database for every site's private rows
(whole frames, action and proprioception value pairs; see `lensemble.data.audit`) in one pass that reads
each file once; a finding fails the stage with ResidencyViolation naming the file and the site.
"""
from __future__ import annotations

from prefect import flow

from flows.runs import STAGE_RUN
from lensemble.workflow import site_names
from orchestration.runner import stage_run
from tasks.residency import audit_site, scan_outputs


@flow(name="residency", **STAGE_RUN)
def residency_flow(root: str = ".") -> None:
    with stage_run("residency", root) as ctx:
        sites = site_names(ctx.params)
        futures = [audit_site.submit(ctx.params, ctx.layout, s, ctx.data_manifests.get(s, {})) for s in sites]
        results = [f.result() for f in futures]
        scan_outputs(ctx.params, ctx.layout)  # ResidencyViolation naming the file and the site on any hit
        ctx.out.write_json("reports/residency.json", {"sites": [{**r, "leaks": 0} for r in results], "status": "clean"})
