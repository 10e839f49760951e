"""A site's one-pass secure_int8 path (`site_pass`, `client_step.c`) against the reference, bit for bit.

The reference is the path as first written: flatten Δ_c, weight it (torch's fp32 multiply), check it,
`block_absmax` / `quantize_with_scales` on the shared grid, the whole-vector `site_mask`, `mask_codes`,
and `sign` over the concatenated bytes. Ed25519 is deterministic, so the payloads must be equal as
bytes; every test runs on the native kernel (where a C compiler exists) and on the eager path.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from lensemble.errors import IntegrityError
from lensemble.federation import secagg, site_pass
from lensemble.federation.quant import MAX_ABS, block_absmax, quantize_with_scales
from lensemble.federation.secure_transport import SecureInt8Transport, announce_header, secure_header
from lensemble.federation.signing import generate_site_keys, sign, signature
from lensemble.federation.transport import RoundContext, flatten, pack_header, param_spec

SITES = ("a", "b", "c")
BLOCK = 64


@pytest.fixture(params=[1, site_pass.CHUNK])
def chunk(request, monkeypatch):
    """One block per chunk (chunks and blocks cross tensor boundaries everywhere), and the default."""
    monkeypatch.setattr(site_pass, "CHUNK", request.param)
    return request.param


def _weighted(ctx: RoundContext, site: str, delta) -> torch.Tensor:
    return flatten(ctx.spec, delta) * torch.tensor(ctx.weight(site), dtype=torch.float32)


def _reference_announcement(transport, ctx, site, delta) -> bytes:
    absmax_B = block_absmax(_weighted(ctx, site, delta), transport.block)
    header = announce_header(ctx.run_id, ctx.round_idx, site, ctx.spec, transport._attempt.session)
    return sign(transport._signing_key(site), pack_header(header) + absmax_B.numpy().astype("<f4").tobytes())


def _reference_payload(transport, ctx, site, delta) -> bytes:
    attempt = transport._attempt
    x_N = _weighted(ctx, site, delta)
    q_N = quantize_with_scales(x_N, attempt.scales_B, transport.block)
    private = transport._ephemeral[(ctx.run_id, ctx.round_idx, ctx.site_ids, site)]
    mask_N = secagg.site_mask(site, private, attempt.public, ctx.run_id, ctx.round_idx, attempt.session, q_N.numel(),
                              transport.ring_bits)
    header = secure_header(ctx.run_id, ctx.round_idx, site, ctx.spec, transport.block, transport.ring_bits,
                           attempt.session, attempt.grid)
    body = secagg.mask_codes(q_N, mask_N, transport.ring_bits).tobytes()
    return sign(transport._signing_key(site), pack_header(header) + body)


def _round_against_reference(deltas, weights=None, ring_bits=16, outlier_factor=None):
    """Announce, agree and encode every site, asserting each message equals the reference's bytes."""
    spec = param_spec(deltas[SITES[0]])
    ctx = RoundContext("run-x", 2, SITES, spec, weights or {})
    transport = SecureInt8Transport(generate_site_keys(SITES), block=BLOCK, ring_bits=ring_bits,
                                    outlier_factor=outlier_factor)
    transport.begin_round(ctx)
    announcements = {}
    for site in SITES:
        announcements[site] = transport.announce(ctx, site, deltas[site])
        assert announcements[site] == _reference_announcement(transport, ctx, site, deltas[site])
    transport.agree(ctx, announcements)
    payloads = {}
    for site in SITES:
        payloads[site] = transport.encode(ctx, site, deltas[site])
        assert type(payloads[site]) is bytes  # what the residency guard lets out
        assert payloads[site] == _reference_payload(transport, ctx, site, deltas[site])
    transport.verify(ctx, payloads)  # the aggregator accepts the in-place signed buffers
    return transport, ctx, payloads


def _adversarial(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Heavy tails, .5 ties, ±0 blocks, a value at MAX_ABS, a transposed view, an fp64 and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    deltas = {}
    for i, site in enumerate(SITES):
        body = torch.randn(7 * BLOCK + 13, generator=g) ** 3
        body[:BLOCK] = torch.arange(BLOCK, dtype=torch.float32) - 31.5  # ties once the scale is 1 (absmax 127)
        body[0] = 127.0
        body[BLOCK : 2 * BLOCK] = -0.0
        body[2 * BLOCK : 2 * BLOCK + 5] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0])
        body[3 * BLOCK] = MAX_ABS if i == 0 else 1.0
        deltas[site] = {
            "a.body": body,
            "b.empty": torch.zeros(0, 3),
            "c.t": (torch.randn(5, 9, generator=g) * 10).t(),  # not contiguous
            "d.f64": torch.randn(3 * BLOCK + 1, generator=g, dtype=torch.float64) * 1e-3,
        }
    return deltas


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ring_bits", [16, 32])
def test_announce_and_encode_equal_the_reference_bytes(kernel_path, chunk, seed, ring_bits):
    # Unit weights keep the .5 ties exact after weighting; uneven weights exercise the fp32 multiply.
    _round_against_reference(_adversarial(seed), {"a": 1.0, "b": 1.0, "c": 1.0}, ring_bits)
    _round_against_reference(_adversarial(seed), {"a": 0.1, "b": 0.7, "c": 0.2}, ring_bits)


def test_capped_blocks_saturate_exactly_as_the_reference(kernel_path, chunk):
    deltas = {s: {"w": torch.randn(5 * BLOCK + 7, generator=torch.Generator().manual_seed(i))} for i, s in enumerate(SITES)}
    deltas["c"]["w"][BLOCK + 3] = 1e6  # an outlier far above f · (second-largest announcement)
    transport, ctx, _ = _round_against_reference(deltas, outlier_factor=4.0)
    assert transport.capped_blocks(ctx) == {"c": 1}


def test_the_codes_of_ties_round_half_to_even(kernel_path):
    x_N = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -126.5, 126.5, -0.0])
    streams: list = []
    body_N = np.empty(x_N.numel(), dtype=np.uint16)
    scales_B = torch.tensor([1.0])
    assert site_pass.quantize_mask_into([x_N], 1.0, scales_B, torch.tensor([127.0]), streams, 16, BLOCK, body_N)
    assert body_N.view(np.int16).tolist() == [127, 0, 2, 2, 0, -2, -126, 126, 0]


def test_an_empty_update_announces_and_encodes_nothing(kernel_path):
    _round_against_reference({s: {"w": torch.zeros(0)} for s in SITES})
    assert site_pass.weighted_absmax([torch.zeros(0)], 0.5, BLOCK).numel() == 0
    body_N = np.empty(0, dtype=np.uint16)
    assert site_pass.quantize_mask_into([], 0.5, torch.zeros(0), torch.zeros(0), [], 16, BLOCK, body_N)


@pytest.mark.parametrize("bad, error, message", [
    (float("nan"), IntegrityError, "'b'.*NaN or Inf"),
    (float("-inf"), IntegrityError, "'b'.*NaN or Inf"),
    (MAX_ABS * 2, IntegrityError, "'b' has values above"),
])
def test_bad_values_are_refused_at_announce_and_at_encode(kernel_path, chunk, bad, error, message):
    deltas = _adversarial(0)
    ctx = RoundContext("run-x", 2, SITES, param_spec(deltas["a"]), {"a": 1.0, "b": 1.0, "c": 1.0})
    transport = SecureInt8Transport(generate_site_keys(SITES), block=BLOCK)
    transport.begin_round(ctx)
    spoiled = {**deltas["b"], "d.f64": deltas["b"]["d.f64"].clone()}
    spoiled["d.f64"][-1] = bad
    with pytest.raises(error, match=message):
        transport.announce(ctx, "b", spoiled)
    transport.agree(ctx, {s: transport.announce(ctx, s, deltas[s]) for s in SITES})
    with pytest.raises(error, match=message):
        transport.encode(ctx, "b", spoiled)


def test_a_value_above_the_announcement_is_a_changed_update(kernel_path, chunk):
    deltas = _adversarial(1)
    ctx = RoundContext("run-x", 2, SITES, param_spec(deltas["a"]))
    transport = SecureInt8Transport(generate_site_keys(SITES), block=BLOCK)
    transport.begin_round(ctx)
    transport.agree(ctx, {s: transport.announce(ctx, s, deltas[s]) for s in SITES})
    grown = {**deltas["c"], "a.body": deltas["c"]["a.body"].clone()}
    grown["a.body"][-1] = grown["a.body"][-BLOCK:].abs().max() * 2  # last (partial) block, still in the domain
    with pytest.raises(ValueError, match="the update of 'c' changed between announce and encode"):
        transport.encode(ctx, "c", grown)
    assert transport.encode(ctx, "c", deltas["c"]) == _reference_payload(transport, ctx, "c", deltas["c"])


@pytest.mark.parametrize("piece", [1, 37, 4096])
def test_mask_streams_read_in_pieces_give_the_whole_mask(piece):
    keys = {s: secagg.X25519PrivateKey.generate() for s in SITES}
    public = {s: k.public_key().public_bytes_raw() for s, k in keys.items()}
    numel = 5000
    whole = secagg.site_mask("b", keys["b"], public, "r", 1, "sess", numel, 16)
    acc = np.zeros(numel, dtype=np.uint16)
    for stream in secagg.pair_streams("b", keys["b"], public, "r", 1, "sess"):
        part = np.empty(numel, dtype=np.uint16)
        for a in range(0, numel, piece):
            b = min(numel, a + piece)
            stream.read_into(bytes(2 * (b - a)), memoryview(part[a:b]).cast("B"))
        (np.add if stream.adds else np.subtract)(acc, part, out=acc)
    assert np.array_equal(acc, whole)


def test_a_payload_signed_from_its_digest_is_the_bytes_of_sign():
    key = generate_site_keys(["a"])["a"]
    message = bytes(range(256)) * 41
    payload, buffer_u8 = site_pass.new_payload(len(message) + 64)
    buffer_u8[: len(message)] = np.frombuffer(message, dtype=np.uint8)
    buffer_u8[len(message) :] = np.frombuffer(signature(key, hashlib.sha256(message).digest()), dtype=np.uint8)
    assert type(payload) is bytes and payload == sign(key, message) and hash(payload) == hash(sign(key, message))
