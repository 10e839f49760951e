"""`lensemble join SITE`: a robot that took no part in the federation joins it (flows/join.py, orchestration/joining.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from lensemble.config import parse_params
from lensemble.errors import ConfigError
from orchestration.join_sites import join_site
from orchestration.joining import JOIN_METRICS
from tests.conftest import REPO, make_project, micro_params

pytestmark = pytest.mark.e2e


def _joining(raw: dict, embodiment: str = "grid_thruster", episodes: int = 2, steps: int = 3) -> dict:
    raw["data"]["sites"] = [{"name": "site_a", "embodiment": "grid_point", "episodes": 3},
                            {"name": "site_b", "embodiment": "grid_point", "episodes": 3}]
    raw["join"] = {"sites": [{"name": "site_j", "embodiment": embodiment, "episodes": episodes}], "steps": steps}
    return raw


def test_a_joining_site_must_bring_a_new_robot_under_a_new_name():
    with pytest.raises(ConfigError, match="site_j's embodiment grid_point took part in the federation; a joining site brings a new one"):
        parse_params(_joining(micro_params(), embodiment="grid_point"))
    raw = _joining(micro_params())
    raw["join"]["sites"][0]["name"] = "site_a"
    with pytest.raises(ConfigError, match="site_a is already a federation site"):
        parse_params(raw)
    with pytest.raises(ConfigError, match=r"unknown joining site 'site_x'; join.sites in params: \['site_j'\]"):
        join_site(parse_params(_joining(micro_params())), "site_x")


def test_join_before_any_federation_is_one_line_naming_the_missing_model(tmp_path):
    root = make_project(tmp_path / "p", _joining(micro_params()))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), "join", "site_j"], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 3
    assert out.stderr.strip().splitlines() == [f"lensemble: error: {root / 'models' / 'federated.pt'} does not exist: "
                                               "run the federation first (dvc repro)"]


def test_the_joined_model_trains_only_its_new_head_and_adapter_and_both_agents_plan_on_the_same_seeds(prefect_server, tmp_path, monkeypatch):
    from flows.federate import federate_flow
    from flows.join import join_flow
    from flows.prepare import prepare_flow

    raw = _joining(micro_params())
    raw["federate"].update(head_adapt_steps=0, local_only=False)
    root = make_project(tmp_path / "proj", raw)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.delenv("LENSEMBLE_PIPELINE_RUN", raising=False)
    prepare_flow(root=str(root))
    federate_flow(root=str(root))
    result = join_flow(root=str(root), site="site_j")

    saved = json.loads((root / "reports" / "join" / "site_j.json").read_text())
    assert saved["success"] == result["success"] and set(saved["success"]) == {"joined", "scratch", "oracle", "random"}
    assert all(v["wins"] == round(v["success_rate"] * saved["evaluation_episodes"]) for v in saved["success"].values())
    m = saved["metrics"]
    assert set(m) <= JOIN_METRICS
    # joined: only the new head and proprio adapter, against every parameter of the scratch model (the same architecture)
    from lensemble.workflow import build_model
    model = build_model(parse_params(raw), "test", extra_embodiments=("grid_thruster",))
    local = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("action_heads.grid_thruster.", "proprio_adapters.grid_thruster.")))
    assert m["eval/join/trained_parameters/joined"] == local < m["eval/join/trained_parameters/scratch"] / 20
    assert m["eval/join/trained_parameters/scratch"] == sum(p.numel() for p in model.parameters())
    assert m["eval/join/steps/joined"] == m["eval/join/steps/scratch"] == 3
    md = (root / "reports" / "join" / "site_j.md").read_text()
    assert md.startswith("## A new robot joins: site_j (grid_thruster)") and "| joined |" in md and "Fisher exact p" in md
    # the site's own rows stay home: its store and index under data/join/, its release audited there
    assert (root / "data" / "join" / "site_j" / "episodes.parquet").is_file()
    audit = [json.loads(line) for line in (root / "audit" / "site_j.jsonl").read_text().splitlines()]
    assert [a["decision"] for a in audit if a["kind"] == "metrics"] == ["released"]
    recorded = {json.loads(line)["name"] for line in (root / "reports" / "metrics.jsonl").read_text().splitlines()}
    assert {"eval/join/success_rate/joined", "eval/join/success_rate/scratch"} <= recorded
    manifest = json.loads((root / "reports" / "manifests" / "join.json").read_text())
    assert "site_j" in manifest["data_manifests"]
    yaml.safe_dump(saved)  # plain data only
