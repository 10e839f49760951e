"""Gauge diagnostics against scipy and planted rotations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.linalg import orthogonal_procrustes
from scipy.stats import special_ortho_group

from lensemble.gauge import (
    collapse_reasons,
    dimension_against_alone,
    drift,
    effective_dim,
    embodiment_spread,
    gauge_over_rounds,
    matched_pooled,
    procrustes,
    rotation_angles_deg,
    rounds_against_alone,
    sample_pairs,
)


def test_procrustes_matches_scipy_and_recovers_a_planted_rotation():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((200, 16))
    r_true = special_ortho_group.rvs(16, random_state=1)
    b = a @ r_true + 1e-3 * rng.standard_normal((200, 16))
    r, residual = procrustes(torch.from_numpy(a), torch.from_numpy(b))
    r_scipy, _ = orthogonal_procrustes(a, b)
    np.testing.assert_allclose(r.numpy(), r_scipy, atol=1e-10)
    np.testing.assert_allclose(r.numpy(), r_true, atol=1e-3)
    assert residual < 2e-3


def test_rotation_angles_of_a_planted_plane_rotation():
    theta = 30.0
    r = torch.eye(4, dtype=torch.float64)
    c, s = math.cos(math.radians(theta)), math.sin(math.radians(theta))
    r[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    angles, reflects = rotation_angles_deg(r)
    assert not reflects
    np.testing.assert_allclose(sorted(angles)[-2:], [theta, theta], atol=1e-9)
    np.testing.assert_allclose(sorted(angles)[:2], [0.0, 0.0], atol=1e-9)


def test_reflection_is_flagged_not_read_as_a_half_turn():
    r = torch.diag(torch.tensor([-1.0, 1.0, 1.0], dtype=torch.float64))
    angles, reflects = rotation_angles_deg(r)
    assert reflects
    assert np.allclose(angles, 0.0)


def test_identical_frames_have_zero_drift():
    z = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    d = drift(z, z)
    assert d["drift_angle_deg"] < 1e-5 and d["procrustes_residual"] < 1e-6 and d["reflection"] == 0.0


def test_effective_dim_closed_forms():
    rng = np.random.default_rng(0)
    # isotropic in 8 dims: participation ratio ≈ 8
    z = torch.from_numpy(rng.standard_normal((20000, 8)))
    assert effective_dim(z)["participation_ratio"] == pytest.approx(8.0, rel=0.02)
    assert effective_dim(z)["rankme"] == pytest.approx(8.0, rel=0.02)
    # rank-1 (collapsed): both measures ≈ 1
    z1 = torch.from_numpy(rng.standard_normal((500, 1)) @ rng.standard_normal((1, 8)))
    assert effective_dim(z1)["participation_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert effective_dim(z1)["rankme"] == pytest.approx(1.0, abs=1e-3)


def test_pair_sampling_is_bounded_and_distinct():
    sites = [f"s{i:02d}" for i in range(40)]
    pairs = sample_pairs(sites, 10, np.random.default_rng(0))
    assert len(pairs) == 10 and len(set(pairs)) == 10 and all(a < b for a, b in pairs)
    assert len(sample_pairs(sites[:3], 10, np.random.default_rng(0))) == 3


def _whole(ratios: list[float]) -> list[dict]:
    """gauge_over_rounds rows without per-embodiment figures (an older run): read on the whole probe."""
    return [{"round": i, "effective_dim_vs_pooled": x} for i, x in enumerate(ratios)]


def test_collapse_reasons_read_the_pooled_model_not_round_one():
    pooled = [10.0, 12.0, 12.0, 12.0]
    assert collapse_reasons(_whole([f / p for f, p in zip([9.0, 11.0, 11.5, 12.0], pooled)]), 0.5) == []
    # a run that starts collapsed and partly recovers: a round-1 reference would never trip on it
    planted = [1.8, 3.0, 9.9, 10.5]
    assert collapse_reasons(_whole([f / p for f, p in zip(planted, pooled)]), 0.5) == [
        "round 0: effective dimension 0.18× pooled", "round 1: effective dimension 0.25× pooled"]
    assert min(planted[1:]) >= 0.5 * planted[0]  # ... while "half of round 1" stays quiet
    # a late collapse trips too; the threshold is (1 − drop_fraction)
    assert collapse_reasons(_whole([0.9, 0.9, 0.42, 0.33]), 0.5) == ["round 2: effective dimension 0.42× pooled",
                                                                     "round 3: effective dimension 0.33× pooled"]
    assert collapse_reasons(_whole([0.9, 0.9, 0.42, 0.33]), 0.6) == ["round 3: effective dimension 0.33× pooled"]


def test_collapse_tripwire_fires_on_a_planted_collapsed_embedding():
    gen = torch.Generator().manual_seed(0)
    healthy = torch.randn(256, 16, generator=gen)
    collapsed = torch.randn(256, 1, generator=gen) @ torch.randn(1, 16, generator=gen) + 0.01 * torch.randn(256, 16, generator=gen)
    pooled = effective_dim(healthy)["rankme"]
    assert collapse_reasons(_whole([effective_dim(collapsed)["rankme"] / pooled]), 0.5)
    assert not collapse_reasons(_whole([effective_dim(healthy[torch.randperm(256, generator=gen)])["rankme"] / pooled]), 0.5)


def _episodes(gen: torch.Generator, episodes: int, frames: int, fixed: float, moving: float, dim: int = 8) -> torch.Tensor:
    """Probe embeddings [episodes·frames, dim]: a per-episode constant (the goal, the scene) of std `fixed` plus what
    moves from frame to frame, of std `moving`."""
    const = fixed * torch.randn(episodes, 1, dim, generator=gen, dtype=torch.float64)
    return (const + moving * torch.randn(episodes, frames, dim, generator=gen, dtype=torch.float64)).reshape(-1, dim)


def test_temporal_share_is_the_within_episode_variance_share():
    gen = torch.Generator().manual_seed(3)
    E, F = 200, 8
    z = _episodes(gen, E, F, fixed=1.0, moving=2.0)
    ids = [e for e in range(E) for _ in range(F)]
    s = embodiment_spread(z, ["point"] * len(ids), ids)
    # closed form: within an episode the F frames keep (F−1)/F of the moving variance 4; the whole spread is 1 + 4
    assert s["temporal_share"]["point"] == pytest.approx(4 * (F - 1) / F / (1 + 4), rel=0.03)
    # exactly, on any embedding: the within-episode sum of squares over the embodiment's
    within = sum(float((z[e * F:(e + 1) * F] - z[e * F:(e + 1) * F].mean(0)).pow(2).sum()) for e in range(E))
    assert s["temporal_share"]["point"] == pytest.approx(within / float((z - z.mean(0)).pow(2).sum()), rel=1e-12)
    # an encoder that sees only what is fixed in an episode: healthy RankMe across episodes, nothing moves
    frozen = _episodes(gen, E, F, fixed=1.0, moving=0.0)
    f = embodiment_spread(frozen, ["point"] * len(ids), ids)
    assert f["temporal_share"]["point"] < 1e-12 and f["by_embodiment"]["point"] > 7.0
    # without episode ids, or with one probe episode, there is no temporal reading; a wrong count is an error
    assert "temporal_share" not in embodiment_spread(z, ["point"] * len(ids))
    assert embodiment_spread(z[:F], ["point"] * F, ids[:F])["temporal_share"] == {}
    with pytest.raises(ValueError, match="3 probe episode ids for 1600"):
        embodiment_spread(z, ["point"] * len(ids), ids[:3])


def test_gauge_over_rounds_trips_on_a_planted_temporal_collapse_and_not_on_a_healthy_run():
    """A federated encoder whose latent stops moving within episodes (stop 34: 1-step rollout 27× copy) keeps each
    robot's RankMe; the within-episode share against the pooled model's is what trips."""
    gen = torch.Generator().manual_seed(4)
    E, F = 16, 8
    ids = [e for e in range(2 * E) for _ in range(F)]
    labels = ["point"] * (E * F) + ["reacher"] * (E * F)

    def spread(moving_point: float) -> dict:
        z = torch.cat([_episodes(gen, E, F, 1.0, moving_point), _episodes(gen, E, F, 1.0, 1.0) + 50.0])
        return embodiment_spread(z, labels, ids)

    pooled = [{**p, **spread(1.0)} for p in _pooled_curve([8.0, 8.0])]
    rounds = [_round(1, 8.0), _round(2, 8.0)]
    for r, moving in zip(rounds, (1.0, 0.05)):  # round 2: the point mass's latent nearly stops moving
        r["gauge"]["embodiments"] = spread(moving)
    g = gauge_over_rounds(rounds, pooled, 0.5)
    assert g.within_vs_pooled_min > 0.8  # every robot's RankMe is healthy ...
    assert g.per_round[1]["temporal_vs_pooled"]["point"] < 0.01 < 0.5 < g.per_round[1]["temporal_vs_pooled"]["reacher"]
    assert g.temporal_vs_pooled_min == g.per_round[1]["temporal_vs_pooled"]["point"]
    assert g.collapse_tripwire and len(g.collapse_reasons) == 1  # ... and the tripwire names what stopped moving
    assert g.collapse_reasons[0].startswith("round 2: point within-episode variance share 0.0")
    rounds[1]["gauge"]["embodiments"] = spread(1.0)
    assert not gauge_over_rounds(rounds, pooled, 0.5).collapse_tripwire


def test_rounds_read_the_pooled_checkpoint_at_the_same_fraction_of_training():
    curve = [{"step": s, "rankme": float(s)} for s in (200, 400, 600, 800, 1000)]
    assert [c["step"] for c in matched_pooled(curve, 5)] == [200, 400, 600, 800, 1000]
    assert [c["step"] for c in matched_pooled(curve, 2)] == [400, 1000]  # a tie (0.4 vs 0.6 of 0.5) takes the earlier
    assert [c["step"] for c in matched_pooled(curve, 10)][:2] == [200, 200]


def _round(idx: int, rankme: float, angles: tuple[float, float] = (10.0, 20.0)) -> dict:
    """A round record as the federate stage writes it to reports/federate.json (two sites)."""
    sites = {f"s{i}": {"gauge/drift_angle_deg": a, "gauge/drift_angle_max_deg": 2 * a, "gauge/procrustes_residual": a / 100}
             for i, a in enumerate(angles)}
    return {"round": idx, "sites": sites, "gauge": {"effective_dim": {"rankme": rankme, "participation_ratio": rankme / 2},
                                                   "pairs": 1}}


def _pooled_curve(rankmes: list[float], steps_per_round: int = 50) -> list[dict]:
    """Stage A's effective_dim_curve in reports/centralized.json: one point per round mark."""
    return [{"step": steps_per_round * (i + 1), "rankme": r, "participation_ratio": r / 2} for i, r in enumerate(rankmes)]


def test_gauge_over_rounds_summarises_each_round_against_the_pooled_model():
    rounds = [_round(1, 3.0), _round(2, 6.0, angles=(30.0, 50.0))]
    g = gauge_over_rounds(rounds, _pooled_curve([4.0, 8.0]), 0.5)
    assert g.per_round[1] == {"round": 2, "drift_angle_deg_mean": 40.0, "drift_angle_deg_max": 100.0,
                              "procrustes_residual_mean": 0.4, "effective_dim": 6.0, "participation_ratio": 3.0, "pairs": 1,
                              "pooled_effective_dim": 8.0, "effective_dim_vs_pooled": 0.75}
    assert (g.effective_dim_min, g.effective_dim_vs_pooled_min, g.collapse_tripwire) == (3.0, 0.75, False)


def test_gauge_over_rounds_trips_on_a_planted_collapse_and_not_on_a_healthy_run():
    pooled = _pooled_curve([2.0, 4.0, 8.0, 16.0])  # the pooled model's dimension grows over training
    healthy = [_round(i + 1, d) for i, d in enumerate([1.5, 3.5, 7.0, 14.0])]
    g = gauge_over_rounds(healthy, pooled, 0.5)
    assert not g.collapse_tripwire
    # round 1 at 1.5 is under half the pooled model's final 16: the reference is the same fraction of training
    assert healthy[0]["gauge"]["effective_dim"]["rankme"] < 0.5 * pooled[-1]["rankme"]
    collapsed = [_round(i + 1, d) for i, d in enumerate([1.5, 3.5, 3.0, 2.0])]
    g = gauge_over_rounds(collapsed, pooled, 0.5)
    assert g.collapse_tripwire and g.effective_dim_vs_pooled_min == 0.125


def test_gauge_over_rounds_compares_with_the_pooled_curve_not_round_one():
    pooled = _pooled_curve([10.0, 12.0, 12.0, 12.0])
    # starts collapsed and partly recovers: never below half of its own round 1, far below the pooled model
    planted = [_round(i + 1, d) for i, d in enumerate([1.0, 2.0, 4.0, 5.0])]
    assert gauge_over_rounds(planted, pooled, 0.5).collapse_tripwire
    # the same run against a pooled model that was just as low stays quiet
    assert not gauge_over_rounds(planted, _pooled_curve([1.0, 2.0, 4.0, 5.0]), 0.5).collapse_tripwire
    # an ablation with fewer rounds than the curve has marks reads the pooled point at the same fraction
    g = gauge_over_rounds(planted[:2], _pooled_curve([1.0, 2.0, 30.0, 3.0]), 0.5)
    assert [r["pooled_effective_dim"] for r in g.per_round] == [2.0, 3.0] and not g.collapse_tripwire


def _planted_robots(gen: torch.Generator, collapse: str | None = None) -> tuple[torch.Tensor, list[str]]:
    """Three robots, 400 probe frames each: isotropic 8-d spread (or rank 1 for `collapse`) about centroids 100 apart."""
    zs, labels = [], []
    for k, emb in enumerate(("point", "pusht", "reacher")):
        z = torch.randn(400, 8, generator=gen, dtype=torch.float64)
        if emb == collapse:
            z = z[:, :1] * torch.ones(1, 8, dtype=torch.float64)
        z[:, k] += 100.0
        zs.append(z)
        labels += [emb] * 400
    return torch.cat(zs), labels


def test_embodiment_spread_separates_robots_far_apart_from_a_collapsed_robot():
    gen = torch.Generator().manual_seed(5)
    z, labels = _planted_robots(gen)
    s = embodiment_spread(z, labels)
    # the whole probe reads the three centroids (2 directions after centring); every robot keeps its 8 dimensions
    assert effective_dim(z)["rankme"] < 3.0
    assert all(v == pytest.approx(8.0, rel=0.05) for v in s["by_embodiment"].values())
    # between share: centroids 100·e_k sit 100·sqrt(2/3) from their mean, against a within variance of 8
    assert s["between_fraction"] == pytest.approx(1 - 8 / (8 + 1e4 * 2 / 3), abs=2e-4)
    assert all(v == pytest.approx(math.sqrt(8), rel=0.05) for v in s["within_rms"].values())
    collapsed = embodiment_spread(*_planted_robots(gen, collapse="pusht"))
    assert collapsed["by_embodiment"]["pusht"] == pytest.approx(1.0, abs=1e-3)
    assert min(collapsed["by_embodiment"].values()) == collapsed["by_embodiment"]["pusht"]
    with pytest.raises(ValueError, match="3 probe labels for 1200"):
        embodiment_spread(z, labels[:3])


def test_each_robot_is_read_against_its_site_trained_alone():
    gen = torch.Generator().manual_seed(6)
    pooled, labels = _planted_robots(gen)
    federated, _ = _planted_robots(gen, collapse="pusht")
    rows = {emb: torch.tensor([lab == emb for lab in labels]) for emb in ("point", "pusht", "reacher")}
    # site_p trained alone the same point embedding the federation gives it; site_t's alone encoder spreads pusht over 8
    # dimensions where the federated one keeps 1; site_r's alone encoder holds reacher on 2 of the federated 8
    alone_r = federated[rows["reacher"]].clone()
    alone_r[:, 2:] = 0.0
    alone = {"site_p": ("point", federated[rows["point"]]), "site_t": ("pusht", pooled[rows["pusht"]]),
             "site_r": ("reacher", alone_r)}
    # each baseline's curve ends on its final encoder's RankMe (earlier rounds read, in any order, but not used here)
    local_only = {site: {"embodiment": emb, "effective_dim_curve": [{"round": 1, "rankme": effective_dim(z)["rankme"]},
                                                                    {"round": 0, "rankme": 99.0}]}
                  for site, (emb, z) in alone.items()}
    a = dimension_against_alone(embodiment_spread(pooled, labels)["by_embodiment"], embodiment_spread(federated, labels)["by_embodiment"],
                                {**local_only, "site_x": {"steps": 3}})  # a baseline without a curve is not read
    assert a["embodiment_of"] == {"site_p": "point", "site_r": "reacher", "site_t": "pusht"}
    assert a["federated_vs_local_only"]["site_p"] == 1.0  # the same embeddings: exactly the same RankMe
    rank_one = effective_dim(federated[rows["pusht"]])["rankme"]
    assert rank_one == pytest.approx(1.0, abs=1e-6)  # a rank-1 spread has one singular value: RankMe exactly 1
    assert a["federated_vs_local_only"]["site_t"] == pytest.approx(rank_one / a["local_only"]["site_t"])
    assert a["local_only"]["site_t"] == pytest.approx(8.0, rel=0.05) and a["pooled"]["pusht"] == a["local_only"]["site_t"]
    assert a["local_only"]["site_r"] == pytest.approx(2.0, rel=0.05)  # 2 isotropic directions
    assert a["federated_vs_local_only"]["site_r"] == pytest.approx(4.0, rel=0.1)
    assert a["federated_vs_local_only_min"] == a["federated_vs_local_only"]["site_t"]
    assert dimension_against_alone({}, {}, {})["federated_vs_local_only_min"] is None


def test_every_round_reads_each_robot_against_its_site_trained_alone_at_the_same_mark():
    per_round = [{"round": 0, "effective_dim_by_embodiment": {"point": 8.0, "pusht": 6.0}},
                 {"round": 1, "effective_dim_by_embodiment": {"point": 4.0, "pusht": 6.0}},
                 {"round": 2}]  # a round without per-embodiment figures gets no reading
    local = {"site_b": {"embodiment": "point", "effective_dim_curve": [{"round": r, "rankme": x} for r, x in ((0, 8.0), (1, 10.0), (2, 10.0))]},
             "site_a": {"embodiment": "pusht", "effective_dim_curve": [{"round": 1, "rankme": 5.0}, {"round": 0, "rankme": 4.0}]},
             "site_x": {"steps": 3}}  # a baseline that recorded no curve is not read
    assert rounds_against_alone(per_round, local) == 0.4  # point at round 1: 4 against 10 trained alone
    assert per_round[0]["vs_alone"] == {"site_a": 1.5, "site_b": 1.0}  # each round against the curve's same round, in any order
    assert per_round[1]["vs_alone"] == {"site_a": 1.2, "site_b": 0.4}
    assert "vs_alone" not in per_round[2]
    untouched = [{"round": 0, "effective_dim_by_embodiment": {"point": 8.0}}]
    assert rounds_against_alone(untouched, {}) is None and "vs_alone" not in untouched[0]


def test_gauge_over_rounds_reads_each_embodiment_against_the_pooled_model():
    def spread(by: dict, between: float) -> dict:
        return {"by_embodiment": by, "within_rms": {e: 1.0 for e in by}, "between_fraction": between}

    rounds = [_round(1, 2.0), _round(2, 6.0)]
    rounds[0]["gauge"]["embodiments"] = spread({"a": 9.0, "b": 6.0}, 0.99)
    rounds[1]["gauge"]["embodiments"] = spread({"a": 8.0, "b": 9.0}, 0.5)
    pooled = [{**p, **spread(by, 0.4)} for p, by in zip(_pooled_curve([8.0, 8.0]), ({"a": 6.0, "b": 10.0}, {"a": 10.0, "b": 10.0}))]
    g = gauge_over_rounds(rounds, pooled, 0.5)
    assert g.per_round[0]["within_vs_pooled"] == {"a": 1.5, "b": 0.6}
    assert g.per_round[1]["within_vs_pooled"] == {"a": 0.8, "b": 0.9}
    assert (g.per_round[0]["between_fraction"], g.per_round[0]["pooled_between_fraction"]) == (0.99, 0.4)
    assert g.within_vs_pooled_min == 0.6 and g.effective_dim_vs_pooled_min == 0.25
    # the whole probe at 0.25× pooled with every robot at ≥ 0.6×: the robots sit apart, nothing collapsed
    assert not g.collapse_tripwire and g.collapse_reasons == ()
    rounds[1]["gauge"]["embodiments"] = spread({"a": 8.0, "b": 4.0}, 0.5)  # one robot at 0.4× pooled trips it
    assert gauge_over_rounds(rounds, pooled, 0.5).collapse_reasons == ("round 2: b effective dimension 0.40× pooled",)
    # records without per-embodiment figures (an older run) summarise as before
    assert gauge_over_rounds([_round(1, 2.0)], _pooled_curve([8.0]), 0.5).within_vs_pooled_min is None
