"""Stage `gauge`: per-round drift and effective dimension from federation, plus final-model diagnostics."""
from __future__ import annotations

import json

from prefect import flow

from lensemble.errors import DataError
from lensemble.gauge import collapse_tripwire
from tasks.evaluate import gauge_final
from tasks.runner import stage_run


def pooled_curve(layout) -> list[dict]:
    """Stage A's effective dimension at the federation's round marks (reports/centralized.json)."""
    path = layout.reports / "centralized.json"
    if not path.is_file():
        raise DataError(f"{path} does not exist: run the centralized stage first")
    return json.loads(path.read_text())["effective_dim_curve"]


def matched_pooled(curve: list[dict], rounds: int) -> list[dict]:
    """For each round r = 1..R, the pooled checkpoint at the nearest fraction r/R of Stage A's steps (the curve is
    taken at the main run's round marks; an ablation point with another R reads the nearest)."""
    total = curve[-1]["step"]
    return [min(curve, key=lambda c: abs(c["step"] / total - r / rounds)) for r in range(1, rounds + 1)]


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
        pooled = matched_pooled(pooled_curve(ctx.layout), len(per_round))
        for r, point in zip(per_round, pooled):
            r["pooled_effective_dim"] = point["rankme"]
            r["effective_dim_vs_pooled"] = r["effective_dim"] / max(point["rankme"], 1e-12)
        min_dim = min(r["effective_dim"] for r in per_round)
        ratio_min = min(r["effective_dim_vs_pooled"] for r in per_round)
        tripwire = collapse_tripwire([r["effective_dim"] for r in per_round], [p["rankme"] for p in pooled], ctx.params.gauge.collapse_drop_fraction)
        for r in per_round:
            ctx.metric("gauge/drift_angle_deg", r["drift_angle_deg_mean"], step=r["round"], round_idx=r["round"])
            ctx.metric("gauge/procrustes_residual", r["procrustes_residual_mean"], step=r["round"], round_idx=r["round"])
            ctx.metric("gauge/effective_dim", r["effective_dim"], step=r["round"], round_idx=r["round"])
            ctx.metric("gauge/effective_dim_vs_pooled", r["effective_dim_vs_pooled"], step=r["round"], round_idx=r["round"])
        ctx.measured["gauge/drift_angle_deg"] = per_round[-1]["drift_angle_deg_mean"]
        # the target is "stays ≥ 50% of the latent dimension over the run": the budget checks the lowest round
        lowest = min_dim / final["latent_dim"]
        ctx.measured["gauge/effective_dim_fraction"] = lowest
        ctx.measured["gauge/effective_dim_vs_pooled"] = ratio_min
        ctx.out.write_json("reports/gauge.json", {"per_round": per_round, "final": final, "collapse_tripwire": tripwire,
                                                  "effective_dim_fraction_min": lowest, "effective_dim_vs_pooled_min": ratio_min})
