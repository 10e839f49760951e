"""DP in the pipeline: clipping in site_train's Δ path, the noise shares through the real codecs and round
driver, reproducible seeding, the per-round accountant against Opacus, the report line and the ε budget."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from opacus.accountants import RDPAccountant

from lensemble.budgets import evaluate_budgets, load_budgets
from lensemble.config import parse_params
from lensemble.errors import ConfigError
from lensemble.federation import dp
from lensemble.federation.rounds import InlineSites, NesterovStep, SiteEndpoint, run_round
from lensemble.federation.transport import RoundContext, param_spec
from lensemble.federation.transports import aggregator_codec, site_codec
from lensemble.report import privacy_lines

REPO = Path(__file__).resolve().parents[1]
SITES = ("a", "b", "c")
SPEC_STATE = {"w": torch.zeros(12_000), "b": torch.zeros(40, 200)}  # 20,000 parameters
DELTA = 1e-5


def _params(**sections):
    raw = {"data": {"sites": [{"name": "a", "embodiment": "grid_point", "episodes": 2}]}, **sections}
    return parse_params(raw)


def _delta(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(t.shape, generator=g) for n, t in sorted(SPEC_STATE.items())}


class Dropping(SiteEndpoint):
    """A site that never sends its key share (a dropout after training)."""

    def key_share(self, ctx):
        raise TimeoutError("site unreachable")


def _aggregate(p, deltas: dict, transport: str = "secure_int8", drop: str | None = None, run_id: str = "run") -> dict:
    """Δ̄ of one round through the real site codecs (wrapped by `private_codec`), the aggregator and run_round.

    Zero parameters, outer lr 1 and momentum 0 make the new parameters equal Δ̄."""
    keys = {s: Ed25519PrivateKey.generate() for s in deltas}
    public = {s: k.public_key() for s, k in keys.items()}
    pool = InlineSites({s: (Dropping if s == drop else SiteEndpoint)(
        s, dp.private_codec(site_codec(transport, 4096, s, keys[s], public), p), lambda s=s: deltas[s], public_key=public[s])
        for s in sorted(deltas)})
    params = {n: torch.zeros_like(t) for n, t in SPEC_STATE.items()}
    res = run_round(run_id, 3, sorted(deltas), param_spec(params), pool, aggregator_codec(transport, 4096), params, None,
                    NesterovStep(lr=1.0, momentum=0.0))
    assert (drop is None) == (drop not in res.dropped)
    return res.params


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([state[n].reshape(-1) for n in sorted(state)])


# ------------------------------------------------------------ off by default: the Δ path is not touched


def test_default_params_leave_the_delta_and_codec_untouched():
    p = _params()
    assert not p.dp.enabled and p.federate.update_clip_norm is None and dp.update_clip(p) is None
    delta = _delta(0)
    same, metrics = dp.clip_update(delta, dp.update_clip(p))
    assert same is delta and metrics == {}
    codec = site_codec("secure_int8", 4096, "a", Ed25519PrivateKey.generate(), {})
    assert dp.private_codec(codec, p) is codec
    assert dp.round_privacy(p, RoundContext("r", 0, SITES, param_spec(SPEC_STATE)), {s: {} for s in SITES}) == {}
    assert dp.run_privacy(p, [{"round": 0}]) == {}


def test_a_bound_that_does_not_bind_multiplies_nothing():
    delta = _delta(0)
    norm = dp.l2_norm(delta)
    kept, metrics = dp.clip_update(delta, 2 * norm)
    assert all(kept[n] is delta[n] for n in delta)  # the same tensors, not copies scaled by 1.0
    assert metrics == {"dp/update_norm": norm, "dp/clipped": 0.0}


def test_clip_only_bounds_the_norm_without_noise():
    p = _params(federate={"update_clip_norm": 0.5})
    assert dp.update_clip(p) == 0.5
    clipped, metrics = dp.clip_update(_delta(0), dp.update_clip(p))
    assert dp.l2_norm(clipped) == pytest.approx(0.5, rel=1e-6) and metrics["dp/clipped"] == 1.0
    codec = site_codec("fp32", 4096, "a", Ed25519PrivateKey.generate(), {})
    assert dp.private_codec(codec, p) is codec  # no noise without dp.enabled
    deltas = {s: _delta(i, 1e-3) for i, s in enumerate(SITES)}
    mean = _aggregate(p, deltas, transport="fp32")
    expected = sum(_flat(d) for d in deltas.values()) / 3
    assert torch.allclose(_flat(mean), expected, atol=1e-9)


def test_dp_clip_norm_takes_precedence_over_update_clip_norm():
    p = _params(federate={"update_clip_norm": 5.0}, dp={"enabled": True, "clip_norm": 0.25})
    assert dp.update_clip(p) == 0.25


# ------------------------------------------------------------ the noise through the real exchange


@pytest.mark.parametrize("transport", ["secure_int8", "fp32"])
def test_aggregate_noise_has_noise_multiplier_z(transport):
    z, s = 0.8, 0.5
    p = _params(dp={"enabled": True, "clip_norm": s, "noise_multiplier": z})
    mean = _flat(_aggregate(p, {c: _delta(i, 0.0) for i, c in enumerate(SITES)}, transport))
    # Σ_c w_c N(0, σ_c²) with σ_c = z S w_max / (w_c √C): std z S w_max = z S / 3 (20,000 draws: ±1.5%)
    assert float(mean.std()) == pytest.approx(z * s / 3, rel=0.04)
    assert abs(float(mean.mean())) < 0.05 * z * s / 3


def test_survivors_of_a_dropout_scale_their_shares_up():
    z, s = 1.0, 0.5
    p = _params(dp={"enabled": True, "clip_norm": s, "noise_multiplier": z})
    mean = _flat(_aggregate(p, {c: _delta(i, 0.0) for i, c in enumerate(SITES)}, drop="c"))
    assert float(mean.std()) == pytest.approx(z * s / 2, rel=0.04)  # C = 2 survivors, w_max = 1/2


def test_updates_are_clipped_before_the_noise():
    z, s = 1e-4, 0.5
    p = _params(dp={"enabled": True, "clip_norm": s, "noise_multiplier": z})
    deltas = {c: _delta(i) for i, c in enumerate(SITES)}  # norms ~141, far above S
    mean = _flat(_aggregate(p, deltas, transport="fp32"))  # no quantization error: what is left is the noise
    expected = sum(_flat(d) * (s / dp.l2_norm(d)) for d in deltas.values()) / 3
    noise_norm = z * s / 3 * math.sqrt(expected.numel())
    assert float((mean - expected).norm()) == pytest.approx(noise_norm, rel=0.05)


def test_noise_is_reproducible_and_seeded_per_run_round_and_site():
    p = _params(dp={"enabled": True, "clip_norm": 0.5, "noise_multiplier": 1.0})
    deltas = {c: _delta(i, 1e-3) for i, c in enumerate(SITES)}
    first, again = _aggregate(p, deltas), _aggregate(p, deltas)  # fresh signing and masking keys each time
    assert all(torch.equal(first[n], again[n]) for n in first)
    other_seed = _aggregate(_params(run={"seed": 1}, dp={"enabled": True, "clip_norm": 0.5, "noise_multiplier": 1.0}), deltas)
    assert not torch.equal(first["w"], other_seed["w"])
    seeds = {dp.noise_seed(0, r, c) for r in range(3) for c in SITES}
    assert len(seeds) == 9 and dp.noise_seed(0, 1, "a") == dp.noise_seed(0, 1, "a")


def test_announcement_and_update_carry_the_same_noisy_delta():
    seen = []

    class Spy:
        def announce(self, ctx, site, delta):
            seen.append({n: t.clone() for n, t in delta.items()})
            return b""

        encode = announce

    codec = dp.PrivateCodec(Spy(), run_seed=0, clip_norm=0.5, noise_multiplier=1.0)
    ctx = RoundContext("run", 2, SITES, param_spec(SPEC_STATE))
    delta = _delta(0, 1e-3)
    codec.announce(ctx, "a", delta)
    codec.encode(ctx, "a", delta)
    assert all(torch.equal(seen[0][n], seen[1][n]) for n in delta) and not torch.equal(seen[0]["w"], delta["w"])


def test_a_site_secret_keeps_the_noise_from_the_run_seed():
    """A sovereign site keys its noise with its own secret: the aggregator knows the run seed, not the noise."""
    plain = dp.noise_seed(0, 4, "a")
    keyed = dp.noise_seed(0, 4, "a", secret=b"k" * 32)
    assert keyed != plain and keyed == dp.noise_seed(0, 4, "a", secret=b"k" * 32) != dp.noise_seed(0, 4, "a", secret=b"j" * 32)
    assert 0 <= keyed < 1 << 63


# ------------------------------------------------------------ the accountant, per round


@pytest.mark.parametrize("z", [0.5, 1.0, 2.5])
@pytest.mark.parametrize("rounds", [1, 10, 60])
def test_epsilon_matches_opacus_rdp_accountant(z, rounds):
    acc = RDPAccountant()
    for _ in range(rounds):
        acc.step(noise_multiplier=z, sample_rate=1.0)  # every site in every round: q = 1
    ours = dp.epsilon(z, rounds, DELTA)
    assert ours == pytest.approx(acc.get_epsilon(DELTA, alphas=list(dp.RDP_ORDERS)), rel=1e-9)
    assert ours <= acc.get_epsilon(DELTA) * (1 + 1e-9)  # our orders include Opacus' defaults


def test_round_privacy_reports_epsilon_of_the_rounds_so_far():
    z, s = 1.3, 0.5
    p = _params(dp={"enabled": True, "clip_norm": s, "noise_multiplier": z, "delta": DELTA})
    metrics = {"a": {"dp/clipped": 1.0}, "b": {"dp/clipped": 0.0}, "c": {"dp/clipped": 1.0}}
    history = []
    for r in range(4):
        ctx = RoundContext("run", r, SITES, param_spec(SPEC_STATE))
        out = dp.round_privacy(p, ctx, metrics)
        assert out["round"] == {"dp/epsilon": dp.epsilon(z, r + 1, DELTA), "dp/delta": DELTA, "dp/clip_fraction": pytest.approx(2 / 3)}
        assert out["sites"] == {c: {"dp/noise_std": pytest.approx(z * s / math.sqrt(3))} for c in SITES}
        history.append({"round": r, "dp": out["round"]})
    assert [h["dp"]["dp/epsilon"] for h in history] == sorted(h["dp"]["dp/epsilon"] for h in history)
    summary = dp.run_privacy(p, history)
    assert summary["epsilon"] == history[-1]["dp"]["dp/epsilon"] and summary["rounds"] == 4 and summary["delta"] == DELTA
    (line,) = privacy_lines({"dp": summary})
    assert f"ε = {summary['epsilon']:.3g} at δ = {DELTA:g} after 4 rounds" in line


def test_clip_only_records_the_clip_fraction_and_no_epsilon():
    p = _params(federate={"update_clip_norm": 0.5})
    out = dp.round_privacy(p, RoundContext("run", 0, SITES, param_spec(SPEC_STATE)), {c: {"dp/clipped": 1.0} for c in SITES})
    assert out == {"round": {"dp/clip_fraction": 1.0}, "sites": {}}
    summary = dp.run_privacy(p, [{"round": 0, "dp": out["round"]}])
    assert "epsilon" not in summary and not summary["enabled"]
    (line,) = privacy_lines({"dp": summary})
    assert "no DP guarantee" in line
    assert privacy_lines({}) == []


# ------------------------------------------------------------ the ε budget


def test_epsilon_budget_applies_only_to_dp_runs():
    budgets = load_budgets(REPO / "budgets.yaml")
    off, on = _params(), _params(dp={"enabled": True})
    assert "dp_epsilon" not in {r["name"] for r in evaluate_budgets(budgets, "federate", "cpu-2c", {}, off)}
    rows = {r["name"]: r for r in evaluate_budgets(budgets, "federate", "cpu-2c", {"dp/epsilon": 3.0}, on)}
    assert rows["dp_epsilon"]["status"] == "within"
    rows = {r["name"]: r for r in evaluate_budgets(budgets, "federate", "cpu-2c", {"dp/epsilon": 50.0}, on)}
    assert rows["dp_epsilon"]["status"] == "above" and rows["dp_epsilon"]["response"] == "revise"
    rows = {r["name"]: r for r in evaluate_budgets(budgets, "federate", "cpu-2c", {})}  # params unknown: never skipped
    assert rows["dp_epsilon"]["status"] == "not_measured"


def test_only_if_must_name_a_boolean_param(tmp_path):
    path = tmp_path / "budgets.yaml"
    entry = ("{name: x, metric: dp/epsilon, low: 0, high: 1, unit: eps, stage: federate, hardware_class: cpu-2c, "
             "response: revise, only_if: %s}")
    path.write_text("budgets:\n  - " + entry % "dp.noise_multiplier" + "\n")
    with pytest.raises(ConfigError, match="only_if 'dp.noise_multiplier' is not a boolean params key"):
        load_budgets(path)
    path.write_text("budgets:\n  - " + entry % "dp.enabled" + "\n")
    assert load_budgets(path)[0].only_if == "dp.enabled"


# ------------------------------------------------------------ the federate stage, end to end


@pytest.mark.e2e
def test_federate_stage_with_dp_records_epsilon_and_reruns_bitwise(prefect_server, project, tmp_path, monkeypatch):
    """Two DP federations of one seed: identical global parameters (seeded noise), and ε in every record."""
    import json

    import yaml

    from flows.federate import federate_flow
    from flows.prepare import prepare_flow
    from tests.conftest import make_project, micro_params

    z = 1.0
    params = micro_params()
    params["dp"] = {"enabled": True, "clip_norm": 0.5, "noise_multiplier": z, "delta": DELTA}
    params["federate"].update(local_only=False, head_adapt_steps=0)
    hashes = []
    for root in (project, make_project(tmp_path / "again", params)):
        (root / "params.yaml").write_text(yaml.safe_dump(params))
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        prepare_flow(root=str(root))
        federate_flow(root=str(root))
        report = json.loads((root / "reports" / "federate.json").read_text())
        hashes.append(report["global_params_sha256"])
        rounds = params["federate"]["rounds"]
        assert report["dp"]["epsilon"] == dp.epsilon(z, rounds, DELTA) and report["dp"]["rounds"] == rounds
        assert [r["dp"]["dp/epsilon"] for r in report["per_round"]] == [dp.epsilon(z, t + 1, DELTA) for t in range(rounds)]
        sink = [json.loads(line) for line in (root / "reports" / "metrics.jsonl").read_text().splitlines()]
        eps = [m for m in sink if m["stage"] == "federate" and m["name"] == "dp/epsilon" and m["round"] is not None]
        assert [m["round"] for m in eps] == list(range(rounds))
        assert {m["name"] for m in sink if m["participant"]} >= {"dp/update_norm", "dp/clipped", "dp/noise_std"}
        budgets = json.loads((root / "reports" / "manifests" / "federate.json").read_text())["budgets"]
        (row,) = [b for b in budgets if b["name"] == "dp_epsilon"]
        assert row["value"] == report["dp"]["epsilon"] and row["status"] in ("within", "above")
    assert hashes[0] == hashes[1]
