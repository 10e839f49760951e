"""The int8 and secure_int8 transports: exact sums, determinism, dropout retry, integrity, byte counts."""
from __future__ import annotations

import hashlib
import itertools
import struct

import pytest
import torch

from lensemble.errors import ConfigError, IntegrityError, ParticipantDropped
from lensemble.federation.outer import aggregate_and_step, nesterov_step, state_hash
from lensemble.federation.quant import (
    block_absmax, dequantize_int8, quantize_int8, quantize_with_scales, roundtrip_bound, scales_from_absmax,
)
from lensemble.federation.secure_transport import Int8Transport, SecureInt8Transport, expected_comm_bytes
from lensemble.federation.signing import generate_site_keys, sign
from lensemble.federation.transport import PlainFP32, RoundContext, flatten, param_spec

SITES = ("a", "b", "c", "d")
WEIGHTS = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4}
BLOCK = 64


def _deltas(sites=SITES, seed=0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed entries, so that blocks have very different scales.
    return {s: {"enc.w": torch.randn(33, 17, generator=g) ** 3, "pred.b": torch.randn(5, generator=g)} for s in sites}


DELTAS = _deltas()
SPEC = param_spec(DELTAS["a"])


def _ctx(sites=SITES, round_idx=3, run="run-1", weighted=True) -> RoundContext:
    return RoundContext(run, round_idx, tuple(sites), SPEC, {s: WEIGHTS[s] for s in sites} if weighted else {})


def _round(transport, ctx, deltas=DELTAS):
    """begin_round/announce/agree/encode; (setup bytes, announcements, payloads)."""
    setup = transport.begin_round(ctx)
    announcements = {s: transport.announce(ctx, s, deltas[s]) for s in ctx.site_ids}
    transport.agree(ctx, announcements)
    return setup, announcements, {s: transport.encode(ctx, s, deltas[s]) for s in ctx.site_ids}


def _flat(state) -> torch.Tensor:
    return flatten(SPEC, state)


def _secure_reference(ctx, deltas=DELTAS) -> torch.Tensor:
    """Σ_c q_c on the shared grid without any masking, dequantized the way the transport does."""
    xs = {s: _flat(deltas[s]) * torch.tensor(ctx.weight(s), dtype=torch.float32) for s in ctx.site_ids}
    scales = scales_from_absmax(torch.stack([block_absmax(x, BLOCK) for x in xs.values()]).amax(dim=0))
    codes = sum(quantize_with_scales(x, scales, BLOCK).to(torch.int32) for x in xs.values())
    return dequantize_int8(codes, scales, BLOCK, torch.float64).float(), scales


def _int8_reference(ctx, deltas=DELTAS) -> torch.Tensor:
    acc = torch.zeros(_flat(deltas["a"]).numel(), dtype=torch.float64)
    for s in ctx.site_ids:
        q, scales = quantize_int8(_flat(deltas[s]), BLOCK)
        acc += dequantize_int8(q, scales, BLOCK, torch.float64) * ctx.weight(s)
    return acc.float()


def _exact_mean(ctx, deltas=DELTAS) -> torch.Tensor:
    return sum(_flat(deltas[s]).double() * ctx.weight(s) for s in ctx.site_ids)


@pytest.mark.parametrize("weighted", [True, False])
def test_secure_sum_equals_the_plain_quantized_sum_bit_for_bit(weighted):
    ctx = _ctx(weighted=weighted)
    transport = SecureInt8Transport(block=BLOCK)
    _, _, payloads = _round(transport, ctx)
    mean = _flat(transport.aggregate(ctx, payloads))
    reference, scales = _secure_reference(ctx)
    assert torch.equal(mean, reference)
    # And within the documented bound of the exact weighted mean: C shared-grid roundings.
    bound = len(SITES) * roundtrip_bound(scales, mean.numel(), BLOCK) + 1e-6 * mean.abs().double()
    assert bool(((mean.double() - _exact_mean(ctx)).abs() <= bound).all())


def test_int8_mean_equals_the_fp64_reference_bit_for_bit():
    ctx = _ctx()
    transport = Int8Transport(block=BLOCK)
    _, _, payloads = _round(transport, ctx)
    assert torch.equal(_flat(transport.aggregate(ctx, payloads)), _int8_reference(ctx))


@pytest.mark.parametrize("transport_cls", [Int8Transport, SecureInt8Transport])
def test_arrival_order_does_not_change_a_bit(transport_cls):
    ctx = _ctx()
    transport = transport_cls(block=BLOCK)
    _, _, payloads = _round(transport, ctx)
    hashes = {
        state_hash(transport.aggregate(ctx, {s: payloads[s] for s in order}))
        for order in itertools.islice(itertools.permutations(SITES), 0, None, 5)
    }
    assert len(hashes) == 1


def test_outer_step_self_check_runs_on_the_secure_transport():
    # aggregate_and_step evaluates aggregate twice: a re-evaluation must not count as a replay.
    ctx = _ctx()
    transport = SecureInt8Transport(block=BLOCK)
    _, _, payloads = _round(transport, ctx)
    params = {name: torch.zeros(shape) for name, shape in SPEC}
    new_params, _ = aggregate_and_step(ctx, transport, payloads, params, None, lr=0.7, momentum=0.9)
    mean = transport.aggregate(ctx, payloads)  # evaluated once more: the same context, not a replay
    assert torch.equal(_flat(mean), _secure_reference(ctx)[0])
    assert state_hash(new_params) == state_hash(nesterov_step(params, mean, None, 0.7, 0.9)[0])


def test_dropout_retry_gives_the_sum_of_the_survivors_only():
    transport = SecureInt8Transport(block=BLOCK)
    full = _ctx()
    _, _, payloads = _round(transport, full)
    late = payloads.pop("c")
    with pytest.raises(ParticipantDropped, match=r"\['c'\]"):
        transport.aggregate(full, payloads)
    survivors = _ctx(sites=("a", "b", "d"))
    _, _, retry = _round(transport, survivors)
    assert torch.equal(_flat(transport.aggregate(survivors, retry)), _secure_reference(survivors)[0])
    # Nothing of the failed attempt is valid in the retry: its keys and grid are gone.
    for stale in (payloads["a"], late):
        with pytest.raises(IntegrityError):
            transport.aggregate(survivors, {**retry, "a": stale})


def test_a_missing_announcement_drops_the_site_before_any_mask_is_drawn():
    transport, ctx = SecureInt8Transport(block=BLOCK), _ctx()
    transport.begin_round(ctx)
    announcements = {s: transport.announce(ctx, s, DELTAS[s]) for s in ("a", "b", "d")}
    with pytest.raises(ParticipantDropped, match=r"no announcement from \['c'\]"):
        transport.agree(ctx, announcements)
    with pytest.raises(ValueError, match="announce/agree"):
        transport.encode(ctx, "a", DELTAS["a"])


def _flip(payload: bytes, index: int) -> bytes:
    return payload[:index] + bytes([payload[index] ^ 1]) + payload[index + 1 :]


@pytest.mark.parametrize("transport_cls", [Int8Transport, SecureInt8Transport])
def test_tampered_truncated_and_misbound_updates_are_rejected(transport_cls):
    keys = generate_site_keys(SITES)
    transport = transport_cls(keys, block=BLOCK)
    ctx = _ctx()
    _, _, good = _round(transport, ctx)
    p = good["b"]
    header_len = 4 + struct.unpack_from("<I", p)[0]
    bad = [
        (_flip(p, len(p) - 1), "bad Ed25519 signature"),  # the signature
        (_flip(p, header_len + 10), "bad Ed25519 signature"),  # a body byte
        (_flip(p, 10), "bad Ed25519 signature"),  # a header byte
        (p[:-10], "bad Ed25519 signature"),  # truncated body
        (p[:3], "is truncated"),
    ]
    for payload, reason in bad:
        with pytest.raises(IntegrityError, match=f"'b' (has a )?{reason}"):
            transport.aggregate(ctx, {**good, "b": payload})
    # Validly signed but the wrong size: a body cut short under a fresh signature.
    message = p[: -64 - 7]
    with pytest.raises(IntegrityError, match="body bytes"):
        transport.aggregate(ctx, {**good, "b": sign(keys["b"], message)})
    # After all those failures the honest round still goes through.
    transport.aggregate(ctx, good)


@pytest.mark.parametrize(
    "field, other",
    [("round", dict(round_idx=4)), ("run", dict(run="run-2"))],
)
def test_wrong_round_and_wrong_run_are_rejected(field, other):
    transport = Int8Transport(block=BLOCK)
    _, _, stale = _round(transport, _ctx(**other))
    ctx = _ctx()
    _, _, good = _round(transport, ctx)
    with pytest.raises(IntegrityError, match=f"'a' is bound to {field}="):
        transport.aggregate(ctx, {**good, "a": stale["a"]})


def test_wrong_shapes_are_rejected_at_both_ends():
    transport, ctx = Int8Transport(block=BLOCK), _ctx()
    _, _, good = _round(transport, ctx)
    wrong = {"enc.w": torch.zeros(17, 33), "pred.b": torch.zeros(5)}
    with pytest.raises(IntegrityError, match="'a'.*shape"):
        transport.encode(ctx, "a", wrong)
    other_spec = RoundContext("run-1", 3, SITES, param_spec(wrong), WEIGHTS)
    with pytest.raises(IntegrityError, match="'a' is bound to spec="):
        transport.aggregate(ctx, {**good, "a": transport.encode(other_spec, "a", wrong)})


def test_nan_and_inf_are_rejected():
    keys = generate_site_keys(SITES)
    transport, ctx = Int8Transport(keys, block=BLOCK), _ctx()
    _, _, good = _round(transport, ctx)
    with pytest.raises(IntegrityError, match="'a'.*NaN or Inf"):
        transport.encode(ctx, "a", {**DELTAS["a"], "pred.b": torch.full((5,), float("nan"))})
    # A site that signs a NaN scale is still caught by the aggregator.
    header_len = 4 + struct.unpack_from("<I", good["a"])[0]
    body = bytearray(good["a"][header_len:-64])
    body[0:4] = struct.pack("<f", float("inf"))
    forged = sign(keys["a"], good["a"][:header_len] + bytes(body))
    with pytest.raises(IntegrityError, match="'a' has scales that are NaN, Inf"):
        transport.aggregate(ctx, {**good, "a": forged})


def test_unknown_and_unregistered_sites_are_rejected():
    transport, ctx = Int8Transport(generate_site_keys(SITES), block=BLOCK), _ctx()
    _, _, good = _round(transport, ctx)
    with pytest.raises(IntegrityError, match="'mallory': site is not in the federation"):
        transport.aggregate(ctx, {**good, "mallory": good["a"]})
    wider = RoundContext("run-1", 3, (*SITES, "e"), SPEC)
    with pytest.raises(ConfigError, match="no Ed25519 signing key for site 'e'"):
        transport.encode(wider, "e", DELTAS["a"])
    impostor = Int8Transport(generate_site_keys(("a",)), block=BLOCK)  # holds its own key for 'a'
    with pytest.raises(IntegrityError, match="'a' has a bad Ed25519 signature"):
        transport.aggregate(ctx, {**good, "a": impostor.encode(ctx, "a", DELTAS["a"])})


def test_a_replayed_update_is_rejected():
    transport = Int8Transport(block=BLOCK)
    full = _ctx()
    _, _, accepted = _round(transport, full)
    first = transport.aggregate(full, accepted)
    assert state_hash(transport.aggregate(full, accepted)) == state_hash(first)  # re-evaluation, not replay
    survivors = _ctx(sites=("a", "b", "d"))
    _, _, fresh = _round(transport, survivors)
    with pytest.raises(IntegrityError, match="'a' replays one already accepted"):
        transport.aggregate(survivors, {**fresh, "a": accepted["a"]})
    transport.aggregate(survivors, fresh)


@pytest.mark.parametrize("transport_cls", [PlainFP32, Int8Transport, SecureInt8Transport])
def test_byte_counts_equal_the_formula(transport_cls):
    transport = transport_cls() if transport_cls is PlainFP32 else transport_cls(block=BLOCK)
    for ctx in (_ctx(), _ctx(round_idx=12345, run="a-much-longer-run-id")):
        setup, announcements, payloads = _round(transport, ctx)
        for site in ctx.site_ids:
            parts = expected_comm_bytes(
                transport.name, SPEC, len(ctx.site_ids), run_id=ctx.run_id, round_idx=ctx.round_idx, site=site,
                block=BLOCK,
            )
            assert parts["key_material"] == setup[site]
            assert parts["announcement"] == len(announcements[site])
            on_wire = parts["header"] + parts["scales"] + parts["body"] + parts["signature"]
            assert on_wire == len(payloads[site])
            assert parts["total"] == setup[site] + len(announcements[site]) + len(payloads[site])


def test_secure_int8_fits_the_wire_budget_and_refuses_an_overfull_ring():
    spec = (("enc.w", (1000, 1000)),)  # 10^6 federated parameters
    kw = dict(run_id="run-1", round_idx=99, site="site-007")
    names = ("fp32", "int8", "secure_int8")
    per_param = {name: expected_comm_bytes(name, spec, 8, **kw)["total"] / 1e6 for name in names}
    assert per_param["secure_int8"] <= 2.1 and per_param["int8"] <= 1.01 and per_param["fp32"] >= 4
    sites = tuple(f"s{i:03d}" for i in range(259))
    with pytest.raises(ConfigError, match="259 sites exceed the 16-bit"):
        SecureInt8Transport().begin_round(RoundContext("r", 0, sites, SPEC))
    with pytest.raises(ConfigError, match="259 sites"):
        expected_comm_bytes("secure_int8", spec, 259, **kw)
    with pytest.raises(ConfigError, match="unknown transport"):
        expected_comm_bytes("int4", spec, 2, **kw)


def test_payload_digests_differ_between_attempts():
    transport, ctx = SecureInt8Transport(block=BLOCK), _ctx()
    digests = {hashlib.sha256(_round(transport, ctx)[2]["a"]).hexdigest() for _ in range(2)}
    assert len(digests) == 2  # fresh keys per attempt: nothing to replay across attempts


def test_wire_benchmarks_run_at_tiny_sizes():
    from benchmarks import wire

    assert wire.bench_keystream(1 << 16, repeats=1)["keystream_gbps"] > 0
    assert wire.bench_quant_mask(1000, num_sites=3, block=64, repeats=1)["total_s"] > 0
    figures = wire.bench_aggregate(num_sites=3, numel=1000, block=64, copy_bytes=1 << 20)
    assert figures["ratio"] > 0 and figures["floor_s"] > 0


def _distributed_round(ctx, deltas=DELTAS, tamper_share: str | None = None):
    """One secure_int8 round with every party its own object: sites hold only their own signing key."""
    keys = generate_site_keys(ctx.site_ids)
    sites = {s: SecureInt8Transport({s: keys[s]}, block=BLOCK) for s in ctx.site_ids}
    aggregator = SecureInt8Transport({}, block=BLOCK)
    for s in ctx.site_ids:
        aggregator.register(s, keys[s].public_key())
        for other in ctx.site_ids:
            sites[other].register(s, keys[s].public_key())
    shares = {s: sites[s].key_share(ctx, s) for s in ctx.site_ids}
    if tamper_share:
        shares[tamper_share] = bytes([shares[tamper_share][0] ^ 1]) + shares[tamper_share][1:]
    aggregator.accept_shares(ctx, shares)
    for s in ctx.site_ids:
        sites[s].accept_shares(ctx, shares)
    announcements = {s: sites[s].announce(ctx, s, deltas[s]) for s in ctx.site_ids}
    aggregator.agree(ctx, announcements)
    grid = aggregator.grid_message(ctx)
    payloads = {}
    for s in ctx.site_ids:
        sites[s].accept_grid(ctx, grid)
        payloads[s] = sites[s].encode(ctx, s, deltas[s])
    return aggregator, payloads


def test_parties_holding_only_their_own_keys_give_the_same_bits_as_one_object():
    ctx = _ctx()
    aggregator, payloads = _distributed_round(ctx)
    distributed = _flat(aggregator.aggregate(ctx, payloads))
    one = SecureInt8Transport(block=BLOCK)
    _, _, single = _round(one, ctx)
    assert torch.equal(distributed, _flat(one.aggregate(ctx, single)))
    assert torch.equal(distributed, _secure_reference(ctx)[0])


def test_a_tampered_key_share_is_refused_naming_the_site():
    with pytest.raises(IntegrityError, match="'b'.*bad Ed25519 signature"):
        _distributed_round(_ctx(), tamper_share="b")


def test_a_site_cannot_sign_for_another_or_swap_its_registered_key():
    keys = generate_site_keys(("a", "b"))
    site_a = SecureInt8Transport({"a": keys["a"]}, block=BLOCK)
    site_a.register("b", keys["b"].public_key())
    with pytest.raises(ConfigError, match="no Ed25519 signing key for site 'b'"):
        site_a.key_share(_ctx(("a", "b")), "b")
    with pytest.raises(IntegrityError, match="'b' presented a different signing key"):
        site_a.register("b", generate_site_keys(("b",))["b"].public_key())


def test_a_grid_message_of_the_wrong_length_is_refused():
    ctx = _ctx()
    keys = generate_site_keys(ctx.site_ids)
    site = SecureInt8Transport({"a": keys["a"]}, block=BLOCK)
    for s in ctx.site_ids:
        site.register(s, keys[s].public_key())
    shares = {s: SecureInt8Transport({s: keys[s]}, block=BLOCK).key_share(ctx, s) for s in ctx.site_ids}
    site.accept_shares(ctx, shares)
    with pytest.raises(IntegrityError, match="grid message from the aggregator has 3 bytes"):
        site.accept_grid(ctx, b"abc")
