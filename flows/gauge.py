"""Stage `gauge`: per-round drift and effective dimension from federation, plus final-model diagnostics."""
from __future__ import annotations

import json

from prefect import flow

from flows.runs import STAGE_RUN
from lensemble.errors import DataError
from lensemble.gauge import dimension_against_alone, gauge_over_rounds, rounds_against_alone
from orchestration.runner import stage_run
from tasks.evaluate import gauge_final

# canonical metric → per-round row key, logged in this order every round
_ROUND_METRICS = (("gauge/drift_angle_deg", "drift_angle_deg_mean"),
                  ("gauge/procrustes_residual", "procrustes_residual_mean"),
                  ("gauge/effective_dim", "effective_dim"),
                  ("gauge/effective_dim_vs_pooled", "effective_dim_vs_pooled"))


def _report(layout, name: str, stage: str) -> dict:
    path = layout.reports / name
    if not path.is_file():
        raise DataError(f"{path} does not exist: run the {stage} stage first")
    return json.loads(path.read_text())


@flow(name="gauge", **STAGE_RUN)
def gauge_flow(root: str = ".") -> None:
    with stage_run("gauge", root) as ctx:
        federate = _report(ctx.layout, "federate.json", "federate")
        rounds = federate["per_round"]
        final = gauge_final(ctx.params, ctx.layout)
        # Stage A's effective dimension at the federation's round marks: collapse is read against the pooled model
        pooled_curve = _report(ctx.layout, "centralized.json", "centralized")["effective_dim_curve"]
        g = gauge_over_rounds(rounds, pooled_curve, ctx.params.gauge.collapse_drop_fraction)
        # each robot against its site's encoder trained alone at the same mark (what the mixture of robots does not explain)
        alone = rounds_against_alone(g.per_round, federate.get("local_only") or {})
        if alone is not None:  # and at the end, the three figures per robot (the baselines' last points are their final models)
            by = final["effective_dim_by_embodiment"]
            final["dimension_against_alone"] = dimension_against_alone(by["centralized"], by["federated"], federate["local_only"])
        for r in g.per_round:
            for name, key in _ROUND_METRICS:
                ctx.metric(name, r[key], step=r["round"], round_idx=r["round"])
            if "within_vs_pooled" in r:  # per embodiment: the lowest robot's federated ÷ pooled RankMe, and how far apart the robots sit
                ctx.metric("gauge/effective_dim_within_vs_pooled", min(r["within_vs_pooled"].values()), step=r["round"], round_idx=r["round"])
                ctx.metric("gauge/between_fraction", r["between_fraction"], step=r["round"], round_idx=r["round"])
            if "vs_alone" in r:  # the lowest site's federated robot ÷ its encoder trained alone
                ctx.metric("gauge/effective_dim_vs_local_only", min(r["vs_alone"].values()), step=r["round"], round_idx=r["round"])
            if "temporal_vs_pooled" in r:  # per embodiment: the lowest robot's federated ÷ pooled within-episode variance share
                ctx.metric("gauge/temporal_share_vs_pooled", min(r["temporal_vs_pooled"].values()), step=r["round"], round_idx=r["round"])
        ctx.measured["gauge/drift_angle_deg"] = g.per_round[-1]["drift_angle_deg_mean"]
        # the target is "stays ≥ 50% of the latent dimension over the run": the budget checks the lowest round
        lowest = g.effective_dim_min / final["latent_dim"]
        ctx.measured["gauge/effective_dim_fraction"] = lowest
        ctx.measured["gauge/effective_dim_vs_pooled"] = g.effective_dim_vs_pooled_min
        if alone is not None:  # the lowest round and site: the band holds in every round
            ctx.measured["gauge/effective_dim_vs_local_only"] = alone
        ctx.out.write_json("reports/gauge.json", {"per_round": g.per_round, "final": final,
                                                  "collapse_tripwire": g.collapse_tripwire,
                                                  "collapse_reasons": list(g.collapse_reasons),
                                                  "effective_dim_fraction_min": lowest,
                                                  "effective_dim_vs_pooled_min": g.effective_dim_vs_pooled_min,
                                                  "effective_dim_vs_local_only_min": alone,
                                                  "effective_dim_within_vs_pooled_min": g.within_vs_pooled_min,
                                                  "temporal_share_vs_pooled_min": g.temporal_vs_pooled_min})
