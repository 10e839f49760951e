"""The (H, λ_anc) ablation flow: a Prefect map over grid points, each a federation of its own."""
from __future__ import annotations

import json

import pytest

from lensemble.config import parse_params
from lensemble.errors import ConfigError
from orchestration.ablation import grid
from tests.conftest import micro_params

pytestmark = pytest.mark.e2e


def test_grid_keeps_total_inner_steps_and_refuses_what_cannot_run():
    params = parse_params(micro_params())  # rounds 2 x H 3 = 6 inner steps
    points = grid(params, [3, 6], [0.0, 0.1])
    assert [(p.inner_steps, p.rounds, p.anchor_weight) for p in points] == [(3, 2, 0.0), (3, 2, 0.1), (6, 1, 0.0), (6, 1, 0.1)]
    with pytest.raises(ConfigError, match="inner steps 4 must be a positive divisor of the run's 6"):
        grid(params, [4], [0.0])
    with pytest.raises(ConfigError, match="anchor weight -0.1 must be >= 0"):
        grid(params, [3], [-0.1])


def test_the_cli_default_grid_runs_on_the_default_params():
    """`lensemble ablate` with no options on the shipped params.yaml: every default H divides rounds x H
    (an H of 100 against 750 inner steps, 15 x 50 then and 30 x 25 now, was refused before anything ran)."""
    from pathlib import Path

    from flows.cli import build_parser
    from lensemble.config import load_params

    args = build_parser().parse_args(["ablate"])
    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    points = grid(params, [int(h) for h in args.inner_steps.split(",")], [float(w) for w in args.anchor_weight.split(",")])
    total = params.federate.rounds * params.federate.inner_steps
    assert len(points) == 4 and all(p.rounds * p.inner_steps == total for p in points)


def test_ablation_maps_points_and_plots_drift_and_success_against_bytes(prefect_server, project):
    from flows.ablation import ablation_flow
    from flows.centralized import centralized_flow
    from flows.prepare import prepare_flow
    from flows.residency import residency_flow

    for stage in (prepare_flow, residency_flow, centralized_flow):
        stage(root=str(project))
    results = ablation_flow(root=str(project), inner_steps=(3, 6), anchor_weights=(0.0, 0.1))
    report = json.loads((project / "reports" / "ablation.json").read_text())
    assert report["total_inner_steps"] == 6 and [p["tag"] for p in report["points"]] == [p["tag"] for p in results]
    by = {(p["inner_steps"], p["anchor_weight"]): p for p in report["points"]}
    assert len(by) == 4
    for anchor in (0.0, 0.1):  # a round's bytes do not depend on H, but on whether the encoder still learns in it
        # (freeze_encoder_at 0.25 of 6 steps: through step 1, so H = 3's second round has a frozen encoder, off the wire)
        per_round = {h: [sum(s["comm_bytes"] for s in r["sites"].values()) for r in json.loads(
            (project / "ablation" / by[(h, anchor)]["tag"] / "reports" / "federate.json").read_text())["per_round"]] for h in (3, 6)}
        assert per_round[3][0] == per_round[6][0] and per_round[3][1] < per_round[3][0]
        assert by[(3, anchor)]["comm_bytes"] == sum(per_round[3]) and by[(6, anchor)]["comm_bytes"] == per_round[6][0]
    # λ_anc changes training, so the federations differ; each point ran in its own folder
    assert by[(3, 0.0)]["global_params_sha256"] != by[(3, 0.1)]["global_params_sha256"]
    for p in report["points"]:
        assert (project / "ablation" / p["tag"] / "reports" / "federate.json").is_file()
        assert set(p["success"]) == {"site_a", "site_b"} and 0.0 <= p["mean_success"] <= 1.0
        assert not (project / "ablation" / p["tag"] / "models" / "local").exists()  # no local-only baselines
    for name in ("ablation_drift", "ablation_success"):
        assert (project / "reports" / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
