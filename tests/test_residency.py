"""INV-RESIDENCY: the guard refuses every way private data could leave a site, and the leak scan finds it.

Each adversarial attempt is one entry of ATTEMPTS; all must raise ResidencyViolation, write exactly
one audit line and nothing else. Legal updates, payloads, metrics, manifests and logs pass. The
e2e test runs the micro pipeline and scans everything that left the sites.
"""
from __future__ import annotations

import base64
import io
import json
import pickle
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lensemble.config import ModelParams
from lensemble.data.audit import PrivateIndex, fingerprints, load_index, scan_file, scan_paths
from lensemble.data.episodes import data_manifest, generate_episodes, read_episodes, write_episodes
from lensemble.data.residency import ResidencyGuard, looks_like_pickle, on_pixel_grid
from lensemble.data.windows import frames_to_tensor
from lensemble.errors import ResidencyViolation
from lensemble.federation.transport import PlainFP32, RoundContext, param_spec
from lensemble.model.world_model import WorldModel, federated_state, local_state
from lensemble.sim.registry import make_embodiment

SIZE = 16
SITE = "site_a"


def _episodes(namespace: str, n: int = 4):
    env = make_embodiment("grid_point", SIZE)
    eps = generate_episodes(env, 0, namespace, n, 8, 0.5, 0.3, 4)
    env.close()
    return eps


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """A site: episodes, the model's federated spec and action head, a legal delta and its index."""
    eps = _episodes(f"site/{SITE}")
    torch.manual_seed(0)
    model = WorldModel(ModelParams(), SIZE, {"grid_point": 2}, max_steps=4)
    before = federated_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(3):  # a real pseudo-gradient: a few AdamW steps on some loss
        z = model.encoder(frames_to_tensor(eps.frames_ELHWC[0, :4])[None])
        opt.zero_grad()
        (z.pow(2).mean() + model.action_heads["grid_point"](torch.from_numpy(eps.actions_ELK[0])).pow(2).mean()).backward()
        opt.step()
    after = federated_state(model)
    delta = {n: after[n] - before[n] for n in sorted(before)}
    local = local_state(model)
    store = tmp_path_factory.mktemp("site") / "episodes.parquet"
    write_episodes(eps, store)
    index = fingerprints(eps).with_tensors(local)
    rows = eps.actions_ELK.reshape(-1, 2)
    row = next(r for r in rows if index.scan(r.tobytes())["values"])  # an action row with continuous values
    return SimpleNamespace(eps=eps, spec=param_spec(before), delta=delta, local=local, index=index, row=row,
                           manifest=data_manifest(eps, store), probe_rows=6)


def _guard(w, tmp_path: Path, private: bool = True) -> ResidencyGuard:
    return ResidencyGuard(SITE, w.spec, tmp_path / "audit.jsonl", probe_rows=w.probe_rows, probe_dim=64, private=w.index if private else None)


def _with(delta: dict, name: str, fill) -> dict:
    """`delta` with tensor `name` replaced by a clone whose first values are `fill` (flat)."""
    out = dict(delta)
    t = delta[name].clone()
    vals = torch.as_tensor(np.ascontiguousarray(fill), dtype=torch.float32).reshape(-1)
    t.view(-1)[: vals.numel()] = vals
    out[name] = t
    return out


def _png(frame_HWC: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame_HWC).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Point:  # an arbitrary object
    x: float
    y: float


BIG = "encoder.blocks.0.mlp.0.weight"  # [256, 64]: room for a 16x16 frame or a whole episode of actions

# (id, builder(w) -> (kind, obj), guard with the private index?)
ATTEMPTS = [
    ("frames-uint8-tensor-as-payload", lambda w: ("payload", torch.from_numpy(w.eps.frames_ELHWC[0])), True),
    ("frames-ndarray-in-metrics", lambda w: ("metrics", {"frames": w.eps.frames_ELHWC[0]}), True),
    ("frames-uint8-under-legal-name", lambda w: ("update", {**w.delta, BIG: torch.zeros(256, 64, dtype=torch.uint8)}), True),
    ("actions-tensor-in-metrics", lambda w: ("metrics", {"loss/pred": 0.1, "actions": torch.from_numpy(w.eps.actions_ELK[0])}), True),
    ("per-sample-embeddings-as-probe", lambda w: ("public_probe_embedding", torch.randn(64, 64)), True),
    ("embeddings-bytes-in-log", lambda w: ("log", {"z": torch.randn(8, 64).numpy().tobytes()}), True),
    ("renamed-key", lambda w: ("update", {(k + "_" if k == BIG else k): v for k, v in w.delta.items()}), True),
    ("extra-key", lambda w: ("update", {**w.delta, "encoder.private_frames": torch.zeros(4)}), True),
    ("missing-key", lambda w: ("update", {k: v for k, v in w.delta.items() if k != BIG}), True),
    ("nested-list-hides-tensor", lambda w: ("metrics", {"losses": [0.1, [torch.zeros(3)]]}), True),
    ("nested-dict-hides-tensor", lambda w: ("manifest", {"a": {"b": {"c": [{"d": torch.zeros(3)}]}}}), True),
    ("actions-copied-into-legal-tensor", lambda w: ("update", _with(w.delta, BIG, w.eps.actions_ELK[1])), True),
    ("proprio-copied-into-legal-tensor", lambda w: ("update", _with(w.delta, BIG, w.eps.proprio_ELP[2, :3])), True),
    ("frame-float-copied-into-legal-tensor", lambda w: ("update", _with(w.delta, BIG, frames_to_tensor(w.eps.frames_ELHWC[1, 3]))), True),
    ("frames-on-pixel-grid-no-index", lambda w: ("update", _with(w.delta, "encoder.patch.weight", w.eps.frames_ELHWC[:2] / 255.0)), False),
    ("action-head-weights-in-legal-tensor", lambda w: ("update", _with(w.delta, BIG, w.local["action_heads.grid_point.net.2.weight"])), True),
    ("action-head-under-real-names", lambda w: ("update", {**w.delta, **w.local}), True),
    ("pickled-object", lambda w: ("payload", pickle.dumps({"actions": w.eps.actions_ELK[0].tolist()})), True),
    ("pickle-protocol-0", lambda w: ("payload", pickle.dumps([1.5, "x"], protocol=0)), True),
    ("torch-save-bytes", lambda w: ("payload", _torch_bytes(w.delta)), True),
    ("metrics-with-tensor-value", lambda w: ("metrics", {"loss/pred": torch.tensor(0.5)}), True),
    ("payload-with-raw-frame", lambda w: ("payload", b"\x10\x00\x00\x00hdr" + w.eps.frames_ELHWC[3, 2].tobytes() + b"sig"), True),
    ("payload-with-float-frame", lambda w: ("payload", b"\x07" + frames_to_tensor(w.eps.frames_ELHWC[1, 1]).contiguous().numpy().tobytes()), True),
    ("payload-with-actions", lambda w: ("payload", b"\x05\x00\x00\x00abcde" + w.eps.actions_ELK[2].tobytes()), True),
    ("float-list-of-private-actions", lambda w: ("metrics", {"a": [float(x) for x in w.row]}), True),
    ("action-row-split-across-keys", lambda w: ("metrics", {"x": float(w.row[0]), "y": float(w.row[1])}), True),
    ("base64-frame-in-log", lambda w: ("log", {"msg": base64.b64encode(w.eps.frames_ELHWC[0, 0].tobytes()).decode()}), True),
    ("short-base64-actions-in-string", lambda w: ("log", {"msg": "ok " + base64.b64encode(w.row.tobytes()).decode()}), True),
    ("long-string", lambda w: ("manifest", {"note": "x" * 1000}), True),
    ("numpy-scalar-array", lambda w: ("metrics", {"loss/pred": np.array(0.5)}), True),
    ("dataclass", lambda w: ("metrics", {"p": Point(1.0, 2.0)}), True),
    ("generator", lambda w: ("log", {"g": (x for x in range(3))}), True),
    ("set", lambda w: ("log", {"s": {1, 2}}), True),
    ("bytes-in-metrics", lambda w: ("metrics", {"b": b"\x00\x01"}), True),
    ("long-float-list-in-manifest", lambda w: ("manifest", {"v": [0.25] * 200}), True),
    ("frame-as-int-list", lambda w: ("manifest", {"frame": w.eps.frames_ELHWC[0, 0].reshape(-1).tolist()}), True),
    ("nan-laden-update", lambda w: ("update", _with(w.delta, BIG, [float("nan")] * 3)), True),
    ("wrong-dtype-update", lambda w: ("update", {**w.delta, BIG: w.delta[BIG].double()}), True),
    ("wrong-shape-update", lambda w: ("update", {**w.delta, BIG: w.delta[BIG].reshape(64, 256)}), True),
    ("parameter-subclass", lambda w: ("update", {**w.delta, BIG: torch.nn.Parameter(w.delta[BIG].clone())}), True),
    ("sparse-tensor", lambda w: ("update", {**w.delta, BIG: w.delta[BIG].to_sparse()}), True),
    ("dict-subclass", lambda w: ("metrics", type("Sneaky", (dict,), {"frames": w.eps.frames_ELHWC})({"loss/pred": 0.1})), True),
    ("update-not-a-dict", lambda w: ("update", list(w.delta.items())), True),
    ("oversized-payload", lambda w: ("payload", b"\x01" * (8 * 223808 + (2 << 20))), True),
    ("deep-nesting", lambda w: ("manifest", _deep(12)), True),
    ("unknown-kind", lambda w: ("frames", {"a": 1}), True),
]


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deep(n: int) -> dict:
    d: dict = {"x": 1}
    for _ in range(n):
        d = {"d": d}
    return d


def test_at_least_twenty_distinct_attempts():
    assert len({a[0] for a in ATTEMPTS}) == len(ATTEMPTS) >= 20


@pytest.mark.parametrize("name, build, private", ATTEMPTS, ids=[a[0] for a in ATTEMPTS])
def test_attempt_is_refused_and_writes_only_its_audit_line(w, tmp_path, name, build, private):
    kind, obj = build(w)
    guard = _guard(w, tmp_path, private)
    with pytest.raises(ResidencyViolation, match=f"site '{SITE}': refused"):
        guard.release(kind, obj)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl"]
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["decision"] == "refused" and rec["size"] == 0 and rec["sha256"] == ""
    assert len(lines[0]) < 600 and w.index.scan(lines[0].encode()) == {"values": 0, "frames": 0}


def test_refusal_messages_echo_no_untrusted_strings(w, tmp_path):
    guard = _guard(w, tmp_path)
    secret = "0.123456789,-0.98765"
    with pytest.raises(ResidencyViolation) as err:
        guard.release("metrics", {secret: torch.zeros(2)})
    assert secret not in str(err.value) and secret not in (tmp_path / "audit.jsonl").read_text()


def test_legal_objects_pass_unchanged_with_one_audit_line_each(w, tmp_path):
    # INV-TYPED-RELEASE: metrics are whitelisted names → finite numbers (no NaN, bools or lists), manifests are data
    # manifests (a RunManifest-like record is refused), and records come back as new dicts with fp32 numbers.
    guard = _guard(w, tmp_path)
    ctx = RoundContext("run", 0, (SITE,), w.spec)
    payload = PlainFP32().encode(ctx, SITE, w.delta)
    metrics = {"loss/pred": 0.31, "steps": 3, "train_seconds": 1.5, "gauge/reflection": np.float64(0.0)}
    log = {"event": "round-done", "round": 1, "participant": SITE, "sha256": "ab" * 32, "value": None}
    released = [
        ("update", w.delta),
        ("payload", payload),
        ("payload", b""),  # a transport's empty announcement
        ("public_probe_embedding", torch.randn(w.probe_rows, 64)),
        ("metrics", metrics),
        ("manifest", w.manifest),
        ("log", log),
    ]
    for kind, obj in released:
        out = guard.release(kind, obj)
        if kind in ("update", "payload"):
            assert out is obj
        elif kind == "public_probe_embedding":
            assert torch.equal(out, obj) and out.untyped_storage().data_ptr() != obj.untyped_storage().data_ptr()
        else:
            assert out == {k: (float(np.float32(v)) if type(v) is float else v) for k, v in obj.items()}
    guard.release("payload", payload, expected_size=len(payload))
    lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert len(lines) == len(released) + 1
    assert all(r["decision"] == "released" and len(r["sha256"]) == 64 and r["site"] == SITE for r in lines)
    assert {r["kind"] for r in lines} == {"update", "payload", "public_probe_embedding", "metrics", "manifest", "log"}
    assert lines[0]["size"] == 4 * sum(t.numel() for t in w.delta.values()) and lines[0]["items"] == len(w.delta)
    keys = {"t", "site", "kind", "decision", "sha256", "size", "items", "scanned_bytes", "index", "reason"}
    assert all(set(r) == keys for r in lines)
    assert w.index.scan((tmp_path / "audit.jsonl").read_bytes()) == {"values": 0, "frames": 0}


def test_guard_without_spec_or_with_a_local_spec_refuses_updates(w, tmp_path):
    with pytest.raises(ResidencyViolation, match="no federated spec"):
        ResidencyGuard(SITE, None, None).release("update", w.delta)
    spec = (*w.spec, ("action_heads.grid_point.net.0.weight", (32, 2)))
    with pytest.raises(ResidencyViolation, match="non-federated"):
        ResidencyGuard(SITE, spec, None).release("update", {**w.delta, "action_heads.grid_point.net.0.weight": torch.zeros(32, 2)})


def test_expected_size_mismatch_is_refused(w, tmp_path):
    with pytest.raises(ResidencyViolation, match="declares 10"):
        _guard(w, tmp_path).release("payload", b"\x01" * 11, expected_size=10)


def test_pixel_grid_and_pickle_detectors():
    assert on_pixel_grid(torch.arange(256, dtype=torch.float32) / 255.0)
    assert on_pixel_grid(torch.arange(256, dtype=torch.float32) / 127.5 - 1.0)
    assert on_pixel_grid(torch.arange(1, 200, dtype=torch.float32))
    assert not on_pixel_grid(torch.randn(10_000) * 1e-3)
    assert not on_pixel_grid(torch.zeros(10_000))
    assert looks_like_pickle(pickle.dumps(None)) and looks_like_pickle(pickle.dumps([1, 2], protocol=2))
    assert not looks_like_pickle(b"\x10\x00\x00\x00{}" + bytes(range(256)))


# ---- the private-content index and the leak scan ----


def test_index_finds_private_rows_in_every_form_and_nothing_public(w, tmp_path):
    public = _episodes("public-probe/grid_point", 8)
    idx = fingerprints(w.eps, exclude=public)  # frames a public episode also shows are not private
    assert len(idx.frames) > 0
    private = [f for f in w.eps.frames_ELHWC.reshape(-1, SIZE, SIZE, 3) if idx.scan(f.tobytes())["frames"]]
    frame, actions = private[len(private) // 2], w.eps.actions_ELK[3]
    assert idx.scan(b"junk" + frame.tobytes())["frames"] == 1
    assert idx.scan(frames_to_tensor(frame).contiguous().numpy().tobytes())["frames"] == 1
    assert idx.scan(actions.tobytes())["values"] >= 1 and idx.scan(w.eps.proprio_ELP[1].tobytes())["values"] >= 1
    files = {
        "frames.pt": _torch_bytes(frames_to_tensor(np.stack(private[:4]))),  # channels-last storage in a zip
        "frame.png": _png(frame),
        "actions.json": json.dumps({"a": actions.tolist()}).encode(),
        "frame.json": json.dumps(frame.reshape(-1).tolist()).encode(),
        "frame.b64": base64.b64encode(frame.tobytes()),
        "frame.hex": frame.tobytes().hex().encode(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        assert any(scan_file(tmp_path / name, idx).values()), name
    for blob in (public.frames_ELHWC.tobytes(), frames_to_tensor(public.frames_ELHWC).contiguous().numpy().tobytes(),
                 public.actions_ELK.tobytes(), public.proprio_ELP.tobytes(), np.random.default_rng(0).bytes(1 << 20)):
        assert idx.scan(blob) == {"values": 0, "frames": 0}
    assert fingerprints(w.eps).digest() == fingerprints(w.eps).digest()  # reproducible


def test_index_save_load_roundtrip(w, tmp_path):
    store = tmp_path / "site" / "episodes.parquet"
    write_episodes(w.eps, store)
    w.index.save(store.with_name("private_index.npz"))
    loaded = load_index(store)
    assert loaded.digest() == w.index.digest() and len(loaded) == len(w.index)
    assert isinstance(load_index(tmp_path / "other" / "episodes.parquet", w.eps), PrivateIndex)


@pytest.mark.e2e
def test_nothing_private_leaves_in_a_full_pipeline_run(prefect_server, project):
    from flows.pipeline import pipeline_flow

    pipeline_flow(root=str(project))
    targets = [project / "reports", project / "mlflow.db", project / "mlartifacts", project / "exchange"]
    with closing(sqlite3.connect(project / "mlflow.db")) as db:  # the scan reads a store the run recorded into
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] >= 8  # the pipeline's parent run and its 7 stages' runs
    assert any((project / "reports").rglob("*.png"))
    indexes = {}
    for site_dir in sorted((project / "data" / "sites").iterdir()):
        eps = read_episodes(site_dir / "episodes.parquet", 16)
        indexes[site_dir.name] = load_index(site_dir / "episodes.parquet", eps)
        assert scan_paths(targets, indexes[site_dir.name]) == {}, site_dir.name
    assert set(indexes) == {"site_a", "site_b"}
    # positive controls: one private action row as text, one frame as a PNG, one proprio row as bytes
    eps = read_episodes(project / "data" / "sites" / "site_b" / "episodes.parquet", 16)
    report = project / "reports" / "federate.json"
    data = json.loads(report.read_text())
    data["debug"] = eps.actions_ELK[1, 4].tolist()
    report.write_text(json.dumps(data))
    (project / "reports" / "plots" / "sample.png").write_bytes(_png(eps.frames_ELHWC[2, 3]))
    (project / "exchange").mkdir(exist_ok=True)
    (project / "exchange" / "blob.bin").write_bytes(b"\x00" * 13 + eps.proprio_ELP[0, 6].tobytes())
    found = scan_paths(targets, indexes["site_b"])
    assert set(found) == {str(report), str(project / "reports" / "plots" / "sample.png"), str(project / "exchange" / "blob.bin")}
    assert found[str(report)]["values"] >= 1 and found[str(project / "reports" / "plots" / "sample.png")]["frames"] == 1
    assert scan_paths(targets, indexes["site_a"]) == {}


def test_the_residency_stage_scans_for_every_site_in_one_pass_and_names_a_planted_leak(prefect_server, project):
    """The stage's one shared scan still finds a site's private action row planted in reports/, names the
    file and the site, and leaves the last clean report as it was."""
    from flows.prepare import prepare_flow
    from flows.residency import residency_flow

    prepare_flow(root=str(project))
    residency_flow(root=str(project))
    clean = project / "reports" / "residency.json"
    report = json.loads(clean.read_text())
    assert report["status"] == "clean" and [s["site"] for s in report["sites"]] == ["site_a", "site_b"]
    assert all(s["leaks"] == 0 and s["fingerprints"] > 0 for s in report["sites"])
    before = clean.read_bytes()
    eps = read_episodes(project / "data" / "sites" / "site_b" / "episodes.parquet", 16)
    (project / "reports" / "notes.json").write_text(json.dumps({"debug": eps.actions_ELK[1, 4].tolist()}))
    with pytest.raises(ResidencyViolation, match=r"notes\.json \(site_b\)"):
        residency_flow(root=str(project))
    assert clean.read_bytes() == before
