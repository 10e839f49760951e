"""INV-BOUNDED-INFLUENCE: one malicious enrolled site among C moves Δ̄ by at most the bound of
docs/THREAT_MODEL.md; a huge announcement cannot zero the honest codes; a corrupt sum aborts the
round with nothing applied; bad key shares are refused naming their sender.

The malicious site here holds its real keys (it is enrolled) and forges what it sends: announcements,
key shares and masked bodies built with the transport's own wire functions.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lensemble.errors import IntegrityError
from lensemble.federation import secagg
from lensemble.federation.outer import aggregate_and_step, state_hash
from lensemble.federation.quant import (
    QMAX, SLACK, block_absmax, dequantize_int8, quantize_with_scales, robust_absmax, scales_from_absmax,
)
from lensemble.federation.rounds import InlineSites, NesterovStep, SiteEndpoint, run_round
from lensemble.federation.secure_transport import (
    SecureInt8Transport, announce_header, key_message, secure_header,
)
from lensemble.federation.signing import SIGNATURE_BYTES, sign
from lensemble.federation.transport import AttemptAborted, RoundContext, flatten, pack_header, param_spec
from lensemble.federation.transports import aggregator_codec, site_codec

BLOCK = 64
FACTOR = 4.0
SPEC = (("enc.w", (9, 31)), ("pred.b", (7,)))  # 286 parameters: 5 blocks, the last one partial
N = 286
P = 2**255 - 19


def _deltas(sites, seed=0, scale=0.01):
    g = torch.Generator().manual_seed(seed)
    return {s: {"enc.w": scale * torch.randn(9, 31, generator=g), "pred.b": scale * torch.randn(7, generator=g)} for s in sites}


def _sites(num_sites: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every site, the honest ones); the malicious site is 'm'."""
    honest = tuple("abc"[: num_sites - 1])
    return (*honest, "m"), honest


def _weighted(ctx, site, delta) -> torch.Tensor:
    return flatten(SPEC, delta) * torch.tensor(ctx.weight(site), dtype=torch.float32)


def _forge_announcement(t: SecureInt8Transport, ctx, site, absmax_B: np.ndarray) -> bytes:
    header = announce_header(ctx.run_id, ctx.round_idx, site, ctx.spec, t._attempt.session)
    return sign(t._site_keys[site], pack_header(header) + absmax_B.astype("<f4").tobytes())


def _forge_update(t: SecureInt8Transport, ctx, site, codes_N: np.ndarray) -> bytes:
    """Arbitrary integer codes (any size: read mod 2^16) under the site's real mask and signature."""
    att = t._attempt
    private = t._ephemeral[(ctx.run_id, ctx.round_idx, ctx.site_ids, site)]
    mask_N = secagg.site_mask(site, private, att.public, ctx.run_id, ctx.round_idx, att.session, N, t.ring_bits)
    y_N = (np.mod(codes_N.astype(np.int64), 1 << 16).astype("<u2") + mask_N).astype("<u2")
    header = secure_header(ctx.run_id, ctx.round_idx, site, ctx.spec, t.block, t.ring_bits, att.session, att.grid)
    return sign(t._site_keys[site], pack_header(header) + y_N.tobytes())


def _malicious_round(num_sites: int, announce=None, factor=FACTOR):
    """A round up to the updates: honest sites follow the protocol, 'm' announces `announce` (default: honestly)."""
    sites, honest = _sites(num_sites)
    deltas = _deltas(sites)
    t = SecureInt8Transport(block=BLOCK, outlier_factor=factor)
    ctx = RoundContext("run", 2, sites, SPEC)
    t.begin_round(ctx)
    ann = {s: t.announce(ctx, s, deltas[s]) for s in honest}
    ann["m"] = t.announce(ctx, "m", deltas["m"]) if announce is None else _forge_announcement(t, ctx, "m", announce)
    t.agree(ctx, ann)
    payloads = {s: t.encode(ctx, s, deltas[s]) for s in honest}
    honest_codes = {s: quantize_with_scales(_weighted(ctx, s, deltas[s]), t._attempt.scales_B, BLOCK).to(torch.int64) for s in honest}
    honest_absmax = torch.stack([block_absmax(_weighted(ctx, s, deltas[s]), BLOCK) for s in honest]).amax(dim=0)
    return t, ctx, deltas, payloads, sum(honest_codes.values()), honest_absmax


def _dequant(codes_N: torch.Tensor, scales_B: torch.Tensor) -> torch.Tensor:
    return dequantize_int8(codes_N, scales_B, BLOCK, torch.float64).float()


def _documented_bound(num_sites: int, sum_honest_N: torch.Tensor, scales_B: torch.Tensor) -> torch.Tensor:
    """THREAT_MODEL.md: |Δ̄ - Δ̄_honest| <= (127 C + |Σ_h q_h|) s_b <= 127 (2C - 1) s_b, per element."""
    s_N = scales_B.double().repeat_interleave(BLOCK)[:N]
    tight = (QMAX * num_sites + sum_honest_N.abs().double()) * s_N
    assert bool((tight <= QMAX * (2 * num_sites - 1) * s_N).all())
    return tight


# --- robust grid agreement -------------------------------------------------------------------------------------


def test_announcements_within_the_factor_give_the_plain_max_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    a_CB = torch.rand(4, 50, generator=g) + 0.5  # every ratio < 3 < 4
    grid_B, capped_CB = robust_absmax(a_CB, FACTOR)
    assert torch.equal(grid_B.view(torch.int32), a_CB.amax(dim=0).view(torch.int32)) and not capped_CB.any()


def test_one_outlier_is_capped_at_the_factor_times_the_second_largest():
    a_CB = torch.tensor([[1.0, 2.0, 3.0], [0.5, 1e30, 3.0], [0.25, 1.0, 0.1]])
    grid_B, capped_CB = robust_absmax(a_CB, FACTOR)
    assert grid_B.tolist() == [1.0, 8.0, 3.0]  # block 1: 4 x 2.0; block 2: a tie is no outlier
    assert capped_CB.tolist() == [[False, False, False], [False, True, False], [False, False, False]]
    third = robust_absmax(a_CB, 3.3)[0]  # a factor that is not a power of two: rounded once to fp32
    assert third[1] == torch.tensor(2.0 * 3.3, dtype=torch.float64).float()


def test_a_block_one_honest_site_moves_alone_is_not_flushed():
    """Proprioception columns that only one embodiment has: the other sites announce 0 there. The cap's
    floor (f times the median block's second-largest announcement) keeps such a block."""
    a_CB = torch.tensor([[1.0, 2.0, 3.0, 0.5], [2.0, 1.0, 2.5, 0.0], [1.5, 1.5, 1.0, 0.0]])
    grid_B, capped_CB = robust_absmax(a_CB, FACTOR)
    assert torch.equal(grid_B, a_CB.amax(dim=0)) and not capped_CB.any()
    a_CB[0, 3] = 1e30  # the same block, announced huge: capped at f x the median block (1.5)
    assert robust_absmax(a_CB, FACTOR)[0][3] == FACTOR * 1.5


def test_one_site_or_no_factor_is_not_capped():
    a_CB = torch.tensor([[1e20, 1.0]])
    assert torch.equal(robust_absmax(a_CB, FACTOR)[0], a_CB[0])
    two = torch.tensor([[1e20, 1.0], [1.0, 1.0]])
    assert torch.equal(robust_absmax(two, None)[0], two.amax(dim=0))


@pytest.mark.parametrize("num_sites", [3, 4])
def test_a_huge_announcement_does_not_zero_the_honest_codes(num_sites):
    sites, honest = _sites(num_sites)
    t, ctx, deltas, payloads, sum_h, honest_absmax = _malicious_round(num_sites, announce=np.full(5, 2.0**99, dtype=np.float32))
    scales = t._attempt.scales_B
    bound_B = torch.maximum(honest_absmax, honest_absmax.median())  # the cap's floor: the median block
    assert bool((scales <= FACTOR * bound_B / QMAX * (1 + 2**-23)).all())  # at most f times coarser
    assert t.capped_blocks(ctx) == {"m": 5}
    assert bool((sum_h != 0).float().mean() > 0.5)  # the honest codes survive
    payloads["m"] = _forge_update(t, ctx, "m", np.zeros(N, dtype=np.int64))
    mean = flatten(SPEC, t.aggregate(ctx, payloads)).double()
    exact = sum(_weighted(ctx, s, deltas[s]).double() for s in honest)
    bound = (num_sites - 1) * scales.double().repeat_interleave(BLOCK)[:N] * (0.5 + SLACK) + 2**-23 * exact.abs()
    assert bool(((mean - exact).abs() <= bound).all())  # the honest quantization bound, on a grid at most f x coarser
    # the same attack against the uncapped grid of before: every honest code is 0
    t0, _, _, _, sum_h0, _ = _malicious_round(num_sites, announce=np.full(5, 2.0**99, dtype=np.float32), factor=None)
    assert not sum_h0.any()


def test_an_honest_outlier_saturates_its_own_codes_and_is_recorded(caplog):
    sites = ("a", "b", "c")
    deltas = _deltas(sites)
    deltas["c"] = {k: 40 * v for k, v in deltas["c"].items()}  # 40 x the others: above the cap of 4
    t = SecureInt8Transport(block=BLOCK, outlier_factor=FACTOR)
    ctx = RoundContext("run", 0, sites, SPEC)
    t.begin_round(ctx)
    t.agree(ctx, {s: t.announce(ctx, s, deltas[s]) for s in sites})
    assert t.capped_blocks(ctx) == {"c": 5} and "c announced an absmax above 4" in caplog.text
    payloads = {s: t.encode(ctx, s, deltas[s]) for s in sites}  # encoding a capped block does not fail
    codes = sum(quantize_with_scales(_weighted(ctx, s, deltas[s]), t._attempt.scales_B, BLOCK).to(torch.int64) for s in sites)
    q_c = quantize_with_scales(_weighted(ctx, "c", deltas["c"]), t._attempt.scales_B, BLOCK)
    assert int(q_c.abs().max()) == QMAX and float((q_c.abs() == QMAX).float().mean()) > 0.5  # saturated
    assert torch.equal(flatten(SPEC, t.aggregate(ctx, payloads)), _dequant(codes, t._attempt.scales_B))


def test_honest_sites_within_the_factor_get_the_grid_and_mean_of_before_bit_for_bit():
    sites = ("a", "b", "c", "d")
    deltas = _deltas(sites, seed=5)
    ctx = RoundContext("run", 1, sites, SPEC, {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4})
    out = {}
    for factor in (FACTOR, None):
        t = SecureInt8Transport(block=BLOCK, outlier_factor=factor)
        t.begin_round(ctx)
        t.agree(ctx, {s: t.announce(ctx, s, deltas[s]) for s in sites})
        assert t.capped_blocks(ctx) == {}
        out[factor] = (t._attempt.scales_B.clone(), state_hash(t.aggregate(ctx, {s: t.encode(ctx, s, deltas[s]) for s in sites})))
    assert torch.equal(out[FACTOR][0], out[None][0]) and out[FACTOR][1] == out[None][1]


# --- what a malicious site's codes can do --------------------------------------------------------------------------


@pytest.mark.parametrize("num_sites", [3, 4])
@pytest.mark.parametrize("sign_", [1, -1])
def test_the_worst_int8_codes_move_the_mean_by_127_steps_at_most(num_sites, sign_):
    t, ctx, _, payloads, sum_h, _ = _malicious_round(num_sites)
    payloads["m"] = _forge_update(t, ctx, "m", np.full(N, sign_ * QMAX, dtype=np.int64))
    mean = flatten(SPEC, t.aggregate(ctx, payloads))
    scales = t._attempt.scales_B
    assert torch.equal(mean, _dequant(sum_h + sign_ * QMAX, scales))  # closed form
    shift = (mean.double() - _dequant(sum_h, scales).double()).abs()
    s_N = scales.double().repeat_interleave(BLOCK)[:N]
    assert bool((shift <= QMAX * s_N * (1 + 2**-22)).all())  # an honest site's share: 127 s_b
    assert bool((shift <= _documented_bound(num_sites, sum_h, scales) * (1 + 2**-22)).all())


@pytest.mark.parametrize("num_sites", [3, 4])
def test_codes_that_hold_the_sum_at_the_range_limit_meet_the_documented_bound(num_sites):
    huge = np.full(5, 2.0**99, dtype=np.float32)  # and the coarsest grid it can get
    t, ctx, _, payloads, sum_h, honest_absmax = _malicious_round(num_sites, announce=huge)
    limit = QMAX * num_sites
    payloads["m"] = _forge_update(t, ctx, "m", (limit - sum_h).numpy())  # |q_m| up to 127 (2C - 1): beyond int8
    mean = flatten(SPEC, t.aggregate(ctx, payloads))  # passes the range check: every sum is exactly +127 C
    scales = t._attempt.scales_B
    assert torch.equal(mean, _dequant(torch.full((N,), limit, dtype=torch.int64), scales))
    shift = (mean.double() - _dequant(sum_h, scales).double()).abs()
    bound = _documented_bound(num_sites, sum_h, scales)
    assert bool((shift <= bound * (1 + 2**-22)).all()) and bool((shift >= 0.5 * bound).any())  # tight, not vacuous
    # in terms of the honest announcements: <= (2C - 1) f A_b, A_b the largest honest absmax of the block
    a_N = honest_absmax.double().repeat_interleave(BLOCK)[:N]
    assert bool((shift <= (2 * num_sites - 1) * FACTOR * a_N * (1 + 2**-20)).all())


@pytest.mark.parametrize("num_sites", [3, 4])
def test_one_code_past_the_range_limit_aborts_and_applies_nothing(num_sites):
    t, ctx, _, payloads, sum_h, _ = _malicious_round(num_sites)
    codes = (-sum_h).numpy()
    codes[17] = QMAX * num_sites + 1 - int(sum_h[17])
    payloads["m"] = _forge_update(t, ctx, "m", codes)
    params = {name: torch.randn(shape) for name, shape in SPEC}
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(AttemptAborted, match=f"outside ±127·{num_sites} at 1 of {N} parameters") as err:
        aggregate_and_step(ctx, t, payloads, params, None, 0.7, 0.9)
    assert err.value.site is None and err.value.suspects == ctx.site_ids
    assert state_hash(params) == state_hash(before)


def test_a_validly_signed_random_body_aborts_and_applies_nothing():
    t, ctx, _, payloads, _, _ = _malicious_round(3)
    rng = np.random.default_rng(0)
    payloads["m"] = _forge_update(t, ctx, "m", rng.integers(0, 1 << 16, N))
    params = {name: torch.randn(shape) for name, shape in SPEC}
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(AttemptAborted, match="a contribution is corrupt"):
        aggregate_and_step(ctx, t, payloads, params, None, 0.7, 0.9)
    assert state_hash(params) == state_hash(before)


@pytest.mark.parametrize("ring_bits", [16, 32])
def test_the_range_check_reads_the_signed_ring_sum(ring_bits):
    dtype = secagg.ring_dtype(ring_bits)
    ok = np.array([0, 381, -381, 5], dtype=np.int64)  # C = 3: ±381 is the limit
    assert secagg.out_of_range(np.mod(ok, 1 << ring_bits).astype(dtype), 3, ring_bits) == 0
    bad = np.array([382, -382, 1 << (ring_bits - 2), 0], dtype=np.int64)
    assert secagg.out_of_range(np.mod(bad, 1 << ring_bits).astype(dtype), 3, ring_bits) == 3


# --- the round driver: record, retry once, then stop ----------------------------------------------------------------


class Corrupt(SiteEndpoint):
    """A site that signs a random body for its first `times` attempts."""

    def __init__(self, *args, times: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.times = times

    def encode(self, ctx, grid):
        payload, seconds = super().encode(ctx, grid)
        if self.times <= 0:
            return payload, seconds
        self.times -= 1
        codec, rng = self.codec, np.random.default_rng(self.times)
        header = secure_header(ctx.run_id, ctx.round_idx, self.site, ctx.spec, codec.block, codec.ring_bits,
                               codec._attempt.session, codec._attempt.grid)
        return sign(codec._site_keys[self.site], pack_header(header) + rng.integers(0, 1 << 16, N).astype("<u2").tobytes()), seconds


def _pool(corrupt_times: int = 0, copier: bool = False):
    sites = ("a", "b", "c")
    keys = {s: Ed25519PrivateKey.generate() for s in sites}
    public = {s: k.public_key() for s, k in keys.items()}
    deltas = _deltas(sites)
    endpoints = {s: SiteEndpoint(s, site_codec("secure_int8", BLOCK, s, keys[s], public), lambda s=s: deltas[s], public_key=public[s])
                 for s in sites}
    if corrupt_times:
        endpoints["c"] = Corrupt("c", site_codec("secure_int8", BLOCK, "c", keys["c"], public), lambda: deltas["c"],
                                 public_key=public["c"], times=corrupt_times)
    if copier:
        endpoints["c"] = Copier("c", site_codec("secure_int8", BLOCK, "c", keys["c"], public), lambda: deltas["c"],
                                public_key=public["c"], victim=endpoints["a"])
    return InlineSites(endpoints), {s: k.public_key() for s, k in keys.items()}


def _run(pool, policy="continue"):
    params = {name: torch.zeros(shape) for name, shape in SPEC}
    return run_round("run", 0, ("a", "b", "c"), SPEC, pool, aggregator_codec("secure_int8", BLOCK, None, FACTOR), params, None,
                     NesterovStep(0.7, 0.9), policy), params


def test_a_corrupt_attempt_is_recorded_and_redone_with_fresh_keys_to_the_clean_result(caplog):
    clean, _ = _run(_pool()[0])
    res, params = _run(_pool(corrupt_times=1)[0])
    assert len(res.aborts) == 1 and "outside ±127·3" in res.aborts[0] and res.dropped == {} and res.members == ("a", "b", "c")
    assert "attempt aborted, nothing applied" in caplog.text
    assert state_hash(res.params) == state_hash(clean.params)
    assert not any(v.any() for v in params.values())  # the inputs were never touched


@pytest.mark.parametrize("policy, attempts", [("continue", 2), ("abort", 1)])
def test_a_persistent_corruption_stops_the_federation(policy, attempts):
    pool, _ = _pool(corrupt_times=5)
    with pytest.raises(IntegrityError, match=f"round 0: {attempts} attempt\\(s\\) aborted by a check that names no site") as err:
        _run(pool, policy)
    assert err.value.site is None and pool.endpoints["c"].times == 5 - attempts


# --- key shares ------------------------------------------------------------------------------------------------------


class Copier(SiteEndpoint):
    """A site whose key share carries the victim's X25519 key under its own valid signature."""

    def __init__(self, *args, victim: SiteEndpoint, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim = victim

    def key_share(self, ctx):
        super().key_share(ctx)
        stolen = self.victim.codec._ephemeral[(ctx.run_id, ctx.round_idx, ctx.site_ids, self.victim.site)].public_key().public_bytes_raw()
        return stolen + sign(self.codec._site_keys[self.site], key_message(ctx.run_id, ctx.round_idx, self.site, stolen))[-SIGNATURE_BYTES:]


def _distributed(sites=("a", "b", "m")):
    keys = {s: Ed25519PrivateKey.generate() for s in sites}
    parties = {s: SecureInt8Transport({s: keys[s]}, block=BLOCK) for s in sites}
    aggregator = SecureInt8Transport({}, block=BLOCK)
    for s in sites:
        aggregator.register(s, keys[s].public_key())
        for other in sites:
            if other != s:
                parties[other].register(s, keys[s].public_key())
    ctx = RoundContext("run", 1, sites, SPEC)
    shares = {s: parties[s].key_share(ctx, s) for s in sites}
    return keys, parties, aggregator, ctx, shares


def _share(keys, ctx, site, x25519: bytes) -> bytes:
    return x25519 + sign(keys[site], key_message(ctx.run_id, ctx.round_idx, site, x25519))[-SIGNATURE_BYTES:]


def test_a_copied_key_share_aborts_at_the_aggregator_and_is_named_by_its_owner():
    keys, parties, aggregator, ctx, shares = _distributed()
    shares["m"] = _share(keys, ctx, "m", shares["a"][:32])
    with pytest.raises(AttemptAborted, match=r"sites \['a', 'm'\] present the same X25519 key") as err:
        aggregator.accept_shares(ctx, shares)
    assert err.value.suspects == ("a", "m")
    with pytest.raises(IntegrityError, match="key share from 'm' copies the X25519 key of 'a'") as err:
        parties["a"].accept_shares(ctx, shares)
    assert err.value.site == "m"


def test_a_copied_key_share_in_every_attempt_stops_the_round():
    pool, _ = _pool(copier=True)
    with pytest.raises(IntegrityError, match="2 attempt\\(s\\) aborted .* present the same X25519 key"):
        _run(pool)


@pytest.mark.parametrize("u", [0, 1, P - 1, P, P + 1])
def test_a_small_order_x25519_key_is_refused_naming_its_sender(u):
    keys, parties, aggregator, ctx, shares = _distributed()
    shares["m"] = _share(keys, ctx, "m", u.to_bytes(32, "little"))
    for party in (aggregator, parties["a"], parties["b"]):  # before any honest site draws a mask
        with pytest.raises(IntegrityError, match="key share from 'm' has a small-order X25519 public key") as err:
            party.accept_shares(ctx, shares)
        assert err.value.site == "m"


def test_a_zero_key_that_reaches_the_mask_is_an_integrity_error_not_a_value_error():
    private = secagg.X25519PrivateKey.generate()
    public = {"a": private.public_key().public_bytes_raw(), "m": bytes(32)}
    with pytest.raises(IntegrityError, match="key share from 'm' has a small-order") as err:
        secagg.site_mask("a", private, public, "run", 0, "0" * 32, 8, 16)
    assert err.value.site == "m"


def test_malformed_key_shares_are_refused_naming_their_sender():
    keys, parties, aggregator, ctx, shares = _distributed()
    for bad, reason in [(shares["m"][:-1], "has 95 bytes"), (shares["m"] + b"\0", "has 97 bytes"),
                        (shares["m"][:40] + bytes([shares["m"][40] ^ 1]) + shares["m"][41:], "bad Ed25519 signature"),
                        (_share({"m": Ed25519PrivateKey.generate()}, ctx, "m", shares["m"][:32]), "bad Ed25519 signature"),
                        (_share(keys, ctx, "a", shares["m"][:32]), "bad Ed25519 signature")]:  # a's signature for m's key
        for party in (aggregator, parties["a"]):
            with pytest.raises(IntegrityError, match=f"'m'.*{reason}") as err:
                party.accept_shares(ctx, {**shares, "m": bad})
            assert err.value.site == "m"
    aggregator.accept_shares(ctx, shares)  # the honest shares still go through
