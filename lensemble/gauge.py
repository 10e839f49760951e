"""Gauge diagnostics: frame drift between embedding frames, effective dimension and the collapse tripwire.

SIGReg's isotropic target is rotation-invariant, so two sites' encoders can agree up to an
orthogonal map of the latent space. Orthogonal Procrustes finds that map; its angles say how far
a site's frame has turned, its residual how much is not a rotation at all.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lensemble.config import Params


def procrustes(a_ND: torch.Tensor, b_ND: torch.Tensor) -> tuple[torch.Tensor, float]:
    """R = argmin_{RᵀR=I} ‖a R − b‖_F (float64) and the relative residual ‖a R − b‖_F / ‖b‖_F."""
    a = a_ND.to(torch.float64)
    b = b_ND.to(torch.float64)
    u, _, vh = torch.linalg.svd(a.T @ b)
    r = u @ vh
    residual = float(torch.linalg.norm(a @ r - b) / torch.linalg.norm(b).clamp_min(1e-30))
    return r, residual


def rotation_angles_deg(r_DD: torch.Tensor) -> tuple[np.ndarray, bool]:
    """Principal rotation angles in degrees (one per conjugate eigenvalue pair) and whether R reflects.

    A reflection (det R = −1) is reported as such, not folded into an angle: its −1 eigenvalue would
    otherwise read as a 180° turn.
    """
    r = r_DD.to(torch.float64).numpy()
    reflects = bool(np.linalg.det(r) < 0)
    eig = np.linalg.eigvals(r)
    angles = np.degrees(np.abs(np.angle(eig)))
    if reflects:
        # drop one eigenvalue closest to −1: the reflection axis
        angles = np.delete(angles, int(np.argmin(np.abs(eig + 1.0))))
    return np.sort(angles), reflects


def drift(a_ND: torch.Tensor, b_ND: torch.Tensor) -> dict[str, float]:
    """Mean and max rotation angle (degrees), relative residual and reflection flag of a vs b."""
    r, residual = procrustes(a_ND, b_ND)
    angles, reflects = rotation_angles_deg(r)
    return {
        "drift_angle_deg": float(angles.mean()) if angles.size else 0.0,
        "drift_angle_max_deg": float(angles.max()) if angles.size else 0.0,
        "procrustes_residual": residual,
        "reflection": float(reflects),
    }


def effective_dim(z_ND: torch.Tensor) -> dict[str, float]:
    """RankMe (exp entropy of normalised singular values) and participation ratio of the covariance."""
    z = z_ND.to(torch.float64)
    z = z - z.mean(0, keepdim=True)
    s = torch.linalg.svdvals(z)
    p = s / s.sum().clamp_min(1e-30)
    p = p[p > 0]
    rankme = float(torch.exp(-(p * torch.log(p)).sum()))
    lam = s * s
    pr = float(lam.sum() ** 2 / (lam * lam).sum().clamp_min(1e-30))
    return {"rankme": rankme, "participation_ratio": pr}


def embodiment_spread(z_PD: torch.Tensor, labels: Sequence[str], episodes: Sequence[int] = ()) -> dict:
    """The probe's effective dimension read per embodiment: each embodiment's own RankMe (`by_embodiment`), its rms
    spread about its centroid (`within_rms`), and the share of the probe's variance that lies between the
    embodiments' centroids (`between_fraction`). A whole-probe RankMe near the number of embodiments with a
    between share near 1 and healthy per-embodiment RankMe means the robots sit far apart, not that any
    robot's representation collapsed; per-embodiment RankMe falling is collapse.

    Given each row's probe episode (`episodes`, rows of an episode in time order), also `temporal_share`: the
    share of each embodiment's variance that lies within its episodes, about each episode's own mean, i.e.
    what changes over time. An encoder that sees only what is fixed in an episode (the goal, the scene) and
    not what moves keeps a healthy RankMe across episodes while this share falls to 0: a temporal collapse,
    under which the latent barely moves from frame to frame and "nothing moves" is the best prediction. A robot
    with a single probe episode has no reading (its one episode holds all of its variance)."""
    if len(labels) != z_PD.shape[0]:
        raise ValueError(f"{len(labels)} probe labels for {z_PD.shape[0]} embeddings")
    if episodes and len(episodes) != z_PD.shape[0]:
        raise ValueError(f"{len(episodes)} probe episode ids for {z_PD.shape[0]} embeddings")
    z = z_PD.to(torch.float64)
    episode_P = torch.tensor(list(episodes)) if episodes else None
    total = float((z - z.mean(0)).pow(2).sum(1).mean())
    by, rms, temporal, within = {}, {}, {}, 0.0
    for emb in sorted(set(labels)):
        rows = torch.tensor([lab == emb for lab in labels])
        zz = z[rows]
        sq = (zz - zz.mean(0)).pow(2).sum(1)
        by[emb] = effective_dim(zz)["rankme"]
        rms[emb] = float(sq.mean().sqrt())
        spread = float(sq.sum())
        within += spread
        ids = None if episode_P is None else episode_P[rows]
        if ids is not None and ids.unique().numel() > 1:  # one probe episode holds all of its robot's variance: no reading
            moving = sum(float((zz[ids == e] - zz[ids == e].mean(0)).pow(2).sum()) for e in ids.unique())
            temporal[emb] = moving / spread if spread > 0 else 0.0
    between = 1.0 - within / z.shape[0] / total if total > 0 else 0.0
    out = {"by_embodiment": by, "within_rms": rms, "between_fraction": between}
    return {**out, "temporal_share": temporal} if episodes else out


def collapse_reasons(per_round: list[dict], drop_fraction: float) -> list[str]:
    """Every reading of `gauge_over_rounds`' rows below (1 − drop_fraction) × the pooled model's at the same point
    of training, as "round R: what, ratio"; empty when the tripwire stays quiet. Collapse is read against what
    the pooled data supports, not against round 1 (a run that starts collapsed and partly recovers would
    never trip a round-1 reference).

    Rows that carry per-embodiment figures are read per robot: each robot's RankMe (`within_vs_pooled`, a
    dimensional collapse) and, where recorded, its within-episode variance share (`temporal_vs_pooled`, a
    temporal collapse). The whole-probe RankMe is not read there: with several robots it also falls when
    their centroids move apart, which collapses nothing (it stays a reported figure). Rows without
    per-embodiment figures (an older run) are read on the whole probe."""
    floor = 1.0 - drop_fraction
    reasons = []
    for row in per_round:
        r = row["round"]
        if "within_vs_pooled" not in row:
            if row["effective_dim_vs_pooled"] < floor:
                reasons.append(f"round {r}: effective dimension {row['effective_dim_vs_pooled']:.2f}× pooled")
            continue
        reasons += [f"round {r}: {emb} effective dimension {v:.2f}× pooled" for emb, v in sorted(row["within_vs_pooled"].items()) if v < floor]
        reasons += [f"round {r}: {emb} within-episode variance share {v:.2f}× pooled"
                    for emb, v in sorted(row.get("temporal_vs_pooled", {}).items()) if v < floor]
    return reasons


def matched_pooled(curve: list[dict], rounds: int) -> list[dict]:
    """For each round r = 1..R, the pooled checkpoint at the nearest fraction r/R of Stage A's steps (the curve
    is taken at the main run's round marks; an ablation point with another R reads the nearest)."""
    total = curve[-1]["step"]
    return [min(curve, key=lambda c: abs(c["step"] / total - r / rounds)) for r in range(1, rounds + 1)]


def round_summary(record: dict) -> dict:
    """One round's gauge row from its `reports/federate.json` record: drift over sites, effective dimension (and,
    where the round recorded it, per embodiment)."""
    sites = record["sites"].values()
    angles = [s["gauge/drift_angle_deg"] for s in sites]
    spread = record["gauge"].get("embodiments")
    extra = {} if spread is None else {"effective_dim_by_embodiment": spread["by_embodiment"], "between_fraction": spread["between_fraction"],
                                       "within_rms": spread["within_rms"]}
    if spread is not None and "temporal_share" in spread:
        extra["temporal_share"] = spread["temporal_share"]
    return {**extra, "round": record["round"], "drift_angle_deg_mean": sum(angles) / len(angles),
            "drift_angle_deg_max": max(s["gauge/drift_angle_max_deg"] for s in sites),
            "procrustes_residual_mean": sum(s["gauge/procrustes_residual"] for s in sites) / len(angles),
            "effective_dim": record["gauge"]["effective_dim"]["rankme"],
            "participation_ratio": record["gauge"]["effective_dim"]["participation_ratio"],
            "pairs": record["gauge"]["pairs"]}


@dataclass(frozen=True)
class RoundGauge:
    """The federation's per-round gauge read against the pooled (Stage A) model at the same fraction of training."""

    per_round: list[dict]  # round_summary rows plus pooled_effective_dim and effective_dim_vs_pooled
    effective_dim_min: float  # lowest federated RankMe over the run
    effective_dim_vs_pooled_min: float  # lowest federated ÷ pooled RankMe over the run
    collapse_tripwire: bool
    within_vs_pooled_min: float | None = None  # lowest per-embodiment federated ÷ pooled RankMe over rounds and embodiments
    temporal_vs_pooled_min: float | None = None  # lowest per-embodiment federated ÷ pooled within-episode variance share
    collapse_reasons: tuple[str, ...] = ()  # what tripped the tripwire (collapse_reasons), empty when quiet


def gauge_over_rounds(rounds: list[dict], pooled_curve: list[dict], drop_fraction: float) -> RoundGauge:
    """Summarise every round of `reports/federate.json` and trip on collapse against Stage A's effective-dimension
    curve (`effective_dim_curve` of `reports/centralized.json`), never against round 1 (`collapse_reasons`)."""
    per_round = [round_summary(r) for r in rounds]
    pooled = matched_pooled(pooled_curve, len(per_round))
    for row, point in zip(per_round, pooled):
        row["pooled_effective_dim"] = point["rankme"]
        row["effective_dim_vs_pooled"] = row["effective_dim"] / max(point["rankme"], 1e-12)
        if "effective_dim_by_embodiment" in row and "by_embodiment" in point:
            row["pooled_by_embodiment"], row["pooled_between_fraction"] = point["by_embodiment"], point["between_fraction"]
            row["within_vs_pooled"] = {e: v / max(point["by_embodiment"][e], 1e-12) for e, v in row["effective_dim_by_embodiment"].items()}
        if "temporal_share" in row and "temporal_share" in point:
            row["pooled_temporal_share"] = point["temporal_share"]
            row["temporal_vs_pooled"] = {e: v / max(point["temporal_share"][e], 1e-12) for e, v in row["temporal_share"].items()}
    within = [v for r in per_round for v in r.get("within_vs_pooled", {}).values()]
    temporal = [v for r in per_round for v in r.get("temporal_vs_pooled", {}).values()]
    reasons = collapse_reasons(per_round, drop_fraction)
    return RoundGauge(per_round=per_round, effective_dim_min=min(r["effective_dim"] for r in per_round),
                      effective_dim_vs_pooled_min=min(r["effective_dim_vs_pooled"] for r in per_round),
                      collapse_tripwire=bool(reasons), within_vs_pooled_min=min(within) if within else None,
                      temporal_vs_pooled_min=min(temporal) if temporal else None, collapse_reasons=tuple(reasons))


def rounds_against_alone(per_round: list[dict], local_only: Mapping[str, dict]) -> float | None:
    """Adds to each round row of `gauge_over_rounds` `vs_alone` {site: the federated RankMe of the site's robot ÷ the
    RankMe of its site's encoder trained alone at the same mark} from the local-only results of `reports/federate.json`
    (`effective_dim_curve`, `embodiment`); returns the lowest over rounds and sites, None when no baseline recorded
    its curve (the row is left as it was)."""
    curves = {site: ({c["round"]: c["rankme"] for c in r["effective_dim_curve"]}, r["embodiment"])
              for site, r in sorted(local_only.items()) if r.get("effective_dim_curve")}
    lows = []
    for row in per_round:
        by = row.get("effective_dim_by_embodiment", {})
        ratios = {site: by[emb] / max(curve[row["round"]], 1e-12) for site, (curve, emb) in curves.items()
                  if emb in by and row["round"] in curve}
        if ratios:
            row["vs_alone"] = ratios
            lows.append(min(ratios.values()))
    return min(lows) if lows else None


def sample_pairs(sites: list[str], num_pairs: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """A fixed-size sample of distinct site pairs (never all O(C²) when C is large)."""
    all_pairs = [(a, b) for i, a in enumerate(sites) for b in sites[i + 1 :]]
    if len(all_pairs) <= num_pairs:
        return all_pairs
    idx = rng.choice(len(all_pairs), size=num_pairs, replace=False)
    return [all_pairs[i] for i in sorted(idx)]


def dimension_against_alone(pooled: Mapping[str, float], federated: Mapping[str, float], local_only: Mapping[str, dict]) -> dict:
    """Each robot's effective dimension (RankMe) at the end of training in the pooled encoder and the federated one (per
    embodiment, `embodiment_spread`'s `by_embodiment`) and in the encoder its site trained on it alone: the last point of
    each local-only baseline's `effective_dim_curve` (its final model), from `reports/federate.json`.

    The reference that separates federation from the mixture: a pooled encoder spreads each robot over more dimensions
    than one trained on that robot alone, so federated ÷ pooled falls below 1 where federation costs nothing;
    federated ÷ alone (`federated_vs_local_only`, per site) reads what federating the encoder did to the robot."""
    alone = {site: (r["embodiment"], max(r["effective_dim_curve"], key=lambda c: c["round"])["rankme"])
             for site, r in sorted(local_only.items()) if r.get("effective_dim_curve")}
    ratio = {site: federated[emb] / rankme for site, (emb, rankme) in alone.items()}
    return {"pooled": dict(pooled), "federated": dict(federated), "local_only": {site: x for site, (_, x) in alone.items()},
            "embodiment_of": {site: emb for site, (emb, _) in alone.items()},
            "federated_vs_local_only": ratio, "federated_vs_local_only_min": min(ratio.values()) if ratio else None}


def pool_tokens(z_PND: torch.Tensor) -> torch.Tensor:
    """Per-frame embedding for the diagnostics: the mean over tokens, [P, D]."""
    return z_PND.mean(1)


def pooled_checkpoints(params: Params) -> list[int]:
    """Stage A steps at which the pooled model is read against federated round r = 1..R: the same fraction of training."""
    R, S = params.federate.rounds, params.centralized.steps
    return [max(1, round(S * r / R)) for r in range(1, R + 1)]
