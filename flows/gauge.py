"""Stage `gauge`: per-round drift and effective dimension from federation, plus final-model diagnostics."""
from __future__ import annotations

import json

from prefect import flow

from lensemble.errors import DataError
from tasks.evaluate import gauge_final
from tasks.runner import stage_run


@flow(name="gauge")
def gauge_flow(root: str = ".") -> None:
    with stage_run("gauge", root) as ctx:
        fed_path = ctx.layout.reports / "federate.json"
        if not fed_path.is_file():
            raise DataError(f"{fed_path} does not exist: run the federate stage first")
        rounds = json.loads(fed_path.read_text())["per_round"]
        final = gauge_final(ctx.params, ctx.layout)
        per_round = []
        for r in rounds:
            angles = [s["gauge/drift_angle_deg"] for s in r["sites"].values()]
            per_round.append({"round": r["round"], "drift_angle_deg_mean": sum(angles) / len(angles), "drift_angle_deg_max": max(s["gauge/drift_angle_max_deg"] for s in r["sites"].values()),
                              "procrustes_residual_mean": sum(s["gauge/procrustes_residual"] for s in r["sites"].values()) / len(angles),
                              "effective_dim": r["gauge"]["effective_dim"]["rankme"], "participation_ratio": r["gauge"]["effective_dim"]["participation_ratio"],
                              "pairs": r["gauge"]["pairs"]})
        first_dim = per_round[0]["effective_dim"]
        min_dim = min(r["effective_dim"] for r in per_round)
        tripwire = min_dim < (1 - ctx.params.gauge.collapse_drop_fraction) * first_dim
        for r in per_round:
            ctx.metric("gauge/drift_angle_deg", r["drift_angle_deg_mean"], step=r["round"], round_idx=r["round"])
            ctx.metric("gauge/procrustes_residual", r["procrustes_residual_mean"], step=r["round"], round_idx=r["round"])
            ctx.metric("gauge/effective_dim", r["effective_dim"], step=r["round"], round_idx=r["round"])
        ctx.measured["gauge/drift_angle_deg"] = per_round[-1]["drift_angle_deg_mean"]
        # the target is "stays ≥ 50% of the latent dimension over the run": the budget checks the lowest round
        lowest = min_dim / final["latent_dim"]
        ctx.measured["gauge/effective_dim_fraction"] = lowest
        ctx.out.write_json("reports/gauge.json", {"per_round": per_round, "final": final, "collapse_tripwire": tripwire,
                                                  "effective_dim_fraction_min": lowest})
