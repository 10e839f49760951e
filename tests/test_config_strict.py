"""Strict params: bools are not numbers and numbers are not bools for every field of every section, the
cross-field checks, the dp section, and `lensemble check-params` on a bad file (one line, non-zero, no files)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from lensemble.config import Params, _numeric_field, parse_params
from lensemble.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
FINGERPRINT = "ab" * 32
BASE = {"data": {"sites": [{"name": "a", "embodiment": "grid_point", "episodes": 2},
                           {"name": "b", "embodiment": "grid_point", "episodes": 2}]},
        "join": {"sites": [{"name": "j", "embodiment": "grid_thruster", "episodes": 2}]}}


def _model_of(annotation) -> type[BaseModel] | None:
    """The section model a field holds: itself, or the item type of a tuple of models (data.sites)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _leaves(model: type[BaseModel], path: tuple) -> list[tuple[tuple, object]]:
    """(path into the raw params, annotation) of every scalar field, recursing into sections and site lists."""
    out = []
    for name, field in model.model_fields.items():
        inner = _model_of(field.annotation)
        if inner is not None and typing.get_origin(field.annotation) is tuple:  # a list of sites: its first entry
            out += _leaves(inner, path + (name, 0))
        elif inner is not None:
            out += _leaves(inner, path + (name,))
        else:
            out.append((path + (name,), field.annotation))
    return out


LEAVES = _leaves(Params, ())
NUMERIC = [path for path, ann in LEAVES if _numeric_field(ann)]
BOOLEAN = [path for path, ann in LEAVES if ann is bool]


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _with(path: tuple, value, raw: dict | None = None) -> dict:
    """BASE (or `raw`) with the value at `path` set, sections created as needed."""
    raw = copy.deepcopy(raw or BASE)
    node = raw
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else node.setdefault(key, {})
    node[path[-1]] = value
    return raw


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_params(raw)
    return str(info.value)


def test_the_field_walk_sees_every_section():
    names = {_dotted(p) for p in NUMERIC + BOOLEAN}
    assert {"data.sites.0.episodes", "evaluate.cem.horizon", "dp.noise_multiplier", "dp.delta", "federate.update_clip_norm",
            "model.predictor_heads", "run.seed"} <= names
    assert {"dp.enabled", "federate.local_only"} <= names
    assert len(NUMERIC) > 50


@pytest.mark.parametrize("path", NUMERIC, ids=_dotted)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_a_number(path, value):
    msg = _error(_with(path, value))
    assert f"{path[-1]} must be a number, got {str(value).lower()} (a boolean)" in msg
    assert msg.startswith(_dotted(path[:-1]))


@pytest.mark.parametrize("path", BOOLEAN, ids=_dotted)
@pytest.mark.parametrize("value", [0, 1, 1.0, "yes"])
def test_a_number_is_not_a_boolean(path, value):
    msg = _error(_with(path, value))
    assert f"{path[-1]} must be true or false, got {value!r}" in msg


@pytest.mark.parametrize("path", BOOLEAN, ids=_dotted)
def test_booleans_are_still_booleans(path):
    assert parse_params(_with(path, False)) is not None


def test_episodes_true_is_not_one_episode():
    assert _error(_with(("data", "sites", 0, "episodes"), True)) == "data.sites.0: episodes must be a number, got true (a boolean)"


@pytest.mark.parametrize(("width", "heads", "ok"), [(64, 4, True), (64, 3, False), (64, 128, False), (96, 6, True)])
def test_predictor_heads_must_divide_the_width(width, heads, ok):
    raw = _with(("model", "predictor_heads"), heads, _with(("model", "predictor_width"), width))
    if ok:
        assert parse_params(raw).model.predictor_heads == heads
    else:
        assert _error(raw) == f"model.predictor_heads ({heads}) must divide model.predictor_width ({width})"


def test_patch_must_divide_the_image():
    raw = _with(("model", "patch_size"), 5, _with(("data", "image_size"), 32))
    assert _error(raw) == "model.patch_size (5) must divide data.image_size (32)"


def test_plan_must_fit_the_trained_window():
    raw = _with(("evaluate", "cem"), {"horizon": 3, "context": 2, "execute_steps": 1}, _with(("data", "num_steps"), 4))
    msg = _error(raw)
    assert msg.startswith("evaluate.cem.context (2) + evaluate.cem.horizon (3) exceeds data.num_steps (4)")
    ok = _with(("evaluate", "cem"), {"horizon": 3, "context": 1, "execute_steps": 1}, _with(("data", "num_steps"), 4))
    assert parse_params(ok).evaluate.cem.horizon == 3


def test_rollout_steps_must_be_shorter_than_the_window():
    raw = _with(("objective", "rollout_steps"), 4, _with(("data", "num_steps"), 4))
    assert _error(raw) == "objective.rollout_steps (4) must be < data.num_steps (4)"


def test_sovereign_sites_need_pinned_key_fingerprints():
    raw = _with(("federate", "execution"), "sovereign")
    msg = _error(raw)
    assert msg.startswith("data.sites: a has no key_fingerprint") and "lensemble site keygen a" in msg
    raw["data"]["sites"][0]["key_fingerprint"] = FINGERPRINT
    assert "data.sites: b has no key_fingerprint" in _error(raw)
    raw["data"]["sites"][1]["key_fingerprint"] = FINGERPRINT.replace("a", "c")
    assert parse_params(raw).federate.execution == "sovereign"
    assert parse_params(_with(("federate", "execution"), "local")).data.sites[0].key_fingerprint is None  # local runs need none


@pytest.mark.parametrize("bad", ["AB" * 32, "ab" * 31, "zz" * 32, 123])
def test_key_fingerprint_is_64_lowercase_hex(bad):
    assert _error(_with(("data", "sites", 0, "key_fingerprint"), bad)).startswith("data.sites.0.key_fingerprint")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("clip_norm", 0.0, "dp.clip_norm must be > 0.0, got 0.0"),
    ("clip_norm", -1.0, "dp.clip_norm must be > 0.0, got -1.0"),
    ("noise_multiplier", 0.0, "dp.noise_multiplier must be > 0.0, got 0.0"),
    ("noise_multiplier", 1e5, "dp.noise_multiplier must be <= 10000.0, got 100000.0"),
    ("delta", 0.0, "dp.delta must be > 0.0, got 0.0"),
    ("delta", 1.0, "dp.delta must be < 1.0, got 1.0"),
    ("clip_norm", "big", "dp.clip_norm"),
])
def test_dp_ranges(key, value, message):
    assert _error(_with(("dp", key), value)).startswith(message)


def test_dp_defaults_are_off_and_a_valid_section_parses():
    p = parse_params(BASE)
    assert not p.dp.enabled and p.federate.update_clip_norm is None
    on = parse_params({**BASE, "dp": {"enabled": True, "clip_norm": 0.5, "noise_multiplier": 1.1, "delta": 1e-6}})
    assert (on.dp.enabled, on.dp.clip_norm, on.dp.noise_multiplier, on.dp.delta) == (True, 0.5, 1.1, 1e-6)
    assert on.hash() != p.hash()  # dp settings are part of the run id


@pytest.mark.parametrize("key", ["epsilon", "sigma", "enable", "clip"])
def test_unknown_dp_keys_are_errors(key):
    assert _error({**BASE, "dp": {key: 1.0}}) == f"unknown key dp.{key}"


@pytest.mark.parametrize(("value", "message"), [(0.0, "federate.update_clip_norm must be > 0.0, got 0.0"),
                                                (True, "federate: update_clip_norm must be a number, got true (a boolean)")])
def test_update_clip_norm_is_positive_or_null(value, message):
    assert _error(_with(("federate", "update_clip_norm"), value)) == message
    assert parse_params(_with(("federate", "update_clip_norm"), None)).federate.update_clip_norm is None


# ------------------------------------------------------------ through the CLI


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _cli(root: Path, *argv: str, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`lensemble --root ROOT ARGV` in a fresh interpreter (with `python` options), offline, no Prefect home inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_HOME")}
    env.update(PYTHONDONTWRITEBYTECODE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true",
               DVC_NO_ANALYTICS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *python, "-m", "flows.cli", "--root", str(root), *argv], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def _check_params(root: Path) -> subprocess.CompletedProcess:
    return _cli(root, "check-params")


BAD_FILES = {
    "episodes_true": (yaml.safe_dump(_with(("data", "sites", 0, "episodes"), True)), "data.sites.0: episodes must be a number"),
    "heads": (yaml.safe_dump(_with(("model", "predictor_heads"), 3)), "model.predictor_heads (3) must divide model.predictor_width (64)"),
    "dp_unknown_key": (yaml.safe_dump({**BASE, "dp": {"epsilon": 3}}), "unknown key dp.epsilon"),
    "dp_enabled_one": (yaml.safe_dump(_with(("dp", "enabled"), 1)), "dp: enabled must be true or false, got 1"),
    "not_yaml": ("data: [unclosed\n", "is not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_check_params_on_a_bad_file_is_one_line_nonzero_and_writes_nothing(tmp_path, case):
    text, message = BAD_FILES[case]
    (tmp_path / "params.yaml").write_text(text)
    before = _files(tmp_path)
    proc = _check_params(tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lensemble: error: ") and message in lines[0], proc.stderr
    assert proc.stdout == ""
    assert _files(tmp_path) == before


def test_check_params_on_a_good_file_prints_its_hash(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({**BASE, "dp": {"enabled": True}}))
    proc = _check_params(tmp_path)
    assert proc.returncode == 0, proc.stderr
    digest = parse_params({**BASE, "dp": {"enabled": True}}).hash()
    assert proc.stdout.strip() == f"{tmp_path / 'params.yaml'} is valid (params hash {digest})"


HEAVY = ("torch", "prefect", "mlflow")


def _imports_of_a_refusal(root: Path, command: list[str], code: int, error: str) -> set[str]:
    """Run the CLI with the interpreter's own import log (-X importtime); check it exits `code` with the one line `error`
    having imported none of HEAVY, and return the modules it imported."""
    proc = _cli(root, *command, python=("-X", "importtime"))
    assert proc.returncode == code, proc.stderr[-2000:]
    log = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert errors == [f"lensemble: error: {error}"], errors
    imported = {line.split("|")[-1].strip() for line in log}
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY)
    assert not heavy, heavy[:5]
    return imported


@pytest.mark.parametrize("command", [["check-params"], ["run", "federate"], ["ablate"], ["join", "site_d"]])
def test_a_bad_params_file_is_refused_before_torch_prefect_or_mlflow_is_imported(tmp_path, command):
    """Validation imports none of the heavy packages: a typo in params.yaml costs a user well under a second, not the
    2-4 s of importing torch (and Prefect for `ablate`) first."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(_with(("model", "encoder"), "nope")))
    imported = _imports_of_a_refusal(tmp_path, command, 2, "model.encoder: unknown ViT config 'nope'; known: "
                                     "['base', 'large', 'micro', 'nano16', 'nano32', 'nano8', 'small', 'tiny']")
    assert "lensemble.config" in imported  # the log is read: validation did run in this process


def test_a_missing_input_is_refused_before_torch_prefect_or_mlflow_is_imported(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(BASE))
    imported = _imports_of_a_refusal(tmp_path, ["run", "centralized"], 3, "stage centralized cannot start: missing "
                                     "data/sites/a/episodes.parquet, data/sites/b/episodes.parquet, data/probe/grid_point.parquet; run `lensemble run prepare` "
                                     "first (or `dvc repro centralized`)")
    assert "flows.inputs" in imported


@pytest.mark.parametrize("site, code, error", [
    ("site_x", 2, "unknown joining site 'site_x'; join.sites in params: ['j'] (a joining site is declared there, with its embodiment "
                  "and episodes)"),
    ("j", 3, "{root}/models/federated.pt does not exist: run the federation first (dvc repro)"),
])
def test_join_refuses_an_unknown_site_or_a_missing_federated_model_before_torch_prefect_or_mlflow_is_imported(tmp_path, site, code, error):
    """`lensemble join` names a mistyped site, or the federation it needs, in well under a second (it took 4.2 s, importing the
    model code and the flows first)."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(BASE))
    imported = _imports_of_a_refusal(tmp_path, ["join", site], code, error.format(root=tmp_path))
    assert "orchestration.join_sites" in imported


def test_planning_energy_names_a_known_embodiment_and_a_known_reading():
    assert _error(_with(("evaluate", "energy"), {"mujoco_point": "sum"})) == (
        "evaluate.energy.mujoco_point: Input should be 'final' or 'mean', got 'sum'")
    assert _error(_with(("evaluate", "energy"), {"ant": "mean"})).startswith("evaluate.energy: unknown embodiment 'ant'; known: [")
    assert parse_params(_with(("evaluate", "energy"), {"pusht": "mean"})).evaluate.energy == {"pusht": "mean"}


def test_the_default_pooled_model_sees_each_robot_as_long_as_each_federated_site_and_baseline():
    """README: the three models are compared at the same data. Pooling is round-robin over the sites' robots, so the pooled
    model takes centralized.steps / sites steps of each; a federated site and a local-only baseline take rounds x H."""
    from lensemble.config import load_params

    p = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    assert p.centralized.steps % len(p.data.sites) == 0
    assert p.centralized.steps // len(p.data.sites) == p.federate.rounds * p.federate.inner_steps
