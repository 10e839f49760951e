"""Stage `evaluate`: latent-MPC closed loop for Stage A, Stage B and random actions, per embodiment."""
from __future__ import annotations

import sys

from prefect import flow
from tqdm import tqdm

from lensemble.workflow import site_names
from tasks.evaluate import evaluate_site, evaluated_models
from tasks.runner import stage_run


@flow(name="evaluate")
def evaluate_flow(root: str = ".") -> None:
    with stage_run("evaluate", root) as ctx:
        sites = site_names(ctx.params)
        futures = [evaluate_site.submit(ctx.params, ctx.layout, s) for s in sites]
        results = {s: fut.result() for s, fut in tqdm(list(zip(sites, futures)), desc="evaluate sites", unit="site", disable=not sys.stderr.isatty())}
        for s, res in results.items():
            for model in evaluated_models(ctx.params):
                ctx.metric(f"eval/success_rate/{model}", res[model]["success_rate"], participant=s)
            ctx.metric("eval/plan_seconds", res["federated"]["plan_seconds"], participant=s)
        means = {m: sum(r[m]["success_rate"] for r in results.values()) / len(results) for m in evaluated_models(ctx.params)}
        ctx.measured["eval/success_rate"] = means["federated"]
        ctx.measured["eval/plan_seconds"] = sum(r["federated"]["plan_seconds"] for r in results.values()) / len(results)
        ctx.out.write_json("reports/eval.json", {"sites": results, "mean_success_rate": means})
