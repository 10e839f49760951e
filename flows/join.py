"""Flow `join`: a robot that took no part in the federation joins it after the fact (orchestration/joining.py).

    lensemble join SITE          # SITE declared in params.yaml under join.sites (name, embodiment, episodes)

Needs the federation's `models/federated.pt` (`dvc repro`). The site generates its few episodes at
home, trains a new local action head and proprio adapter on the frozen federated encoder and predictor, and a model of
its own from scratch on the same episodes; both plan closed loop on the same seeds beside the oracle
and random actions. Writes `reports/join/<site>.json` and `reports/join/<site>.md` (the result as a
report section), records its own MLflow stage run and RunManifest like every stage. Like the
ablation it is not a DVC stage: it is a question asked after a run, not part of one.
"""
from __future__ import annotations

from prefect import flow

from flows.runs import STAGE_RUN
from orchestration.join_sites import join_site
from orchestration.joining import AGENTS
from orchestration.runner import stage_run
from tasks.join import generate_join_episodes, join_and_evaluate
from tasks.residency import check_outputs


def join_markdown(r: dict) -> str:
    """The result as a report section: success of each agent with its interval, and joined against scratch."""
    s = r["success"]
    rows = "\n".join(f"| {a} | {s[a]['success_rate']:.2f} [{s[a]['ci_low']:.2f}, {s[a]['ci_high']:.2f}] | {s[a]['wins']} |" for a in AGENTS)
    ratio = "n/a (scratch never succeeded)" if r["joined_over_scratch"] is None else f"{r['joined_over_scratch']:.2f}x"
    return (f"## A new robot joins: {r['site']} ({r['embodiment']})\n\n"
            f"{r['episodes']} episodes of its own, {r['steps']} training steps each; {r['evaluation_episodes']} evaluation "
            f"episodes (same seeds for every agent), success: {r['success_criterion']}.\n\n"
            "| agent | success [95% Wilson] | successes |\n|---|---|---|\n" + rows + "\n\n"
            f"Joined (federated encoder + predictor, frozen; only a new local action head and proprio adapter trained) over from scratch: {ratio}, "
            f"two-sided Fisher exact p = {r['joined_vs_scratch_p']:.3g}.\n")


@flow(name="join", **STAGE_RUN)
def join_flow(root: str = ".", site: str = "") -> dict:
    with stage_run("join", root) as ctx:
        join_site(ctx.params, site)  # ConfigError before any work
        ctx.data_manifests[site] = generate_join_episodes(ctx.params, ctx.layout, site)
        result = join_and_evaluate(ctx.params, ctx.layout, site)
        for name, value in result["metrics"].items():
            ctx.metric(name, value, participant=site)
        ctx.measured["eval/join/joined_over_scratch"] = result["joined_over_scratch"] or 0.0
        ctx.out.write_json(f"reports/join/{site}.json", result)
        ctx.out.path(f"reports/join/{site}.md").write_text(join_markdown(result))
    check_outputs(ctx.params, ctx.layout)  # INV-RESIDENCY: what the stage committed holds none of any site's rows, the joiner's too
    return result
