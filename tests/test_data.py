"""Episode generation, the Parquet store and its failure modes, the window loader, MLflow datasets."""
from __future__ import annotations

import importlib
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lensemble.data.episodes import SCHEMA, Episodes, data_manifest, generate_episodes, read_episodes, to_table, write_episodes
from lensemble.data.windows import WindowSampler, frames_to_tensor
from lensemble.errors import ConfigError, DataError
from lensemble.sim.registry import EMBODIMENTS, embodiment_class, make_embodiment

SIZE = 16


def _gen(name: str = "grid_point", seed: int = 0, n: int = 3, length: int = 8, size: int = SIZE) -> Episodes:
    env = make_embodiment(name, size)
    try:
        return generate_episodes(env, seed, "site/test", n, length, 0.5, 0.3, 4)
    finally:
        env.close()


@pytest.fixture(scope="module")
def eps() -> Episodes:
    return _gen()


# ---- generation ----


@pytest.mark.parametrize("name", ["grid_point", "mujoco_point"])
def test_generation_is_reproducible_from_the_seed(name):
    a, b, c = _gen(name, seed=0, n=2), _gen(name, seed=0, n=2), _gen(name, seed=1, n=2)
    assert a.content_hash() == b.content_hash()
    assert a.content_hash() != c.content_hash()
    other_site = generate_episodes(make_embodiment(name, SIZE), 0, "site/other", 2, 8, 0.5, 0.3, 4)
    assert other_site.content_hash() != a.content_hash()


@pytest.mark.parametrize("name", sorted(EMBODIMENTS))
def test_every_embodiment_generates_64px_episodes_that_roundtrip(name, tmp_path):
    eps = _gen(name, n=2, length=6, size=64)
    env = make_embodiment(name, 64)
    k, p = env.action_dim, env.proprio_dim
    env.close()
    assert eps.embodiment == name
    assert eps.frames_ELHWC.shape == (2, 6, 64, 64, 3) and eps.frames_ELHWC.dtype == np.uint8
    assert eps.actions_ELK.shape == (2, 6, k) and eps.actions_ELK.dtype == np.float32
    assert eps.proprio_ELP.shape == (2, 6, p) and np.isfinite(eps.proprio_ELP).all()
    assert np.abs(eps.actions_ELK).max() <= 1.0
    assert eps.frames_ELHWC.std(axis=(0, 1)).max() > 0  # something moves
    store = tmp_path / name / "episodes.parquet"
    write_episodes(eps, store)
    back = read_episodes(store, 64)
    assert back.content_hash() == eps.content_hash() and back.embodiment == name
    manifest = data_manifest(eps, store)
    assert manifest["episodes"] == 2 and manifest["steps"] == 12 and len(manifest["content_hash"]) == 64
    assert all(isinstance(v, (str, int)) for v in manifest.values())  # counts and hashes only


def test_missing_simulator_package_names_what_to_install(monkeypatch):
    for mod in [m for m in sys.modules if m == "mujoco" or m.startswith("mujoco.") or m == "lensemble.sim.mujoco_envs"]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "mujoco", None)  # None in sys.modules: `import mujoco` fails
    with pytest.raises(ConfigError, match="embodiment 'mujoco_reacher' needs 'mujoco': pip install mujoco"):
        make_embodiment("mujoco_reacher", SIZE)


def test_missing_simulator_via_importlib(monkeypatch):
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name == "lensemble.sim.pusht":
            raise ModuleNotFoundError("No module named 'gym_pusht'", name="gym_pusht")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(ConfigError, match="needs 'gym_pusht': pip install gym-pusht"):
        make_embodiment("pusht", SIZE)


# ---- the store's failure modes: DataError naming the file ----


def _table_with(eps: Episodes, **columns) -> pa.Table:
    t = to_table(eps)
    for name, arr in columns.items():
        t = t.set_column(t.schema.get_field_index(name), name, arr)
    return t


CORRUPTIONS = {
    "missing": (lambda p, eps: None, "is missing"),
    "garbage": (lambda p, eps: p.write_bytes(b"not a parquet file at all" * 10), "corrupt or truncated"),
    "truncated": (lambda p, eps: (write_episodes(eps, p), p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])), "corrupt or truncated"),
    "zero-bytes": (lambda p, eps: p.write_bytes(b""), "corrupt or truncated"),
    "empty": (lambda p, eps: pq.write_table(SCHEMA.empty_table(), p), "is empty"),
    "schema-mismatch": (lambda p, eps: pq.write_table(to_table(eps).cast(pa.schema([f.with_type(pa.int64()) if f.name == "step" else f for f in SCHEMA])), p), "has schema"),
    "missing-column": (lambda p, eps: pq.write_table(to_table(eps).drop_columns(["proprio"]), p), "has schema"),
    "missing-rows": (lambda p, eps: pq.write_table(to_table(eps).slice(1), p), "missing or unordered rows"),
    "wrong-frame-size": (lambda p, eps: pq.write_table(_table_with(eps, frame=pa.array([b"\x00" * 10] * (eps.num_episodes * 8), pa.binary())), p), "not 16x16x3"),
    "ragged-actions": (lambda p, eps: pq.write_table(_table_with(eps, action=pa.array([[0.1] * (1 + i % 2) for i in range(eps.num_episodes * 8)], pa.list_(pa.float32()))), p), "null or ragged"),
    "nan-actions": (lambda p, eps: pq.write_table(_table_with(eps, action=pa.array([[float("nan"), 0.0]] * (eps.num_episodes * 8), pa.list_(pa.float32()))), p), "NaN or Inf"),
    "mixed-embodiments": (lambda p, eps: pq.write_table(_table_with(eps, embodiment=pa.array(["a", "b"] * (eps.num_episodes * 4), pa.string())), p), "mixes embodiments"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_bad_store_raises_data_error_naming_the_file(eps, tmp_path, case):
    corrupt, message = CORRUPTIONS[case]
    store = tmp_path / "sites" / "site_x" / "episodes.parquet"
    store.parent.mkdir(parents=True)
    corrupt(store, eps)
    with pytest.raises(DataError, match=message) as err:
        read_episodes(store, SIZE)
    assert "site_x/episodes.parquet" in str(err.value)


def test_empty_site_directory_is_a_data_error(tmp_path):
    (tmp_path / "site_y").mkdir()
    with pytest.raises(DataError, match="site_y/episodes.parquet is missing"):
        read_episodes(tmp_path / "site_y" / "episodes.parquet", SIZE)


# ---- windows ----


def test_window_sampler_is_reproducible_from_the_seed(eps):
    sampler = WindowSampler(eps, 3, 4)
    g1, g2, g3 = (torch.Generator().manual_seed(s) for s in (7, 7, 8))
    (f1, a1, q1), (f2, a2, q2), (f3, _, _) = sampler.sample(16, g1), sampler.sample(16, g2), sampler.sample(16, g3)
    assert f1.shape == (16, 3, 3, SIZE, SIZE) and a1.shape == (16, 3, 2) and q1.shape == (16, 3, 4)
    assert torch.equal(f1, f2) and torch.equal(a1, a2) and torch.equal(q1, q2) and not torch.equal(f1, f3)


def test_window_sampler_cuts_consecutive_steps_of_one_episode(eps):
    sampler = WindowSampler(eps, 3, 4)
    assert len(sampler) == eps.num_episodes * (8 - 3 + 1)
    idx = torch.randint(0, len(sampler), (16,), generator=torch.Generator().manual_seed(3))
    frames, actions, proprio = sampler.sample(16, torch.Generator().manual_seed(3))
    for b, i in enumerate(idx.tolist()):
        f, a, q = sampler.window(i)
        assert torch.equal(frames[b], f) and torch.equal(actions[b], a) and torch.equal(proprio[b], q)
    e, s = divmod(int(idx[0]), 6)
    assert torch.equal(actions[0], torch.from_numpy(eps.actions_ELK[e, s : s + 3]))
    # proprio leaves scaled by the embodiment's fixed divisors and zero-padded to the federation's width
    scale = np.asarray(embodiment_class(eps.embodiment).proprio_scale, dtype=np.float32)
    p = eps.proprio_ELP.shape[-1]
    assert torch.equal(proprio[0, :, :p], torch.from_numpy(eps.proprio_ELP[e, s : s + 3] / scale))
    assert not proprio[..., p:].any()
    with pytest.raises(ValueError, match="exceeds episode length"):
        WindowSampler(eps, 9, 4)
    with pytest.raises(ConfigError, match=r"model.proprio_dim \(1\) is smaller than"):
        WindowSampler(eps, 3, 1)


def test_frames_to_tensor_is_the_documented_arithmetic():
    x = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    reference = torch.from_numpy(x).movedim(-1, -3).to(torch.float32) / 127.5 - 1.0
    out = frames_to_tensor(x)
    assert out.shape == (2, 3, 5, 7) and torch.equal(out, reference)
    assert out[..., 0, 0, 0].tolist() == pytest.approx((x[:, 0, 0, 0] / 127.5 - 1.0).tolist())
    with pytest.raises(TypeError, match="uint8"):
        frames_to_tensor(x.astype(np.float32))


# ---- MLflow datasets: digest and source, never rows ----


def test_site_datasets_are_logged_by_digest_and_source_only(eps, tmp_path):
    from mlflow.tracking import MlflowClient

    from orchestration.datasets import log_site_datasets

    store = tmp_path / "data" / "sites" / "site_a" / "episodes.parquet"
    write_episodes(eps, store)
    probe_store = tmp_path / "data" / "probe" / "grid_point.parquet"
    write_episodes(eps, probe_store)
    manifests = {"site_a": data_manifest(eps, store), "public_probe": {"grid_point": data_manifest(eps, probe_store)}, "site_b": {}}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("t"))
    assert log_site_datasets(client, run.info.run_id, manifests, tmp_path) == 2
    inputs = {d.dataset.name: d for d in client.get_run(run.info.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"site_a", "public_probe/grid_point"}
    ds = inputs["site_a"].dataset
    assert ds.digest == manifests["site_a"]["content_hash"][:36] and ds.source_type == "local"
    assert json.loads(ds.source) == {"uri": str(store.resolve())}
    assert json.loads(ds.schema)["schema_hash"] == manifests["site_a"]["schema_hash"]
    assert json.loads(ds.profile) == {"embodiment": "grid_point", "episodes": eps.num_episodes, "steps": eps.num_episodes * 8}
    assert {t.key: t.value for t in inputs["site_a"].tags}["mlflow.data.context"] == "training"
