"""The report's verdict on whether federation worked, its warnings, plots and plot data files (lensemble/report.py,
tasks/report.py), and the Wilson interval against its closed form.

Run: python -m pytest -x -q tests/test_report_verdict.py
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import special_ortho_group

from lensemble.stats import wilson_interval
from lensemble.gauge import rotation_angles_deg
from lensemble.report import (DRIFT_CHANCE_DEG, Count, federated_loss_rows, fisher_p, gauge_warning_lines, judge,
                              out_of_band_lines, pooled_loss_rows, round_rows, verdict_lines, verdicts)



def _eval(rates: dict[str, float], episodes: int = 16, embodiment: str = "point") -> dict:
    """A one-site eval.json with the given success rate per model."""
    site = {m: {"success_rate": r, "episodes": float(episodes), "ci_low": 0.0, "ci_high": 1.0}
            for m, r in rates.items()}
    return {"sites": {"site_a": {"embodiment": embodiment, **site}}, "embodiments": {embodiment: {}}}


def _fisher_two_sided(a: int, n_a: int, b: int, n_b: int) -> float:
    """Fisher's exact test by hand: the hypergeometric probability of every table with the observed margins that is
    no more likely than the observed one."""
    k, n = a + b, n_a + n_b
    prob = lambda x: math.comb(n_a, x) * math.comb(n_b, k - x) / math.comb(n, k)  # noqa: E731
    observed = prob(a)
    return sum(prob(x) for x in range(max(0, k - n_b), min(k, n_a) + 1) if prob(x) <= observed * (1 + 1e-7))


# ------------------------------------------------------------------ Wilson and Fisher against closed forms


@pytest.mark.parametrize(("k", "n", "z"), [(8, 16, 1.959964), (1, 16, 1.959964), (15, 16, 1.959964), (3, 10, 2.575829)])
def test_wilson_interval_matches_the_closed_form(k, n, z):
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert wilson_interval(k, n, z) == pytest.approx((centre - half, centre + half), abs=1e-6)


def test_wilson_interval_golden_8_of_16_and_edges():
    assert wilson_interval(8, 16) == pytest.approx((0.2799956, 0.7200044), abs=1e-6)
    assert wilson_interval(0, 16)[0] == 0.0 and wilson_interval(16, 16)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize(("a", "b"), [((2, 16), (14, 16)), ((8, 16), (15, 16)), ((7, 16), (9, 16)), ((0, 16), (0, 16))])
def test_fisher_p_matches_the_hypergeometric_sum(a, b):
    assert fisher_p(Count(*a), Count(*b)) == pytest.approx(min(1.0, _fisher_two_sided(*a, *b)), rel=1e-9)


# ------------------------------------------------------------------ the verdict rule on planted cases


def test_federated_equal_to_pooled_worked():
    rates = {"centralized": 0.75, "federated": 0.75, "local_only": 0.75, "oracle": 1.0, "random": 0.0625}
    (v,) = verdicts(_eval(rates))
    assert v.outcome == "worked"
    assert v.readings[0].startswith("federated within 10% of pooled")
    assert v.readings[1].startswith("not distinguishable from local-only")
    assert v.readings[2].startswith("above random")
    assert "**point: federation worked**" in "\n".join(verdict_lines([v]))


def test_federated_far_below_pooled_did_not_work():
    (v,) = verdicts(_eval({"centralized": 0.9, "federated": 0.1, "local_only": 0.9, "oracle": 1.0, "random": 0.0}))
    assert v.counts["federated"] == Count(2, 16) and v.counts["centralized"] == Count(14, 16)  # rate × episodes
    assert v.p_vs_pooled < 0.05 and v.outcome == "did not work"
    assert v.readings[0].startswith("federated below pooled, significantly (0.12 vs 0.88")
    assert v.readings[1].startswith("worse than local-only")
    assert "**point: federation did not work**" in "\n".join(verdict_lines([v]))


def test_federated_at_chance_is_not_above_random():
    v = judge("point", {"centralized": Count(12, 16), "federated": Count(2, 16), "random": Count(1, 16)})
    assert v.outcome == "did not work" and v.p_vs_local is None
    assert v.readings[1] == "local-only not trained" and v.readings[2].startswith("not distinguishable from random")


def test_a_pushing_robots_verdict_reads_how_much_of_a_push_each_model_predicts():
    rates = {"centralized": 0.0625, "federated": 0.0, "local_only": 0.0625, "oracle": 1.0, "random": 0.0}
    ev = _eval(rates, embodiment="pusht")
    ev["sites"]["site_b"] = {**ev["sites"]["site_a"]}
    ev["sites"]["site_a"]["diagnostics"] = {"centralized": {"push_capture": 0.2}, "federated": {"push_capture": 0.1}}
    ev["sites"]["site_b"]["diagnostics"] = {"centralized": {"push_capture": 0.4}, "federated": {"push_capture": 0.3}}
    (v,) = verdicts(ev)
    assert v.outcome == "inconclusive" and v.readings[-1].startswith("its models predict pooled 0.30, federated 0.20 of a push")
    (plain,) = verdicts(_eval(rates, embodiment="point"))  # no push capture: the readings are the rule's alone
    assert not any("push" in r for r in plain.readings) and len(v.readings) == len(plain.readings) + 1


def test_pooled_no_better_than_random_is_inconclusive():
    v = judge("pusht", {m: Count(0, 16) for m in ("centralized", "federated", "local_only", "random")})
    assert v.outcome == "inconclusive" and v.readings[-1].startswith("pooled itself not above random")
    assert v.readings[0].startswith("federated and pooled both never succeeded")


def test_slightly_below_pooled_is_neither_within_nor_significant():
    v = judge("reacher", {"centralized": Count(9, 16), "federated": Count(7, 16), "local_only": Count(8, 16),
                          "random": Count(0, 16)})
    assert v.outcome == "not shown"  # 0.44 < 0.9 × 0.56, though no test separates them at 16 episodes
    assert "federation not shown to work" in "\n".join(verdict_lines([v]))
    # the same rates over 160 episodes separate: then it did not work
    assert judge("reacher", {"centralized": Count(90, 160), "federated": Count(60, 160), "random": Count(0, 160)}).outcome \
        == "did not work"
    assert v.readings[0].startswith("federated below pooled, not significantly")
    assert v.readings[1].startswith("not distinguishable from local-only")


# ------------------------------------------------------------------ budgets and gauge warnings


def _budget(name: str, status: str, value: float | None = 1.0) -> dict:
    return {"name": name, "stage": "gauge", "metric": f"gauge/{name}", "low": 0.8, "high": 1000.0, "unit": "ratio",
            "value": value, "status": status, "response": "investigate"}


def test_out_of_band_budgets_are_listed_with_value_and_band():
    lines = out_of_band_lines([_budget("fine", "within"), _budget("low", "below", 0.164), _budget("high", "above", 2e3),
                               _budget("unmeasured", "not_measured", None), _budget("classless", "no_band", None)])
    text = "\n".join(lines)
    assert len(lines) == 4 and "`fine`" not in text
    assert "`low` (gauge, `gauge/low`): 0.164, below its band [0.8, 1000] ratio" in text
    assert "2000, above its band" in text and "not measured" in text and "no band" in text
    assert out_of_band_lines([_budget("fine", "within")]) == ["- none: all 1 budgets within their bands"]


def test_gauge_warnings_name_their_thresholds():
    rounds = [{"round": 0, "effective_dim": 2.4, "drift_angle_deg_mean": 70.0, "drift_angle_deg_max": 179.0},
              {"round": 1, "effective_dim": 15.0, "drift_angle_deg_mean": 18.0, "drift_angle_deg_max": 138.0}]
    gauge = {"per_round": rounds, "final": {"latent_dim": 64}, "collapse_tripwire": True,
             "effective_dim_fraction_min": 2.4 / 64, "effective_dim_vs_pooled_min": 0.16}
    collapse, dim, drift = gauge_warning_lines(gauge, 0.5)
    assert collapse.startswith("- **WARNING** collapse tripwire TRIPPED") and "0.50 × pooled" in collapse
    assert dim.startswith("- **WARNING** effective dimension: lowest 3.8% of the 64-d latent") and "round 0" in dim
    assert drift.startswith("- ok frame drift") and "18.0°" in drift and "45°" in drift
    # with per-embodiment figures the collapse check says whether a robot collapsed or the robots sit apart
    rounds[0] |= {"effective_dim_vs_pooled": 0.16, "within_vs_pooled": {"point": 1.3, "pusht": 1.4}, "between_fraction": 0.99,
                  "pooled_between_fraction": 0.5}
    rounds[1] |= {"effective_dim_vs_pooled": 0.6, "within_vs_pooled": {"point": 0.7, "pusht": 0.9}, "between_fraction": 0.8,
                  "pooled_between_fraction": 0.45}
    collapse, within, dim, drift = gauge_warning_lines({**gauge, "effective_dim_within_vs_pooled_min": 0.7}, 0.5)
    assert within == ("  - per embodiment, lowest federated ÷ pooled RankMe 0.70 (point, round 1); in the round with the lowest "
                      "whole-probe ratio (round 0) 99% of the probe's variance lies between the embodiments' centroids (pooled 50%)")
    assert "reads each robot's effective dimension" in collapse and "whole-probe ratio 0.16, not read" in collapse
    # a temporal collapse: the reading names the robot, the round and both shares; the tripwire names its reasons
    rounds[1] |= {"temporal_share": {"point": 0.01, "pusht": 0.3}, "pooled_temporal_share": {"point": 0.4, "pusht": 0.3},
                  "temporal_vs_pooled": {"point": 0.025, "pusht": 1.0}}
    reasons = ["round 1: point within-episode variance share 0.03× pooled"]
    collapse, within, temporal, dim, drift = gauge_warning_lines(
        {**gauge, "effective_dim_within_vs_pooled_min": 0.7, "temporal_share_vs_pooled_min": 0.025, "collapse_reasons": reasons}, 0.5)
    assert collapse.startswith("- **WARNING** collapse tripwire TRIPPED") and collapse.endswith(": " + reasons[0])
    assert temporal == ("  - per embodiment, lowest federated ÷ pooled within-episode variance share (what moves from frame to frame) "
                        "0.03 (point, round 1: 1% of its variance against 40%)")


def test_each_robot_trained_alone_is_named_beside_the_federated_and_pooled_dimension():
    rounds = [{"round": 0, "effective_dim": 15.0, "drift_angle_deg_mean": 1.0, "drift_angle_deg_max": 2.0}]
    alone = {"pooled": {"point": 13.6, "pusht": 17.3}, "federated": {"point": 11.5, "pusht": 11.4},
             "local_only": {"site_a": 11.7, "site_b": 11.5}, "embodiment_of": {"site_a": "pusht", "site_b": "point"},
             "federated_vs_local_only": {"site_a": 11.4 / 11.7, "site_b": 1.0}, "federated_vs_local_only_min": 11.4 / 11.7}
    gauge = {"per_round": rounds, "final": {"latent_dim": 64, "dimension_against_alone": alone}, "collapse_tripwire": False,
             "effective_dim_fraction_min": 15.0 / 64, "effective_dim_vs_pooled_min": 0.9}
    collapse, line, dim, drift = gauge_warning_lines(gauge, 0.5)
    assert line == ("  - at the end, each robot's RankMe federated / pooled / its site's encoder trained alone (local-only: no "
                    "federation, no other robot): site_a (pusht) 11.4 / 17.3 / 11.7, site_b (point) 11.5 / 13.6 / 11.5")
    # with the rounds read against the baselines' curves: the lowest round names its site
    rounds.append({**rounds[0], "round": 1, "vs_alone": {"site_a": 0.75, "site_b": 0.6}})
    rounds[0]["vs_alone"] = {"site_a": 1.4, "site_b": 1.2}
    collapse, line, lowest, dim, drift = gauge_warning_lines({**gauge, "effective_dim_vs_local_only_min": 0.6}, 0.5)
    assert lowest == "  - per robot, lowest federated ÷ trained alone at the same point of training 0.60 (site_b, round 1); at the end 0.97"
    # no local-only baselines trained: no line
    assert len(gauge_warning_lines({**gauge, "final": {"latent_dim": 64}}, 0.5)) == 3


def test_drift_chance_level_is_the_mean_angle_of_a_random_rotation():
    rotations = special_ortho_group.rvs(64, size=8, random_state=0)
    angles = [rotation_angles_deg(torch.from_numpy(r))[0].mean() for r in rotations]
    assert float(np.mean(angles)) == pytest.approx(DRIFT_CHANCE_DEG, abs=2.0)


# ------------------------------------------------------------------ plot data


def _federate(rounds: int = 3, h: int = 50) -> dict:
    """Two sites: loss/pred 0.1 (r + 1) and 1 more (site mean 0.1 (r + 1) + 0.5); 1000 and 1001 bytes a round."""
    per_round = [{"round": r, "sites": {"a": {"loss/pred": 0.1 * (r + 1), "comm_bytes": 1000},
                                        "b": {"loss/pred": 0.1 * (r + 1) + 1, "comm_bytes": 1001}}}
                 for r in range(rounds)]
    return {"inner_steps": h, "per_round": per_round}


def test_loss_rows_downsample_and_place_rounds_at_their_last_inner_step():
    central = [{"step": i, "pred": float(i)} for i in range(2000)]
    rows = pooled_loss_rows(central)
    assert len(rows) == 200 and rows[0] == {"step": 0, "pooled": 0.0} and rows[-1] == {"step": 1999, "pooled": 1999.0}
    assert pooled_loss_rows(central[:50]) == [{"step": i, "pooled": float(i)} for i in range(50)]
    fed = federated_loss_rows(_federate())
    assert [r["step"] for r in fed] == [50, 100, 150]
    assert [r["federated"] for r in fed] == pytest.approx([0.6, 0.7, 0.8])  # site mean


def test_round_rows_accumulate_wire_bytes():
    gauge = {"per_round": [{"round": r, "drift_angle_deg_mean": 10.0, "drift_angle_deg_max": 20.0, "effective_dim": 5.0,
                            "pooled_effective_dim": 6.0} for r in range(3)]}
    rows = round_rows(_federate(), gauge)
    assert [r["comm_bytes_cumulative"] for r in rows] == [2001, 4002, 6003]
    assert set(rows[0]) == {"round", "drift_angle_deg_mean", "drift_angle_deg_max", "effective_dim",
                            "pooled_effective_dim", "loss_pred_federated", "comm_bytes_cumulative"}


# ------------------------------------------------------------------ the report stage's files after a whole pipeline


def check_report_outputs(project: Path) -> None:
    """The report stage's verdict, plots and DVC plot data, on a project that ran the whole pipeline
    (tests/test_pipeline.py's end-to-end run calls it)."""
    reports = project / "reports"
    for png in ("success", "losses", "drift", "comm_bytes"):
        assert (reports / "plots" / f"{png}.png").read_bytes()[:4] == b"\x89PNG", png
    success = json.loads((reports / "plots" / "success.json").read_text())
    evaluation = json.loads((reports / "eval.json").read_text())
    assert {r["embodiment"] for r in success} == set(evaluation["embodiments"])
    for r in success:
        assert set(r) == {"label", "embodiment", "model", "success_rate", "ci_low", "ci_high"}
        assert r["label"] == f"{r['embodiment']}/{r['model']}" and r["ci_low"] <= r["success_rate"] <= r["ci_high"]
        assert r["success_rate"] == pytest.approx(evaluation["embodiments"][r["embodiment"]][r["model"]])
    federate = json.loads((reports / "federate.json").read_text())
    rounds = json.loads((reports / "plots" / "rounds.json").read_text())
    assert len(rounds) == federate["rounds"] and rounds[-1]["comm_bytes_cumulative"] == federate["comm_bytes_total"]
    pooled = json.loads((reports / "plots" / "loss_curve.json").read_text())
    assert 0 < len(pooled) <= 200 and all(set(r) == {"step", "pooled"} for r in pooled)
    fed = json.loads((reports / "plots" / "federated_loss.json").read_text())
    assert [r["step"] for r in fed] == [(i + 1) * federate["inner_steps"] for i in range(federate["rounds"])]
    assert all(set(r) == {"step", "federated"} for r in fed)
    text = (reports / "report.md").read_text().splitlines()
    assert text[0] == "# Lensemble run report" and text[2].startswith("Hardware class `")
    assert text[4] == "## Verdict"  # right after the title and the hardware line
    body = "\n".join(text)
    assert "Fisher exact" in body and "### Budgets out of band" in body and "### Collapse and drift" in body
    assert body.index("## Verdict") < body.index("## Stage A") and "plots/success.png" in body
    assert json.loads((reports / "budgets.json").read_text())
