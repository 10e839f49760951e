"""Pairwise masks: exact cancellation, uniformity of a masked vector, ring capacity, key binding."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from lensemble.errors import ConfigError
from lensemble.federation import secagg


def _keys(sites: list[str], seed: int = 0) -> tuple[dict[str, X25519PrivateKey], dict[str, bytes]]:
    """Deterministic X25519 keys (tests only; the transport draws them from the OS)."""
    private = {s: X25519PrivateKey.from_private_bytes(hashlib.sha256(f"{seed}/{s}".encode()).digest()) for s in sites}
    return private, {s: k.public_key().public_bytes_raw() for s, k in private.items()}


def _masks(sites: list[str], numel: int, ring_bits: int) -> dict[str, np.ndarray]:
    private, public = _keys(sites)
    return {s: secagg.site_mask(s, private[s], public, "run", 0, "session", numel, ring_bits) for s in sites}


def test_chacha20_keystream_matches_the_rfc_8439_zero_key_vector():
    # RFC 8439 A.1 test vector #1: all-zero key, nonce and counter.
    expected = "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    assert secagg.keystream(bytes(32), 32).hex() == expected


@settings(max_examples=25, deadline=None)
@given(num_sites=st.integers(2, 9), numel=st.integers(1, 3000), ring_bits=st.sampled_from(secagg.RING_BITS))
def test_masks_cancel_exactly(num_sites, numel, ring_bits):
    masks = _masks([f"site{i:02d}" for i in range(num_sites)], numel, ring_bits)
    total = secagg.ring_sum([masks[s] for s in sorted(masks)], ring_bits)
    assert not total.any()
    assert all(m.any() for m in masks.values())


@settings(max_examples=15, deadline=None)
@given(num_sites=st.integers(2, 6), numel=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_masked_sum_equals_plain_sum_bit_for_bit(num_sites, numel, seed):
    g = torch.Generator().manual_seed(seed)
    sites = [f"s{i}" for i in range(num_sites)]
    codes = {s: torch.randint(-127, 128, (numel,), generator=g, dtype=torch.int8) for s in sites}
    masks = _masks(sites, numel, 16)
    masked = [secagg.mask_codes(codes[s], masks[s], 16) for s in sites]
    plain = sum(codes[s].to(torch.int32) for s in sites)
    assert torch.equal(torch.from_numpy(secagg.from_ring(secagg.ring_sum(masked, 16), 16).astype(np.int32)), plain)


def test_a_masked_vector_alone_is_uniform_on_the_ring():
    # Worst case for leakage: a constant vector (all codes 127). 2^21 values in 2^16 bins, 32 per bin.
    numel = 2**21
    mask = _masks(["a", "b", "c"], numel, 16)["b"]
    masked = secagg.mask_codes(torch.full((numel,), 127, dtype=torch.int8), mask, 16)
    counts = np.bincount(masked, minlength=2**16)
    assert stats.chisquare(counts).pvalue > 1e-3
    # The 32-bit ring: the top 16 bits of each element are uniform too.
    mask32 = _masks(["a", "b"], numel // 2, 32)["a"]
    high = secagg.mask_codes(torch.full((numel // 2,), -127, dtype=torch.int8), mask32, 32) >> 16
    assert stats.chisquare(np.bincount(high, minlength=2**16)).pvalue > 1e-3


def test_pair_key_is_symmetric_and_bound_to_round_and_session():
    private, public = _keys(["a", "b"])
    info = secagg.pair_info("run", 3, "a", "b", "s")
    assert info == secagg.pair_info("run", 3, "b", "a", "s")
    assert secagg.pair_key(private["a"], public["b"], info) == secagg.pair_key(private["b"], public["a"], info)
    others = [secagg.pair_info("run", 4, "a", "b", "s"), secagg.pair_info("run2", 3, "a", "b", "s"),
              secagg.pair_info("run", 3, "a", "b", "t")]
    keys = {secagg.pair_key(private["a"], public["b"], i) for i in [info, *others]}
    assert len(keys) == 4


def test_ring_capacity_is_exact_at_the_boundary():
    assert secagg.max_sites(16) == 258
    for value in (127, -127):
        codes = [torch.full((4,), value, dtype=torch.int8)] * 258
        total = secagg.ring_sum([secagg.to_ring(c, 16) for c in codes], 16)
        assert secagg.from_ring(total, 16).tolist() == [258 * value] * 4
    secagg.check_ring_capacity(258, 16)
    with pytest.raises(ConfigError, match="ring_bits=32"):
        secagg.check_ring_capacity(259, 16)
    with pytest.raises(ConfigError, match="ring_bits must be one of"):
        secagg.ring_dtype(8)


def test_session_id_depends_on_every_public_key():
    _, public = _keys(["a", "b", "c"])
    _, fresh = _keys(["a", "b", "c"], seed=1)
    base = secagg.session_id("run", 0, public)
    assert base != secagg.session_id("run", 0, {**public, "c": fresh["c"]})
    assert base != secagg.session_id("run", 1, public)
    assert base == secagg.session_id("run", 0, dict(reversed(list(public.items()))))
