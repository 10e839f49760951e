"""The round driver (lensemble.federation.rounds) without Prefect: drop and retry at every exchange step,
bad updates, every site failing, and the role split of the codecs."""
from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lensemble.errors import IntegrityError, ParticipantDropped
from lensemble.federation.rounds import (
    AggregatorCodec, InlineSites, NesterovStep, RoundResult, SiteCodec, SiteEndpoint, run_round,
)
from lensemble.federation.transport import param_spec
from lensemble.federation.transports import TRANSPORTS, aggregator_codec, site_codec

SITES = ("a", "b", "c")
BLOCK = 16
OUTER = NesterovStep(lr=0.7, momentum=0.9)


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, generator=g), "b": torch.randn(3, 5, generator=g)}


def _deltas() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return {s: {"w": 0.01 * torch.randn(40, generator=g), "b": 0.01 * torch.randn(3, 5, generator=g)} for s in SITES}


class Faulty(SiteEndpoint):
    """A site endpoint that raises at one step, or sends a message with one flipped byte."""

    def __init__(self, *args, fail_at: str = "", tamper: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at, self.tamper = fail_at, tamper
        self._public = kwargs.get("public_key")

    @property
    def public_key(self):
        if self.fail_at == "public_key":
            raise ConnectionError("site unreachable")
        return self._public

    @public_key.setter
    def public_key(self, value) -> None:
        self._public = value

    def _maybe(self, step: str, blob: bytes) -> bytes:
        if self.fail_at == step:
            raise TimeoutError(f"site timed out at {step}")
        if self.tamper == step:
            blob = bytearray(blob)
            blob[len(blob) // 2] ^= 0x01
            blob = bytes(blob)
        return blob

    def key_share(self, ctx):
        return self._maybe("key_share", super().key_share(ctx))

    def announce(self, ctx, shares):
        return self._maybe("announce", super().announce(ctx, shares))

    def encode(self, ctx, grid):
        payload, seconds = super().encode(ctx, grid)
        return self._maybe("encode", payload), seconds


def _pool(transport: str, sites=SITES, faults: dict | None = None, keys: dict | None = None) -> InlineSites:
    """Every site's endpoint with a codec holding its own signing key only."""
    keys = keys or {s: Ed25519PrivateKey.generate() for s in sites}
    public = {s: keys[s].public_key() for s in sites}
    deltas = _deltas()
    faults = faults or {}
    return InlineSites({s: Faulty(s, site_codec(transport, BLOCK, s, keys[s], public), lambda s=s: deltas[s], public_key=public[s],
                                  **faults.get(s, {})) for s in sites})


def _round(transport: str, pool: InlineSites, sites=SITES, policy: str = "continue") -> RoundResult:
    spec = param_spec(_params())
    return run_round("run", 3, sites, spec, pool, aggregator_codec(transport, BLOCK), _params(), None, OUTER, policy)


def _same_bits(x: dict, y: dict) -> bool:
    return sorted(x) == sorted(y) and all(torch.equal(x[k].view(torch.int32), y[k].view(torch.int32)) for k in x)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_clean_round_applies_every_site_and_counts_what_each_sent(transport):
    res = _round(transport, _pool(transport))
    assert res.members == SITES and res.dropped == {}
    assert all(res.comm_bytes(s) == res.setup_bytes[s] + res.announcement_bytes[s] + res.payload_bytes[s] > 0 for s in SITES)
    # the outer step from zero momentum: p - lr (1 + β) Δ̄, with Δ̄ the mean of the deltas up to quantization
    mean = {k: sum(d[k] for d in _deltas().values()) / 3 for k in ("w", "b")}
    for k, p in _params().items():
        expected = p + OUTER.lr * (1 + OUTER.momentum) * mean[k]
        assert torch.allclose(res.params[k], expected, atol=1e-3 if transport != "fp32" else 1e-6)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("step", ["public_key", "key_share", "announce", "encode"])
def test_a_site_failing_at_any_step_is_dropped_and_the_round_equals_one_without_it(transport, step):
    res = _round(transport, _pool(transport, faults={"b": {"fail_at": step}}))
    assert res.members == ("a", "c")
    assert list(res.dropped) == ["b"] and "Error" in res.dropped["b"]
    clean = _round(transport, _pool(transport, sites=("a", "c")), sites=("a", "c"))
    assert _same_bits(res.params, clean.params) and _same_bits(res.momentum, clean.momentum)


@pytest.mark.parametrize("transport,step", [("int8", "encode"), ("secure_int8", "encode"), ("secure_int8", "announce"),
                                            ("secure_int8", "key_share")])
def test_a_site_sending_a_bad_message_is_dropped_by_name(transport, step):
    """A flipped byte in a signed message (fp32 is unsigned: a flipped body byte is just another number)."""
    res = _round(transport, _pool(transport, faults={"c": {"tamper": step}}))
    assert res.members == ("a", "b")
    assert list(res.dropped) == ["c"] and res.dropped["c"].startswith("IntegrityError")
    clean = _round(transport, _pool(transport, sites=("a", "b")), sites=("a", "b"))
    assert _same_bits(res.params, clean.params)


def test_an_integrity_error_carries_the_site_it_names():
    exc = IntegrityError("update from 'x' has a bad Ed25519 signature", site="x")
    assert exc.site == "x" and IntegrityError("checkpoint corrupted").site is None


def test_a_site_presenting_a_new_signing_key_mid_run_is_dropped():
    keys = {s: Ed25519PrivateKey.generate() for s in SITES}
    aggregator = aggregator_codec("secure_int8", BLOCK)
    spec = param_spec(_params())
    run_round("run", 0, SITES, spec, _pool("secure_int8", keys=keys), aggregator, _params(), None, OUTER)
    keys["a"] = Ed25519PrivateKey.generate()  # an impostor for 'a'
    res = run_round("run", 1, SITES, spec, _pool("secure_int8", keys=keys), aggregator, _params(), None, OUTER)
    assert res.members == ("b", "c") and "different signing key" in res.dropped["a"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_site_failing_raises_and_changes_nothing(transport):
    before = _params()
    pool = _pool(transport, faults={s: {"fail_at": step} for s, step in zip(SITES, ("key_share", "announce", "encode"))})
    with pytest.raises(ParticipantDropped, match="every site dropped"):
        run_round("run", 3, SITES, param_spec(before), pool, aggregator_codec(transport, BLOCK), before, None, OUTER)
    assert _same_bits(before, _params())


def test_abort_policy_stops_at_the_first_failure():
    with pytest.raises(ParticipantDropped, match="drop_policy is abort"):
        _round("secure_int8", _pool("secure_int8", faults={"a": {"fail_at": "encode"}}), policy="abort")


def test_codecs_play_one_role_each():
    keys = {s: Ed25519PrivateKey.generate() for s in SITES}
    codec = site_codec("secure_int8", BLOCK, "a", keys["a"], {s: k.public_key() for s, k in keys.items()})
    assert isinstance(codec, SiteCodec) and list(codec._site_keys) == ["a"]
    aggregator = aggregator_codec("secure_int8", BLOCK)
    assert isinstance(aggregator, AggregatorCodec) and aggregator._site_keys == {}
    with pytest.raises(Exception, match="no Ed25519 signing key"):
        aggregator.key_share(__import__("lensemble.federation.transport", fromlist=["RoundContext"]).RoundContext(
            "run", 0, SITES, param_spec(_params())), "a")
