"""Stage `prepare`: every site's episode store (generated, or imported from its LeRobot `source`) and the public
probe set, one Prefect task run each."""
from __future__ import annotations

import sys

from prefect import flow
from tqdm import tqdm

from flows.runs import STAGE_RUN
from lensemble.workflow import embodiments
from orchestration.runner import stage_run
from tasks.data import generate_probe, generate_site, import_site


def submit_site(ctx, s):
    """The task run that fills site `s`'s store: imported from its LeRobot `source` if it has one, else generated."""
    store, index = ctx.out.path(f"data/sites/{s.name}/episodes.parquet"), ctx.out.path(f"data/sites/{s.name}/private_index.npz")
    if s.source is not None:
        return import_site.submit(ctx.params, s.name, ctx.layout.root / s.source.lerobot, store, index,
                                  ctx.out.path(f"data/sites/{s.name}/source.json"))
    return generate_site.submit(ctx.params, s.name, s.embodiment, s.episodes, store, index)


@flow(name="prepare", **STAGE_RUN)
def prepare_flow(root: str = ".") -> None:
    with stage_run("prepare", root) as ctx:
        sites = sorted(ctx.params.data.sites, key=lambda s: s.name)
        site_futures = [submit_site(ctx, s) for s in sites]
        probe_futures = {emb: generate_probe.submit(ctx.params, emb, ctx.out.path(f"data/probe/{emb}.parquet")) for emb in embodiments(ctx.params)}
        for s, fut in tqdm(list(zip(sites, site_futures)), desc="generate sites", unit="site", disable=not sys.stderr.isatty()):
            manifest = fut.result()
            ctx.data_manifests[s.name] = manifest
            ctx.out.write_json(f"data/sites/{s.name}/manifest.json", manifest)
        probes = {emb: fut.result() for emb, fut in probe_futures.items()}
        ctx.data_manifests["public_probe"] = probes
        ctx.out.write_json("reports/prepare.json", {"sites": ctx.data_manifests, "probe": probes})
