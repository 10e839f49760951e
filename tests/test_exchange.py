"""The exchange (write-once blobs over fsspec) and a sovereign site's round snapshots."""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from lensemble.errors import ConfigError, ParticipantDropped
from lensemble.federation.exchange import Exchange, exchange_url, pack_tensors, unpack_tensors
from orchestration.site_agent import snapshot_before


@pytest.fixture(params=["file", "memory"])
def ex(request, tmp_path):
    url = (tmp_path / "exchange").as_uri() if request.param == "file" else f"memory://lensemble-{uuid.uuid4().hex}"
    return Exchange(url)


# names of the exchange layout (module docstring of lensemble.federation.exchange); others are refused
A, B = "r/round-0/a0/grid.bin", "r/round-0/global.pt"


def test_put_then_get_round_trips_and_leaves_no_temporary(ex, tmp_path):
    assert ex.get(A) is None
    assert ex.put(A, b"\x00payload") == 8
    assert ex.get(A) == b"\x00payload"
    assert [p.rsplit("/", 1)[-1] for p in ex.fs.ls(ex._path("r/round-0/a0"), detail=False)] == ["grid.bin"]
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    ex.put(B, pack_tensors(state))
    assert torch.equal(unpack_tensors(ex.get(B))["w"], state["w"])


def test_first_prefers_earlier_names_and_gives_up_at_the_deadline(ex):
    late, done = "x/round-0/a1/open.json", "x/round-0/done.json"
    ex.put(late, b"2")
    ex.put(done, b"1")
    assert ex.first([done, late], time.monotonic() + 1, "t") == (done, b"1")
    t0 = time.monotonic()
    with pytest.raises(ParticipantDropped, match="nothing at \\['x/never'\\]"):
        ex.first(["x/never"], time.monotonic() + 0.3, "t")
    assert time.monotonic() - t0 < 2


def test_gather_returns_what_arrived_by_the_deadline(ex):
    ex.put("g/round-0/a0/a.key", b"a")
    got = ex.gather({"a": "g/round-0/a0/a.key", "b": "g/round-0/a0/b.key"}, time.monotonic() + 0.2)
    assert got == {"a": b"a"}


def test_remove_tree_removes_a_run(ex):
    ex.put("run1/round-0/global.pt", b"1")
    ex.put("keys/a.pub", b"k")
    ex.remove_tree("run1")
    assert ex.get("run1/round-0/global.pt") is None and ex.get("keys/a.pub") == b"k"


def test_an_unreachable_or_unknown_exchange_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="federate.exchange .* cannot be reached"):
        Exchange((blocker / "exchange").as_uri()).check()
    with pytest.raises(ConfigError, match="federate.exchange 'nosuchproto://x' cannot be used"):
        Exchange("nosuchproto://x")


def test_a_plain_path_is_a_folder_under_the_project(tmp_path):
    assert exchange_url("exchange", tmp_path) == (tmp_path.resolve() / "exchange").as_uri()
    assert exchange_url("/srv/x", tmp_path) == "file:///srv/x"
    assert exchange_url("s3://bucket/p", tmp_path) == "s3://bucket/p"


def test_a_redone_round_starts_from_the_state_before_it(tmp_path):
    state = tmp_path / "state.pt"
    state.write_bytes(b"after round 0")
    snapshot_before(tmp_path, 1)  # round 1 starts: keep the state from before it
    state.write_bytes(b"after round 1 (never committed)")
    snapshot_before(tmp_path, 1)  # the coordinator crashed and redoes round 1
    assert state.read_bytes() == b"after round 0"
    state.write_bytes(b"after round 1")
    snapshot_before(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("before-*.pt")) == ["before-2.pt"]
