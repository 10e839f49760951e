"""INV-TYPED-RELEASE: every message a site releases matches its channel's schema exactly.

Attack families, one parametrized test per family, each attack refused with `ResidencyViolation`
whose message names the channel ("refused <channel>") and, for the guard, exactly one audit line:
update, public_probe_embedding, metrics, manifest, log, payload, exchange object name, and the
leak scan of the exchange run tree. No false positives: every message the real pipeline releases
passes, built with the real code paths on a micro project (`tasks.data.generate_site`/`generate_probe`,
then `tasks.train.site_train` for one round, the three transports' encoders, the exchange layout).
"""
from __future__ import annotations

import base64
import gzip
import io
import json
import math
import pickle
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lensemble.config import load_params
from lensemble.data.residency import METRIC_NAMES, ResidencyGuard
from lensemble.data.windows import frames_to_tensor
from lensemble.errors import ResidencyViolation
from lensemble.federation.exchange import Exchange, attempt_prefix, pack_json, pack_tensors, round_prefix, unpack_tensors
from lensemble.federation.transport import RoundContext, param_spec
from lensemble.federation.transports import make_transport
from lensemble.gauge import drift
from lensemble.dynamics import ROUND_DYNAMICS
from lensemble.model.world_model import federated_state
from lensemble.paths import Layout
from lensemble.training import encode_frames
from lensemble.workflow import build_model, embodiments, load_site, probe_frames, site_embodiment, site_names
from tests.conftest import make_project, micro_params

SITE = "site_a"
RUN = "0123abcd"


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A micro project with both sites' data and one real round of `site_train` at site_a."""
    from tasks.data import generate_probe, generate_site
    from tasks.train import site_train

    root = make_project(tmp_path_factory.mktemp("typed") / "proj", micro_params())
    p, layout = load_params(root / "params.yaml"), Layout(root)
    manifests = {s.name: generate_site.fn(p, s.name, s.embodiment, s.episodes, layout.site_episodes(s.name)) for s in p.data.sites}
    for emb in embodiments(p):
        generate_probe.fn(p, emb, layout.probe(emb))
    torch.set_num_threads(1)
    model = build_model(p, "global")
    state = federated_state(model)
    probe = probe_frames(layout, p)
    global_probe = encode_frames(model, probe)
    work = root / "site_state" / SITE
    work.mkdir(parents=True)
    trained = site_train.fn(p, layout, SITE, 0, state, probe, global_probe, work / "state.pt", work / "delta.pt")
    delta = torch.load(work / "delta.pt", weights_only=True)
    eps = load_site(layout, p, SITE)
    from lensemble.data.audit import PrivateIndex, index_path

    index = PrivateIndex.load(index_path(layout.site_episodes(SITE)))
    row = next(r for r in eps.actions_ELK.reshape(-1, eps.actions_ELK.shape[-1]) if index.scan(r.tobytes())["values"])
    private_frames = [f for f in eps.frames_ELHWC.reshape(-1, *eps.frames_ELHWC.shape[2:]) if index.scan(f.tobytes())["frames"]]
    return SimpleNamespace(p=p, layout=layout, root=root, manifests=manifests, state=state, spec=param_spec(state), probe=probe,
                           trained=trained, delta=delta, dim=model.latent_dim, rows=probe.shape[0], eps=eps, index=index, row=row,
                           frame=private_frames[len(private_frames) // 2])


def _guard(real, tmp_path: Path, private: bool = True) -> ResidencyGuard:
    return ResidencyGuard(SITE, real.spec, tmp_path / "audit.jsonl", probe_rows=real.rows, probe_dim=real.dim,
                          private=real.index if private else None)


def _refused(guard: ResidencyGuard, tmp_path: Path, kind: str, obj: object, **kw) -> str:
    """Release `obj`, expect a refusal naming the channel and exactly one audit line; the message."""
    with pytest.raises(ResidencyViolation, match=f"site '{SITE}': refused {kind}: ") as err:
        guard.release(kind, obj, **kw)
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["decision"] == "refused" and json.loads(lines[0])["kind"] == kind
    return str(err.value)


def _pixels(n: int, form: str = "unit") -> np.ndarray:
    """n values of a real 8-bit image (a gradient) as a frame tensor holds them."""
    k = (np.arange(n) * 37 % 254 + 1).astype(np.float32)
    return {"unit": k / 255.0, "signed": k / 127.5 - 1.0, "int": k}[form].astype(np.float32)


def _spread(delta: dict, per_tensor: int, form: str = "unit") -> dict:
    """`delta` with the first `per_tensor` values of EVERY tensor replaced by pixels (many small pieces of a frame)."""
    out, pix, at = {}, _pixels(100_000, form), 0
    for name in sorted(delta):
        t = delta[name].clone().reshape(-1)
        n = min(per_tensor, t.numel())
        t[:n] = torch.from_numpy(pix[at : at + n])
        at += n
        out[name] = t.reshape(delta[name].shape)
    return out


def _run_in(delta: dict, name: str, n: int) -> dict:
    out = dict(delta)
    t = delta[name].clone().reshape(-1)
    t[100 : 100 + n] = torch.from_numpy(_pixels(n, "signed"))
    out[name] = t.reshape(delta[name].shape)
    return out


def _across_boundary(real) -> dict:
    """A private action pair split over two tensors: the last value of one, the first of the next (name order)."""
    names = sorted(real.delta)
    a, b = names[0], names[1]
    out = dict(real.delta)
    ta, tb = real.delta[a].clone().reshape(-1), real.delta[b].clone().reshape(-1)
    ta[-1], tb[0] = float(real.row[0]), float(real.row[1])
    out[a], out[b] = ta.reshape(real.delta[a].shape), tb.reshape(real.delta[b].shape)
    return out


def _big(real) -> str:
    return max(real.delta, key=lambda n: real.delta[n].numel())


def _small(real) -> str:
    return min(real.delta, key=lambda n: real.delta[n].numel())


UPDATE_ATTACKS = [
    ("frame-spread-over-every-tensor", lambda r: _spread(r.delta, 12)),
    ("frame-spread-signed-form", lambda r: _spread(r.delta, 12, "signed")),
    ("frame-spread-integer-form", lambda r: _spread(r.delta, 12, "int")),
    ("one-pixel-row-inside-a-tensor", lambda r: _run_in(r.delta, _big(r), 16)),
    ("private-pair-across-tensor-boundary", _across_boundary),
    ("nan-in-smallest-tensor", lambda r: {**r.delta, _small(r): torch.full_like(r.delta[_small(r)], float("nan"))}),
    ("inf-in-a-tensor", lambda r: {**r.delta, _small(r): torch.full_like(r.delta[_small(r)], float("inf"))}),
    ("float64-tensor", lambda r: {**r.delta, _small(r): r.delta[_small(r)].double()}),
    ("float16-tensor", lambda r: {**r.delta, _small(r): r.delta[_small(r)].half()}),
    ("int-tensor", lambda r: {**r.delta, _small(r): r.delta[_small(r)].to(torch.int32)}),
    ("same-numel-other-shape", lambda r: {**r.delta, _big(r): r.delta[_big(r)].reshape(-1)}),
    ("extra-tensor", lambda r: {**r.delta, "predictor.private": torch.zeros(3)}),
    ("numpy-array-for-a-tensor", lambda r: {**r.delta, _small(r): r.delta[_small(r)].numpy()}),
]


@pytest.mark.parametrize("name, build", UPDATE_ATTACKS, ids=[a[0] for a in UPDATE_ATTACKS])
def test_update_attacks_are_refused(real, tmp_path, name, build):
    _refused(_guard(real, tmp_path), tmp_path, "update", build(real))


def _view_of_larger(real) -> torch.Tensor:
    big = torch.randn(real.rows, 2 * real.dim)
    return big[:, : real.dim]


PROBE_ATTACKS = [
    ("wider-than-latent", lambda r: torch.randn(r.rows, r.dim + 1)),
    ("private-tokens-flattened", lambda r: torch.randn(r.rows, 2 * r.dim)),
    ("token-embeddings-rank-3", lambda r: torch.randn(r.rows, 4, r.dim)),
    ("all-tokens-as-rows", lambda r: torch.randn(r.rows * 4, r.dim)),
    ("float64", lambda r: torch.randn(r.rows, r.dim, dtype=torch.float64)),
    ("bfloat16", lambda r: torch.randn(r.rows, r.dim).bfloat16()),
    ("nan-embedding", lambda r: torch.full((r.rows, r.dim), float("nan"))),
    ("numpy-array", lambda r: np.zeros((r.rows, r.dim), np.float32)),
    ("list-of-rows", lambda r: [torch.zeros(r.dim)] * r.rows),
    ("parameter-subclass", lambda r: torch.nn.Parameter(torch.randn(r.rows, r.dim))),
    ("sparse", lambda r: torch.randn(r.rows, r.dim).to_sparse()),
    ("frame-pixels-as-embedding", lambda r: torch.from_numpy(_pixels(r.rows * r.dim, "signed")).reshape(r.rows, r.dim)),
    ("private-actions-in-embedding", lambda r: _with_values(torch.randn(r.rows, r.dim), r.eps.actions_ELK[1].reshape(-1))),
]


def _with_values(t: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[: values.size] = torch.from_numpy(np.array(values, np.float32))
    return t


@pytest.mark.parametrize("name, build", PROBE_ATTACKS, ids=[a[0] for a in PROBE_ATTACKS])
def test_probe_embedding_attacks_are_refused(real, tmp_path, name, build):
    _refused(_guard(real, tmp_path), tmp_path, "public_probe_embedding", build(real))


def test_probe_embedding_needs_a_declared_width(real, tmp_path):
    guard = ResidencyGuard(SITE, real.spec, tmp_path / "audit.jsonl", probe_rows=real.rows)
    assert "no public probe size" in _refused(guard, tmp_path, "public_probe_embedding", torch.randn(real.rows, real.dim))


METRICS_ATTACKS = [
    ("number-as-text", {"loss/pred": "0.5"}),
    ("free-text-under-a-legal-name", {"loss/pred": "site_a frames look dark"}),
    ("nan", {"loss/pred": float("nan")}),
    ("numpy-nan", {"loss/pred": np.float64("nan")}),
    ("plus-inf", {"loss/pred": float("inf")}),
    ("minus-inf", {"train_seconds": float("-inf")}),
    ("float64-beyond-fp32", {"loss/pred": 1e39}),
    ("unknown-name", {"loss/private": 0.5}),
    ("value-hidden-in-a-name", {"loss/0.123456": 1.0}),
    ("bool", {"steps": True}),
    ("none", {"loss/pred": None}),
    ("list", {"loss/pred": [0.1, 0.2]}),
    ("nested-dict", {"loss/pred": {"v": 0.1}}),
    ("tensor-0d", {"loss/pred": torch.tensor(0.5)}),
    ("numpy-0d-array", {"loss/pred": np.array(0.5)}),
    ("int-beyond-int32", {"steps": 1 << 40}),
    ("bytes", {"loss/pred": b"\x00\x01"}),
    ("complex", {"loss/pred": 1 + 2j}),
    ("decimal", {"loss/pred": Decimal("0.5")}),
    ("non-string-key", {3: 0.5}),
]


@pytest.mark.parametrize("name, metrics", METRICS_ATTACKS, ids=[a[0] for a in METRICS_ATTACKS])
def test_metrics_attacks_are_refused(real, tmp_path, name, metrics):
    msg = _refused(_guard(real, tmp_path), tmp_path, "metrics", metrics)
    assert "0.123456" not in msg and "frames look dark" not in msg  # untrusted strings are never echoed


def test_metrics_refuse_containers_and_private_pairs(real, tmp_path):
    for i, obj in enumerate([list({"loss/pred": 0.5}.items()), type("D", (dict,), {})({"loss/pred": 0.5}),
                             {"loss/pred": float(real.row[0]), "loss/sigreg": float(real.row[1])}]):
        sub = tmp_path / str(i)
        sub.mkdir()
        _refused(_guard(real, sub), sub, "metrics", obj)


def _manifest(real, **change) -> dict:
    m = dict(real.manifests[SITE])
    m.update(change)
    return {k: v for k, v in m.items() if v is not _DROP}


_DROP = object()
MANIFEST_ATTACKS = [
    ("extra-free-text-field", {"note": "hello"}),
    ("missing-field", {"content_hash": _DROP}),
    ("hash-not-hex", {"content_hash": "z" * 64}),
    ("hash-upper-case", {"file_sha256": "AB" * 32}),
    ("hash-carrying-base64", {"schema_hash": base64.b64encode(b"\x01" * 40).decode()}),
    ("negative-count", {"episodes": -1}),
    ("float-count", {"steps": 24.5}),
    ("bool-count", {"episodes": True}),
    ("embodiment-free-text", {"embodiment": "grid point, dark room"}),
    ("nested-value", {"steps": {"n": 3}}),
    ("list-value", {"episodes": [1, 2]}),
]


@pytest.mark.parametrize("name, change", MANIFEST_ATTACKS, ids=[a[0] for a in MANIFEST_ATTACKS])
def test_manifest_attacks_are_refused(real, tmp_path, name, change):
    _refused(_guard(real, tmp_path), tmp_path, "manifest", _manifest(real, **change))


LOG = {"event": "round-done", "run": RUN, "stage": "federate", "round": 1, "participant": SITE, "name": "loss/pred", "value": 0.25,
       "sha256": "ab" * 32}
LOG_ATTACKS = [
    ("unknown-event", {"event": "debug"}),
    ("free-text-message", {"msg": "frame 3 was dark"}),
    ("missing-event", {"event": _DROP}),
    ("another-site", {"participant": "site_b"}),
    ("nan-value", {"value": float("nan")}),
    ("value-as-text", {"value": "0.25"}),
    ("name-off-whitelist", {"name": "loss/private"}),
    ("negative-round", {"round": -1}),
    ("sha256-not-hex", {"sha256": "not a digest"}),
    ("tensor-field", {"value": torch.tensor(0.25)}),
    ("name-with-spaces", {"stage": "federate and more"}),
]


@pytest.mark.parametrize("name, change", LOG_ATTACKS, ids=[a[0] for a in LOG_ATTACKS])
def test_log_attacks_are_refused(real, tmp_path, name, change):
    rec = {k: v for k, v in {**LOG, **change}.items() if v is not _DROP}
    _refused(_guard(real, tmp_path), tmp_path, "log", rec)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


PAYLOAD_ATTACKS = [
    ("torch-save-zip", lambda r: _torch_bytes(r.delta)),
    ("pickle", lambda r: pickle.dumps(r.eps.actions_ELK[0].tolist())),
    ("npy", lambda r: b"\x93NUMPY" + r.eps.actions_ELK[0].tobytes()),
    ("gzip-of-frames", lambda r: gzip.compress(r.eps.frames_ELHWC[0, 0].tobytes())),
    ("bytearray", lambda r: bytearray(b"\x01\x02")),
    ("memoryview", lambda r: memoryview(b"\x01\x02")),
    ("raw-private-frame-inside", lambda r: b"\x10hdr" + r.frame.tobytes() + b"sig"),
    ("private-actions-inside", lambda r: b"\x05\x00abc" + r.eps.actions_ELK[2].tobytes()),
]


@pytest.mark.parametrize("name, build", PAYLOAD_ATTACKS, ids=[a[0] for a in PAYLOAD_ATTACKS])
def test_payload_attacks_are_refused(real, tmp_path, name, build):
    _refused(_guard(real, tmp_path), tmp_path, "payload", build(real))


# ---- the exchange: a fixed grammar of names, write-once ----

NAME_ATTACKS = [
    ("parent-escape", "../outside.pt"),
    ("absolute-path", "/tmp/x.pt"),
    ("value-in-a-file-name", f"{RUN}/round-0/{SITE}/0.123456.pt"),
    ("unknown-kind", f"{RUN}/round-0/a0/{SITE}.frames"),
    ("unknown-round-file", f"{RUN}/round-0/notes.txt"),
    ("site-name-too-long", f"{RUN}/round-0/a0/{'s' * 65}.upd"),
    ("leading-zero-round", f"{RUN}/round-01/global.pt"),
    ("probe-not-hex", ".probe-" + "g" * 32),
    ("private-key-name", f"keys/{SITE}.ed25519"),
    ("trailing-newline", f"{RUN}/round-0/global.pt\n"),
    ("double-slash", f"{RUN}//round-0/global.pt"),
    ("unicode-lookalike", f"{RUN}/round-0/gl\u043ebal.pt"),
    ("bytes-name", f"{RUN}/round-0/global.pt".encode()),
    ("nested-deeper", f"{RUN}/round-0/a0/x/{SITE}.upd"),
]


@pytest.fixture
def ex(tmp_path):
    return Exchange((tmp_path / "exchange").as_uri())


@pytest.mark.parametrize("name, rel", NAME_ATTACKS, ids=[a[0] for a in NAME_ATTACKS])
def test_exchange_refuses_names_off_the_layout_and_writes_nothing(ex, tmp_path, name, rel):
    with pytest.raises(ResidencyViolation, match="refused exchange object name: ") as err:
        ex.put(rel, b"x")
    assert "0.123456" not in str(err.value)
    assert not (tmp_path / "exchange").exists() or not any(p.is_file() for p in (tmp_path / "exchange").rglob("*"))


BODY_ATTACKS = [
    ("enc-seconds-free-text", b"frames were dark"),
    ("enc-seconds-too-long", b"0." + b"1" * 40),
    ("enc-seconds-with-payload", b"0.5\n" + b"\x00" * 8),
]


@pytest.mark.parametrize("name, body", BODY_ATTACKS, ids=[a[0] for a in BODY_ATTACKS])
def test_exchange_refuses_a_typed_body_that_does_not_parse(ex, name, body):
    with pytest.raises(ResidencyViolation, match="refused exchange object name: .*decimal number"):
        ex.put(f"{attempt_prefix(RUN, 0, 0)}/{SITE}.enc_seconds", body)


@pytest.mark.parametrize("url", ["file", "memory"])
def test_exchange_objects_are_write_once_and_retries_are_idempotent(tmp_path, url):
    import uuid

    ex = Exchange((tmp_path / "exchange").as_uri() if url == "file" else f"memory://typed-{uuid.uuid4().hex}")
    rel = f"{round_prefix(RUN, 0)}/{SITE}/train.pt"
    assert ex.put(rel, b"first") == 5
    assert ex.put(rel, b"first") == 5  # the same site retrying with the same bytes
    with pytest.raises(ResidencyViolation, match="refused exchange object name: .*write-once"):
        ex.put(rel, b"other")
    assert ex.get(rel) == b"first"
    with pytest.raises(ResidencyViolation, match="refused exchange object name: .*must be bytes"):
        ex.put(f"{round_prefix(RUN, 0)}/global.pt", bytearray(b"x"))


def test_a_packed_view_carries_only_its_own_elements():
    storage = torch.arange(100_000, dtype=torch.float32) + 0.5
    view = storage[1000:1016].reshape(4, 4)
    blob = pack_tensors({"probe": view, "rows": [storage[:8]]})
    assert len(blob) < 4000
    tail = storage[50_000:50_002].numpy().tobytes()
    assert tail not in blob and storage[1016:1018].numpy().tobytes() not in blob
    back = unpack_tensors(blob)
    assert torch.equal(back["probe"], view) and torch.equal(back["rows"][0], storage[:8])
    naive = io.BytesIO()
    torch.save({"probe": view}, naive)
    assert tail in naive.getvalue()  # what torch.save alone would have let ride along


def test_leak_scan_of_the_exchange_tree_refuses_and_keeps_it(real, tmp_path):
    from tasks.residency import check_exchange_tree

    ex = Exchange((tmp_path / "exchange").as_uri())
    a = attempt_prefix(RUN, 0, 0)
    ex.put(f"{round_prefix(RUN, 0)}/global.pt", pack_tensors({"state": real.state}))
    assert check_exchange_tree(real.p, real.layout, ex, RUN) == 1
    ex.put(f"{a}/{SITE}.upd", b"\x07hdr" + frames_to_tensor(real.frame).contiguous().numpy().tobytes())  # a legal name, a private frame
    with pytest.raises(ResidencyViolation, match=rf"private rows found in .*{SITE}\.upd \({SITE}\).*kept for inspection"):
        check_exchange_tree(real.p, real.layout, ex, RUN)
    assert ex.exists(f"{a}/{SITE}.upd")


def test_leak_scan_of_the_outputs_covers_reports_mlflow_and_the_prefect_database(real, tmp_path, monkeypatch):
    """Prefect keeps artifacts and logs in its database: a private action row written there as text
    (what a markdown artifact would hold) is found, as in reports/ and the MLflow store."""
    from tasks.residency import check_outputs, output_targets

    home = tmp_path / "prefect-home"
    home.mkdir()
    monkeypatch.setenv("PREFECT_HOME", str(home))
    (home / "prefect.db").write_bytes(b"SQLite format 3\x00 artifact | clean table |")
    assert home / "prefect.db" in output_targets(real.layout)
    assert check_outputs(real.p, real.layout) == len(real.p.data.sites)
    row = " | ".join(repr(float(x)) for x in real.row)
    (home / "prefect.db-wal").write_bytes(f"| action | {row} |".encode())
    with pytest.raises(ResidencyViolation, match=r"private rows found in .*prefect\.db-wal"):
        check_outputs(real.p, real.layout)


# ---- no false positives: what the real pipeline releases passes ----


def test_a_real_site_round_released_everything_it_sends(real):
    audit = [json.loads(line) for line in real.layout.site_audit(SITE).read_text().splitlines()]
    assert [r["kind"] for r in audit] == ["update", "metrics", "public_probe_embedding", "metrics"]
    assert all(r["decision"] == "released" for r in audit)
    metrics = real.trained["metrics"]
    assert set(metrics) <= METRIC_NAMES and set(ROUND_DYNAMICS) <= METRIC_NAMES
    assert {f"gauge/{k}" for k in drift(torch.randn(8, 4), torch.randn(8, 4))} <= METRIC_NAMES
    assert all(type(v) in (int, float) and math.isfinite(v) and (type(v) is int or v == float(np.float32(v))) for v in metrics.values())
    assert tuple(real.trained["probe_embedding"].shape) == (real.rows, real.dim)
    assert set(real.trained) == {"metrics", "probe_embedding", "task_seconds"}


def test_real_messages_pass_again_unchanged(real, tmp_path):
    guard = _guard(real, tmp_path)
    assert guard.release("update", real.delta) is real.delta
    assert guard.release("metrics", real.trained["metrics"]) == real.trained["metrics"]  # fp32 values are a fixed point
    assert torch.equal(guard.release("public_probe_embedding", real.trained["probe_embedding"]), real.trained["probe_embedding"])
    for site in site_names(real.p):
        assert guard.release("manifest", real.manifests[site]) == real.manifests[site]
    assert guard.release("log", LOG) == LOG
    assert guard.release("metrics", {"task_seconds": real.trained["task_seconds"]})


@pytest.mark.parametrize("transport", ["fp32", "int8", "secure_int8"])
def test_real_transport_messages_pass_the_payload_channel(real, tmp_path, transport):
    sites = tuple(site_names(real.p))
    deltas = {s: {n: t * (1.0 if s == SITE else -0.5) for n, t in real.delta.items()} for s in sites}
    codec = make_transport(transport, real.p.federate.quant_block)
    ctx = RoundContext(RUN, 0, sites, real.spec)
    codec.begin_round(ctx)
    messages = [codec.key_share(ctx, s) for s in sites]
    anns = {s: codec.announce(ctx, s, deltas[s]) for s in sites}
    codec.agree(ctx, anns)
    messages += [*anns.values(), codec.grid_message(ctx)]
    messages += [codec.encode(ctx, s, deltas[s]) for s in sites]
    guard = _guard(real, tmp_path)
    for blob in messages:
        assert guard.release("payload", blob, expected_size=len(blob)) is blob


def test_every_name_the_protocol_writes_is_on_the_layout(real, tmp_path):
    ex = Exchange((tmp_path / "exchange").as_uri())
    ex.check()
    r, a = round_prefix(RUN, 12), attempt_prefix(RUN, 12, 3)
    blobs = {
        f"keys/{SITE}.pub": b"\x01" * 32,
        f"{r}/global.pt": pack_tensors({"state": real.state, "global_probe": torch.randn(real.rows, 4, real.dim)}),
        f"{r}/{SITE}/train.pt": pack_tensors(real.trained),
        f"{a}/open.json": pack_json({"sites": ["site_a", "site_b"]}),
        f"{a}/{SITE}.key": b"k" * 64,
        f"{a}/roster.pt": pack_tensors({SITE: b"k" * 64}),
        f"{a}/{SITE}.ann": b"",
        f"{a}/grid.bin": b"g" * 16,
        f"{a}/{SITE}.upd": b"\x07" * 100,
        f"{a}/{SITE}.enc_seconds": str(0.0123).encode(),
        f"{r}/done.json": pack_json({"round": 12}),
    }
    for rel, blob in blobs.items():
        assert ex.put(rel, blob) == len(blob)
    back = unpack_tensors(ex.get(f"{r}/{SITE}/train.pt"))
    assert back["metrics"] == real.trained["metrics"]
    from tasks.residency import check_exchange_tree

    assert check_exchange_tree(real.p, real.layout, ex, RUN) == len(blobs) - 1  # keys/ is outside the run tree
    assert site_embodiment(real.p, SITE) == real.manifests[SITE]["embodiment"]


def test_at_least_forty_attacks():
    n = (len(UPDATE_ATTACKS) + len(PROBE_ATTACKS) + len(METRICS_ATTACKS) + len(MANIFEST_ATTACKS) + len(LOG_ATTACKS)
         + len(PAYLOAD_ATTACKS) + len(NAME_ATTACKS) + len(BODY_ATTACKS))
    assert n >= 40


def test_adamw_atoms_on_the_pixel_grid_pass():
    """AdamW moves many weights by the same amounts: 2 steps at lr 0.002 land within 1e-6 of 1/255
    (the 16-site run), 50 steps put hundreds of values at ±3/255 and a few at neighbouring levels (the
    default params, round 0: 8x the on-grid count of a continuous distribution). Such atoms are not
    an image and must pass; a 16-value pixel row among them must not."""
    from lensemble.data.residency import on_pixel_grid

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(400_000, generator=gen) * 1e-2
    sign = torch.where(torch.rand(400_000, generator=gen) < 0.5, -1.0, 1.0)
    values[::1000] = (1.0 / 255.0 + torch.randn(400, generator=gen) * 3e-7) * sign[::1000]
    values[7::800] = (3.0 / 255.0 + torch.randn(500, generator=gen) * 3e-7) * sign[7::800]
    values[11::20000] = torch.randint(1, 8, (20,), generator=gen).float() / 255.0 * sign[11::20000]
    assert not on_pixel_grid(values)
    values[5_001:5_017] = torch.randint(1, 256, (16,), generator=gen).float() / 255.0  # a pixel row among them
    assert on_pixel_grid(values)


def test_random_key_material_is_not_taken_for_a_pickle():
    """A key share is random bytes: one whose X25519 key starts with b"." (STOP) used to parse as an
    empty pickle and was refused (1 in ~200 random blobs; it dropped site_c in round 12 of a fresh
    clone's default run). Real pickles of every protocol are still refused."""
    from lensemble.data.residency import looks_like_pickle

    gen = np.random.default_rng(0)
    blobs = [gen.bytes(96) for _ in range(20_000)]
    assert not any(looks_like_pickle(b) for b in blobs)
    assert not any(looks_like_pickle(b"." + b[1:]) or looks_like_pickle(b"N." + b[2:]) for b in blobs[:2_000])
    for protocol in range(6):
        assert looks_like_pickle(pickle.dumps([1.5, "x"], protocol=protocol))
