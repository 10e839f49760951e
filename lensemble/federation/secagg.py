"""Pairwise additive masking for secure aggregation (Bonawitz et al. 2017, without the recovery round).

Every pair of sites (a, b), a < b in sorted order, agrees on a secret per round with X25519 (fresh
ephemeral keys each round attempt), expands it with HKDF-SHA256 into a ChaCha20 key, and expands
that into a mask m_ab ∈ Z_{2^k}^N. Site a adds m_ab, site b subtracts it; so in the sum over all
sites every mask cancels exactly and the aggregator learns only Σ_c y_c. A single masked vector
is uniform on Z_{2^k}^N to anyone without the pair secrets.

Ring. Codes are int8 in [-127, 127], embedded in Z_{2^k} in two's complement. The sum of C codes
lies in [-127 C, 127 C], which is recovered exactly from its residue mod 2^k iff
127 C <= 2^(k-1) - 1, i.e. C <= `max_sites(k)`: 258 sites for k = 16 (2 bytes per parameter on
the wire), 16 909 320 for k = 32. `check_ring_capacity` raises ConfigError beyond that. Sites
weight their update *before* quantizing (see `secure_transport`), so no integer weights enlarge the
range.

Range check. Honest codes keep the signed sum in [-127 C, 127 C], so a sum outside it can only come
from a corrupted contribution (a validly signed random body, a mask computed from keys the site does
not hold, codes beyond ±127). `out_of_range` counts such elements; the aggregator aborts the round on
any (fail closed). Under masking the culprit is not identifiable: every body looks uniform.

Key validation. An ephemeral X25519 public key of small order (the all-zero key and the other
points of order dividing 8, in any encoding) makes every pair secret with it all-zero, so its
"mask" would be known to everyone and the key agreement fails; `check_public_key` refuses such
keys, and the wrong length, with an IntegrityError naming the sender, before any mask is drawn.

Dropout is handled by re-keying, not by Shamir recovery: if a site is missing, the aggregator
applies nothing and raises ParticipantDropped; the round is rerun with the survivors, which draw
fresh keys, so no mask of the dropped site is ever needed or half-applied.

Only `cryptography` primitives are used (X25519, HKDF, ChaCha20); NumPy does the ring arithmetic
(unsigned integer addition wraps mod 2^k).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lensemble.errors import ConfigError, IntegrityError
from lensemble.federation.quant import QMAX

RING_BITS = (16, 32)
"""Supported ring sizes k; 16 is the default (2 bytes per parameter)."""
_RING_DTYPE = {16: np.dtype("<u2"), 32: np.dtype("<u4")}
_SIGNED_DTYPE = {16: np.dtype("<i2"), 32: np.dtype("<i4")}
_KDF_LABEL = b"lensemble/secagg/v1"
# ChaCha20 keys are single-use (one per pair per round attempt), so a fixed nonce is safe.
_NONCE = bytes(16)


def ring_dtype(ring_bits: int) -> np.dtype:
    """The unsigned little-endian NumPy dtype of Z_{2^k}; ConfigError for an unsupported k."""
    if ring_bits not in _RING_DTYPE:
        raise ConfigError(f"secure aggregation ring_bits must be one of {RING_BITS}, got {ring_bits}")
    return _RING_DTYPE[ring_bits]


def max_sites(ring_bits: int) -> int:
    """Largest C whose sum of int8 codes cannot wrap in Z_{2^k}: floor((2^(k-1) - 1) / 127)."""
    ring_dtype(ring_bits)
    return (2 ** (ring_bits - 1) - 1) // QMAX


def check_ring_capacity(num_sites: int, ring_bits: int) -> None:
    """ConfigError when C sites could overflow the ring (see the module docstring)."""
    if num_sites > max_sites(ring_bits):
        raise ConfigError(
            f"{num_sites} sites exceed the {ring_bits}-bit secure-aggregation ring, which holds the sum of at"
            f" most {max_sites(ring_bits)} int8 updates; set ring_bits=32 or federate fewer sites per round"
        )


def session_id(run_id: str, round_idx: int, public_keys: Mapping[str, bytes]) -> str:
    """A 32-hex-digit id of one round attempt: run, round and every site's ephemeral public key."""
    roster = [[site, public_keys[site].hex()] for site in sorted(public_keys)]
    raw = json.dumps([run_id, round_idx, roster], separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def check_public_key(site: str, public: bytes) -> None:
    """IntegrityError naming `site` unless `public` is a 32-byte X25519 key of large order.

    X25519 clamps every private scalar to a multiple of 8, so the shared secret with a small-order
    point is the all-zero string, which `cryptography` refuses (ValueError). One exchange with a
    throwaway key therefore tests membership in the small-order set, non-canonical encodings included.
    """
    if len(public) != 32:
        raise IntegrityError(f"key share from {site!r} has a {len(public)}-byte X25519 key, expected 32", site=site)
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(bytes(public)))
    except ValueError:
        raise IntegrityError(f"key share from {site!r} has a small-order X25519 public key (all-zero shared secret)",
                             site=site) from None


def pair_info(run_id: str, round_idx: int, site_a: str, site_b: str, session: str) -> bytes:
    """HKDF info binding a pair's mask to (run, round, sorted pair, session)."""
    lo, hi = sorted((site_a, site_b))
    return _KDF_LABEL + json.dumps([run_id, round_idx, lo, hi, session], separators=(",", ":")).encode()


def pair_key(private_key: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """32-byte ChaCha20 key of a pair: HKDF-SHA256(X25519(sk, pk_peer), info). Symmetric in the pair."""
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def keystream_into(key: bytes, zeros: bytes, out: memoryview) -> None:
    """Fill the writable buffer `out` with the ChaCha20 keystream of `key` (by encrypting `zeros`).

    Writing into a preallocated buffer instead of returning new bytes doubles the throughput.
    """
    encryptor = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor()
    encryptor.update_into(zeros, out)
    encryptor.finalize()


def keystream(key: bytes, num_bytes: int) -> bytes:
    """The first `num_bytes` bytes of the ChaCha20 keystream of `key`."""
    out = bytearray(num_bytes)
    keystream_into(key, bytes(num_bytes), memoryview(out))
    return bytes(out)


@dataclass(frozen=True)
class PairStream:
    """One pair's mask m_(site,peer) as a ChaCha20 keystream, read chunk by chunk in order with `read_into`."""

    peer: str
    adds: bool  # site < peer: this site adds the mask; otherwise it subtracts it
    encryptor: CipherContext

    def read_into(self, zeros: bytes, out: memoryview) -> None:
        """The next len(out) bytes of the pair's mask into `out` (`zeros` is as long as `out`)."""
        self.encryptor.update_into(zeros, out)


def pair_streams(
    site: str, private_key: X25519PrivateKey, public_keys: Mapping[str, bytes], run_id: str, round_idx: int, session: str
) -> list[PairStream]:
    """The mask stream of every pair `site` is in, peers in sorted order (`site_mask` adds them up)."""
    streams = []
    for peer in sorted(public_keys):
        if peer == site:
            continue
        try:
            key = pair_key(private_key, public_keys[peer], pair_info(run_id, round_idx, site, peer, session))
        except ValueError:  # a small-order key that reached a site unchecked: name its sender, not a bare ValueError
            raise IntegrityError(f"key share from {peer!r} has a small-order X25519 public key", site=peer) from None
        streams.append(PairStream(peer, site < peer, Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor()))
    return streams


def site_mask(
    site: str,
    private_key: X25519PrivateKey,
    public_keys: Mapping[str, bytes],
    run_id: str,
    round_idx: int,
    session: str,
    numel: int,
    ring_bits: int,
) -> np.ndarray:
    """M_site = Σ_{peer > site} m_(site,peer) - Σ_{peer < site} m_(peer,site) in Z_{2^k}: -> [N] uint.

    `public_keys` holds every participating site's ephemeral X25519 public key (including `site`'s
    own, which is skipped). Peers are visited in sorted order; the result does not depend on it.
    The whole-vector reference; a site's encoder reads the same streams chunk by chunk
    (`secure_transport`, `pair_streams`).
    """
    dtype = ring_dtype(ring_bits)
    mask_N = np.zeros(numel, dtype=dtype)
    m_N = np.empty(numel, dtype=dtype)  # scratch for one pair's mask, reused
    zeros = bytes(m_N.nbytes)  # calloc'd: reading it touches no memory
    for stream in pair_streams(site, private_key, public_keys, run_id, round_idx, session):
        stream.read_into(zeros, memoryview(m_N).cast("B"))
        if stream.adds:
            np.add(mask_N, m_N, out=mask_N)
        else:
            np.subtract(mask_N, m_N, out=mask_N)
    return mask_N


def to_ring(q_N: torch.Tensor, ring_bits: int) -> np.ndarray:
    """Embed int8 codes in Z_{2^k} (two's complement): [N] int8 -> [N] uint."""
    signed = q_N.numpy().astype(_SIGNED_DTYPE[ring_bits])
    return signed.view(ring_dtype(ring_bits))


def mask_codes(q_N: torch.Tensor, mask_N: np.ndarray, ring_bits: int) -> np.ndarray:
    """y = q + M mod 2^k: [N] int8, [N] uint -> [N] uint."""
    y_N = to_ring(q_N, ring_bits)
    np.add(y_N, mask_N, out=y_N)
    return y_N


def ring_sum(vectors: list[np.ndarray], ring_bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """Σ_c y_c mod 2^k, exact and order independent: C x [N] uint -> [N] uint (`out`, or a new array)."""
    dtype = ring_dtype(ring_bits)
    n = vectors[0].shape[0] if vectors else 0
    total_N = np.empty(n, dtype=dtype) if out is None else out
    if len(vectors) < 2:
        total_N[...] = vectors[0] if vectors else 0
        return total_N
    np.add(vectors[0], vectors[1], out=total_N)
    for y_N in vectors[2:]:
        np.add(total_N, y_N, out=total_N)
    return total_N


def from_ring(total_N: np.ndarray, ring_bits: int) -> np.ndarray:
    """Read a ring element back as a signed integer sum, in place: [N] uint -> [N] int (a view).

    Exact when the true sum lies in [-(2^(k-1) - 1), 2^(k-1) - 1], which `check_ring_capacity` ensures.
    """
    return total_N.view(_SIGNED_DTYPE[ring_bits])


def sum_bound(num_sites: int) -> int:
    """The largest |Σ_c q_c| honest int8 codes of `num_sites` sites can give: 127 C."""
    return QMAX * num_sites


def out_of_range(total_n: np.ndarray, num_sites: int, ring_bits: int) -> int:
    """How many ring sums, read as signed integers, lie outside [-127 C, 127 C]: [n] uint -> count.

    Two reductions over the slice (min, max); the count is only taken when one of them is out.
    """
    signed_n = from_ring(total_n, ring_bits)
    if not signed_n.size:
        return 0
    bound = sum_bound(num_sites)
    if -bound <= int(signed_n.min()) and int(signed_n.max()) <= bound:
        return 0
    return int(np.count_nonzero((signed_n < -bound) | (signed_n > bound)))
