"""Stage `evaluate`: dynamics diagnostics, then latent-MPC closed loop for Stage A, Stage B, the local-only
baseline, the oracle planner and random actions, per embodiment, on the same episode seeds."""
from __future__ import annotations

import sys

from prefect import flow
from tqdm import tqdm

from flows.runs import STAGE_RUN
from lensemble.workflow import site_names
from orchestration.evaluation import REFERENCES, evaluated_models
from orchestration.runner import stage_run
from tasks.evaluate import evaluate_site


def by_embodiment(results: dict, agents: tuple[str, ...]) -> dict:
    """Per embodiment: mean success of each agent over its sites, and each model's share of the oracle's."""
    out: dict = {}
    for res in results.values():
        out.setdefault(res["embodiment"], []).append(res)
    table = {}
    for emb, rows in sorted(out.items()):
        mean = {a: sum(r[a]["success_rate"] for r in rows) / len(rows) for a in agents}
        oracle = mean["oracle"]
        table[emb] = {**mean, "episodes": sum(r[agents[0]]["episodes"] for r in rows), "success_criterion": rows[0]["success_criterion"],
                      "max_steps": rows[0]["max_steps"], "energy": rows[0].get("energy", "final"),
                      "energy_terms": rows[0].get("energy_terms", ""),
                      "of_oracle": {a: (mean[a] / oracle if oracle > 0 else None) for a in agents if a not in REFERENCES}}
    return table


@flow(name="evaluate", **STAGE_RUN)
def evaluate_flow(root: str = ".") -> None:
    with stage_run("evaluate", root) as ctx:
        sites = site_names(ctx.params)
        futures = [evaluate_site.submit(ctx.params, ctx.layout, s) for s in sites]
        results = {s: fut.result() for s, fut in tqdm(list(zip(sites, futures)), desc="evaluate sites", unit="site", disable=not sys.stderr.isatty())}
        models = evaluated_models(ctx.params)
        agents = models + REFERENCES
        for s, res in results.items():
            for agent in agents:
                ctx.metric(f"eval/success_rate/{agent}", res[agent]["success_rate"], participant=s)
            for model, diag in res["diagnostics"].items():
                for h, ratio in enumerate(diag["rollout_vs_copy"], start=1):
                    ctx.metric(f"eval/rollout_vs_copy/{model}", ratio, participant=s, step=h)
                    ctx.metric(f"eval/rollout_vs_copy_proprio/{model}", diag["rollout_vs_copy_proprio"][h - 1], participant=s, step=h)
                for name in ("action_sensitivity", "action_sensitivity_proprio", "probe_r2"):
                    ctx.metric(f"eval/{name}/{model}", diag[name], participant=s)
                for component, r2 in diag.get("world_probe_r2", {}).items():
                    ctx.metric(f"eval/world_probe_r2/{component}/{model}", r2, participant=s)
                for name in ("push_capture", "push_closer"):
                    if name in diag:
                        ctx.metric(f"eval/{name}/{model}", diag[name], participant=s)
            ctx.metric("eval/plan_seconds", res["federated"]["plan_seconds"], participant=s)
        means = {m: sum(r[m]["success_rate"] for r in results.values()) / len(results) for m in agents}
        ctx.measured["eval/success_rate"] = means["federated"]
        ctx.measured["eval/plan_seconds"] = sum(r["federated"]["plan_seconds"] for r in results.values()) / len(results)
        ctx.out.write_json("reports/eval.json", {"sites": results, "mean_success_rate": means, "embodiments": by_embodiment(results, agents)})
