"""Signed int8 transports: "int8" (quantize + sign) and "secure_int8" (+ pairwise masking).

Wire formats, per site per round (N federated parameters on the wire: all of them, less the whole blocks
of a round's frozen prefix, `Transport.wire_start`; nb = ceil(N / block) blocks,
H(...) = len(pack_header(...)), the canonical-JSON header with its u32 length prefix):

    int8         payload      H(run, round, site, spec, transport, block, nonce)
                              + 4 nb (fp32 scales) + N (int8 codes) + 64 (Ed25519)
    secure_int8  setup        32 (X25519 public key) + 64 (Ed25519 over run, round, site, key)
                 announcement H(run, round, site, spec, kind, session)
                              + 4 nb (fp32 block absmax of w_c Δ_c) + 64
                 payload      H(run, round, site, spec, transport, block, ring_bits, session, grid)
                              + (k / 8) N (masked codes in Z_{2^k}) + 64

`expected_comm_bytes` evaluates these formulas; every hex field in a header has a fixed length.
Only what a site sends is counted (the aggregator's broadcast of the key roster and of the agreed
scales goes the other way). For k = 16 and large N this is 2 + 4/block bytes per parameter
(2.001 at block 4096), against 4 for fp32 and 1 + 4/block for int8.

secure_int8 protocol. `begin_round` draws fresh X25519 keys per site, signed with the site's
Ed25519 key; `accept_shares` refuses a small-order key (IntegrityError naming the sender) and aborts
the attempt when two sites present the same key (`AttemptAborted`; a site that finds its own key
under another name names that site). Each site announces the per-block absmax a_{c,b} of its
*weighted* update w_c Δ_c; `agree` fixes the shared grid robustly to one outlier:

    s_b = max_c min(a_{c,b}, f · max(a_(2),b, m)) / 127    (C >= 2; a_(2),b the second-largest announcement,
                                                           m the median over blocks of a_(2),b)

with f = `outlier_factor` (params `federate.announce_outlier_factor`, default 4, which every
federation passes; f · a_(2) is rounded once to fp32; None, the class default for in-process
simulations, is the uncapped grid max_c a_{c,b} / 127). When every announcement is within f of
its cap this is max_c a_{c,b}, the plain grid, bit for bit. A site whose absmax exceeds the cap has its values saturated at ±127 codes
(its own loss; `capped_blocks` records it). With C = 1 there is nothing to compare and the grid is
the site's own. Each site quantizes w_c Δ_c on the grid, adds its pairwise mask in Z_{2^k} and signs
(announce and encode each read Δ_c once and write straight into the message: `site_pass`).
The aggregator verifies every signature, sums the masked vectors exactly in the ring (the masks
cancel), checks that every signed sum Σ_c q_c lies in [-127 C, 127 C] (else `AttemptAborted`: nothing
applied) and returns Δ̄ = (Σ_c q_c) · s_b. Pre-weighting means no integer weights widen the ring;
the error of Δ̄ against Σ_c w_c Δ_c is at most C · s_b · (1/2 + 2^-15) per element (the bound of
`quant`, once per site; no site saturated), plus the fp32 roundings of w_c Δ_c and of Δ̄ (2^-24
relative each). For "int8" it is Σ_c w_c · s_{c,b} · (1/2 + 2^-15), with each site's own scales.
What one malicious site can do to Δ̄ (INV-BOUNDED-INFLUENCE): docs/THREAT_MODEL.md.
Leaks: each site's per-block absmax of w_c Δ_c (a norm, 4 bytes per block) goes to the aggregator.

Dropout: a missing announcement or update raises ParticipantDropped before anything is applied;
the round loop reruns begin_round/announce/agree/encode/aggregate with the survivors, who draw new
keys, so stale masks, announcements and updates fail their session binding. The retry assumes an
aggregator that follows the protocol (Bonawitz et al.'s honest-but-curious model): one that
collected every update of an attempt, then claimed a dropout and unmasked the retry, could learn a
site's update as the difference of two sums; their actively secure variant adds a consistency round
for this, which is not built here.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from lensemble.errors import ConfigError, IntegrityError
from lensemble.federation import native, secagg
from lensemble.federation.quant import (
    DEFAULT_BLOCK, MAX_ABS, block_absmax, dequantize_range, num_blocks, quantize_int8,
    robust_absmax, scales_from_absmax,
)
from lensemble.federation.signing import (
    SIGNATURE_BYTES, ReplayGuard, aggregation_context, check_binding, check_roster, key_fingerprint, open_signed,
    raise_if_missing, sign, signature, verify_updates,
)
from lensemble.federation.site_pass import check_layout, flat_segments, new_payload, quantize_mask_into, weighted_absmax
from lensemble.federation.transport import (
    Accepted, AttemptAborted, FusedKernel, ParamSpec, RoundContext, Transport, block_aligned_start, check_delta, flatten, pack_header,
    spec_hash, spec_numel, unpack_header,
)

KEY_BYTES = 32
RANGE_CHUNK = 1 << 18
"""Parameters per slice of the aggregator's range check: the slice's ring sum stays in cache."""
_log = logging.getLogger("lensemble.federation")
_HEX = 32  # length of every hex nonce / session / grid id in a header


def _base_header(run_id: str, round_idx: int, site: str, spec: ParamSpec, frozen: int = 0) -> dict:
    return {"run": run_id, "round": round_idx, "site": site, "spec": spec_hash(spec, frozen)}


def int8_header(run_id: str, round_idx: int, site: str, spec: ParamSpec, block: int, nonce: str, frozen: int = 0) -> dict:
    """Header of an int8 update; the random nonce makes every encoding unique (see ReplayGuard)."""
    return {**_base_header(run_id, round_idx, site, spec, frozen), "transport": "int8", "block": block, "nonce": nonce}


def announce_header(run_id: str, round_idx: int, site: str, spec: ParamSpec, session: str, frozen: int = 0) -> dict:
    """Header of a secure_int8 announcement."""
    return {**_base_header(run_id, round_idx, site, spec, frozen), "kind": "announce", "session": session}


def secure_header(
    run_id: str, round_idx: int, site: str, spec: ParamSpec, block: int, ring_bits: int, session: str, grid: str, frozen: int = 0
) -> dict:
    """Header of a secure_int8 update, bound to the round attempt's keys (session) and grid."""
    return {
        **_base_header(run_id, round_idx, site, spec, frozen), "transport": "secure_int8", "block": block,
        "ring_bits": ring_bits, "session": session, "grid": grid,
    }


def key_message(run_id: str, round_idx: int, site: str, x25519_public: bytes) -> bytes:
    """What a site's Ed25519 key signs to vouch for its ephemeral X25519 key."""
    return b"lensemble/secagg-key/v1" + pack_header({"run": run_id, "round": round_idx, "site": site}) + x25519_public


def expected_comm_bytes(
    transport_name: str, spec: ParamSpec, num_sites: int, *, run_id: str, round_idx: int, site: str,
    block: int = DEFAULT_BLOCK, ring_bits: int = 16, frozen: int = 0,
) -> dict[str, int]:
    """Bytes one site puts on the wire in one round, by part, and their "total" (module docstring).

    Header lengths depend on the run id, round and site name, hence those keyword arguments. `frozen`:
    the round's frozen prefix (`RoundContext.frozen`), which stays off the wire in whole blocks.
    """
    wire_start = frozen if transport_name == "fp32" else block_aligned_start(frozen, block)
    n, z = spec_numel(spec) - wire_start, "0" * _HEX
    nb = num_blocks(n, block)
    parts = dict.fromkeys(("key_material", "announcement", "header", "scales", "body", "signature"), 0)
    if transport_name == "fp32":
        parts.update(header=len(pack_header(_base_header(run_id, round_idx, site, spec))), body=4 * n)
    elif transport_name == "int8":
        header = int8_header(run_id, round_idx, site, spec, block, z)
        parts.update(header=len(pack_header(header)), scales=4 * nb, body=n, signature=SIGNATURE_BYTES)
    elif transport_name == "secure_int8":
        secagg.check_ring_capacity(num_sites, ring_bits)
        announcement = len(pack_header(announce_header(run_id, round_idx, site, spec, z))) + 4 * nb + SIGNATURE_BYTES
        header = secure_header(run_id, round_idx, site, spec, block, ring_bits, z, z)
        parts.update(
            key_material=KEY_BYTES + SIGNATURE_BYTES, announcement=announcement, header=len(pack_header(header)),
            body=secagg.ring_dtype(ring_bits).itemsize * n, signature=SIGNATURE_BYTES,
        )
    else:
        raise ConfigError(f"unknown transport {transport_name!r}; expected one of fp32, int8, secure_int8")
    parts["total"] = sum(parts.values())
    return parts


def _site_vector(ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor], weighted: bool, start: int) -> torch.Tensor:
    """Δ_c (or w_c Δ_c) from `start` on as one fp32 vector, after the spec/NaN/frozen checks and the quantizer's domain check."""
    check_delta(ctx, site, delta)
    x_N = flatten(ctx.spec, delta)[start:]
    if weighted:
        x_N = x_N * torch.tensor(ctx.weight(site), dtype=torch.float32)
    if x_N.numel() and float(x_N.abs().max()) > MAX_ABS:
        raise IntegrityError(f"update from {site!r} has values above {MAX_ABS:.3g}; it diverged", site=site)
    return x_N


def _raise_bad_update(
    ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor], announced_B: torch.Tensor | None, block: int
) -> NoReturn:
    """Name what a one-pass check (`site_pass`) refused, with the reference checks and their errors."""
    x_N = _site_vector(ctx, site, delta, True, block_aligned_start(ctx.frozen, block))  # IntegrityError: NaN, Inf, above MAX_ABS, frozen moved
    if announced_B is not None and bool((block_absmax(x_N, block) > announced_B).any()):
        raise ValueError(f"secure_int8: the update of {site!r} changed between announce and encode")
    raise AssertionError(f"the one-pass check refused the update of {site!r} but the reference checks pass it")


def _nonce_of(header: Mapping) -> str:
    """The header's nonce if it is 32 hex digits, else a placeholder that fails the binding check."""
    nonce = header.get("nonce") if isinstance(header, Mapping) else None
    if isinstance(nonce, str) and len(nonce) == _HEX and all(ch in "0123456789abcdef" for ch in nonce):
        return nonce
    return "<32 lowercase hex digits>"


def _read_f32(body: memoryview, site: str, what: str) -> torch.Tensor:
    """fp32 values from a body; IntegrityError unless finite, non-negative and in the quantizer's domain."""
    v = torch.from_numpy(np.frombuffer(body, dtype="<f4").astype(np.float32))
    if not torch.isfinite(v).all() or (v < 0).any() or (v.numel() and float(v.max()) > MAX_ABS):
        raise IntegrityError(f"update from {site!r} has {what} that are NaN, Inf, negative or above {MAX_ABS:.3g}", site=site)
    return v


class _SignedTransport(Transport):
    """Holds the signing keys of the sites it plays and the public keys of the sites it checks.

    No key is trusted on first use (INV-PINNED-KEYS): a party holds the signing keys it is given
    (`site_keys`) and takes the others' public keys through `register` only. With `pins` (site ->
    SHA-256 hex of the raw public key, as params pin them) `register` refuses a site without a pin
    and a key whose fingerprint is not the pinned one, and a party whose own key is not the pinned
    one refuses to start (IntegrityError naming the site, each). `site_keys=None` is a simulation in
    which this one object plays every party: `begin_round` draws each site's key and registers it
    itself, so no message from outside can introduce a key.
    """

    def __init__(self, site_keys: Mapping[str, Ed25519PrivateKey] | None = None, *, block: int = DEFAULT_BLOCK,
                 pins: Mapping[str, str] | None = None) -> None:
        num_blocks(0, block)  # ValueError for a non-positive block
        self.block = block
        self._simulated = site_keys is None
        self._pins = None if pins is None else dict(pins)
        self._site_keys = dict(site_keys or {})
        self._registry: dict = {}
        for site, key in sorted(self._site_keys.items()):
            self._check_pin(site, key.public_key(), "its own signing key")
            self._registry[site] = key.public_key()
        self._guard = ReplayGuard()

    def _check_pin(self, site: str, public_key, what: str) -> None:
        if self._pins is None:
            return
        if site not in self._pins:
            raise IntegrityError(f"site {site!r} has no pinned key fingerprint in params: unknown site, key refused", site=site)
        fingerprint = key_fingerprint(public_key)
        if fingerprint != self._pins[site]:
            raise IntegrityError(f"site {site!r}: {what} has fingerprint {fingerprint}, not the pinned {self._pins[site]}", site=site)

    def register(self, site: str, public_key) -> None:
        """Add a site's Ed25519 public key to the registry: pinned (when pins are set) and never swapped."""
        self._check_pin(site, public_key, "the signing key presented")
        if site in self._registry and self._registry[site].public_bytes_raw() != public_key.public_bytes_raw():
            raise IntegrityError(f"site {site!r} presented a different signing key from the one registered", site=site)
        self._registry[site] = public_key

    def begin_round(self, ctx: RoundContext) -> dict[str, int]:
        """Every party in this object: in a simulation, first draw and register the key of each new site."""
        if self._simulated:
            for site in ctx.site_ids:
                if site not in self._site_keys:
                    key = Ed25519PrivateKey.generate()
                    self.register(site, key.public_key())
                    self._site_keys[site] = key
        return super().begin_round(ctx)

    def wire_start(self, ctx: RoundContext) -> int:
        """The frozen prefix rounded down to whole blocks (`block_aligned_start`)."""
        return block_aligned_start(ctx.frozen, self.block)

    def _signing_key(self, site: str) -> Ed25519PrivateKey:
        if site not in self._site_keys:
            raise ConfigError(f"no Ed25519 signing key for site {site!r}; pass it in site_keys"
                              + (" (a simulation draws it in begin_round)" if self._simulated else ""))
        return self._site_keys[site]


class Int8Transport(_SignedTransport):
    """Per-site absmax int8 + signature; the aggregator dequantizes and accumulates w_c x̂_c in fp64."""

    name = "int8"

    def encode(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        q_N, scales_B = quantize_int8(_site_vector(ctx, site, delta, False, self.wire_start(ctx)), self.block)
        header = int8_header(ctx.run_id, ctx.round_idx, site, ctx.spec, self.block, os.urandom(_HEX // 2).hex(), ctx.frozen)
        body = scales_B.numpy().astype("<f4").tobytes() + q_N.numpy().tobytes()
        return sign(self._signing_key(site), pack_header(header) + body)

    def verify(self, ctx: RoundContext, payloads: Mapping[str, bytes]) -> Accepted:
        n = self.wire_numel(ctx)
        nb = num_blocks(n, self.block)

        def expected_header(site: str, header: Mapping) -> dict:
            return int8_header(ctx.run_id, ctx.round_idx, site, ctx.spec, self.block, _nonce_of(header), ctx.frozen)

        bodies = verify_updates(
            ctx, payloads, self._registry, expected_header, 4 * nb + n, self._guard,
            aggregation_context(ctx, f"int8/{self.block}"),
            check_body=lambda site, body: _read_f32(body[: 4 * nb], site, "scales"),
        )
        scales = {site: _read_f32(body[: 4 * nb], site, "scales").numpy() for site, body in bodies.items()}
        return Accepted({site: body[4 * nb :] for site, body in bodies.items()}, scales)

    def mean_into(self, ctx: RoundContext, accepted: Accepted, start: int, out_n: np.ndarray) -> None:
        n = out_n.shape[0]
        acc_n, x_n = np.zeros(n, dtype=np.float64), np.empty(n, dtype=np.float64)
        for site in sorted(accepted.bodies):  # fixed order: fp64 addition is not associative
            q_n = np.frombuffer(accepted.bodies[site], dtype=np.int8)[start : start + n]
            dequantize_range(q_n, accepted.scales[site], start, self.block, x_n)  # exact in fp64
            acc_n += x_n * ctx.weight(site)
        out_n[...] = acc_n


@dataclass
class _Attempt:
    """One round attempt of secure_int8: the sites' ephemeral public keys, session id and, after `agree`, the grid."""

    ctx: RoundContext
    public: dict[str, bytes]
    session: str
    absmax_B: torch.Tensor | None = None
    scales_B: torch.Tensor | None = None
    grid: str = ""
    announced: dict[str, torch.Tensor] = field(default_factory=dict)  # the absmax each site played here announced
    capped: dict[str, int] = field(default_factory=dict)  # aggregator: site -> blocks whose announcement was capped


class SecureInt8Transport(_SignedTransport):
    """Shared int8 grid + pairwise masks in Z_{2^k} + signatures; the aggregator sees only the sum.

    One object can play every party (`begin_round`, as in one process) or one side of a distributed
    round: a site holds only its own signing key and the peers' public keys (`register`), sends
    `key_share`, takes the roster with `accept_shares`, announces, takes `grid_message` with
    `accept_grid` and encodes; the aggregator holds public keys only.
    """

    name = "secure_int8"

    def __init__(
        self,
        site_keys: Mapping[str, Ed25519PrivateKey] | None = None,
        *,
        block: int = DEFAULT_BLOCK,
        ring_bits: int = 16,
        pins: Mapping[str, str] | None = None,
        outlier_factor: float | None = None,
    ) -> None:
        super().__init__(site_keys, block=block, pins=pins)
        secagg.ring_dtype(ring_bits)  # ConfigError for an unsupported ring
        if outlier_factor is not None and not outlier_factor >= 1.0:
            raise ConfigError(f"secure_int8: outlier_factor must be >= 1, got {outlier_factor}")
        self.ring_bits = ring_bits
        self.outlier_factor = outlier_factor
        self._attempt: _Attempt | None = None
        self._ephemeral: dict[tuple[str, int, tuple[str, ...], str], X25519PrivateKey] = {}  # (run, round, roster, site)
        self._ring_scratch = np.empty(0, dtype=secagg.ring_dtype(ring_bits))

    def _current(self, ctx: RoundContext, agreed: bool) -> _Attempt:
        attempt = self._attempt
        if attempt is None or attempt.ctx != ctx:
            raise ValueError(f"secure_int8: call begin_round(ctx) for round {ctx.round_idx} with this exact ctx first")
        if agreed and attempt.scales_B is None:
            raise ValueError(f"secure_int8: call announce/agree for round {ctx.round_idx} before encode/aggregate")
        return attempt

    def key_share(self, ctx: RoundContext, site: str) -> bytes:
        """A fresh X25519 key for this attempt, vouched for by the site's Ed25519 key: 32 + 64 bytes."""
        secagg.check_ring_capacity(len(ctx.site_ids), self.ring_bits)
        self._ephemeral = {k: v for k, v in self._ephemeral.items() if k[1] >= ctx.round_idx}  # earlier rounds are spent
        key = self._ephemeral[(ctx.run_id, ctx.round_idx, ctx.site_ids, site)] = X25519PrivateKey.generate()
        public = key.public_key().public_bytes_raw()
        return public + sign(self._signing_key(site), key_message(ctx.run_id, ctx.round_idx, site, public))[-SIGNATURE_BYTES:]

    def accept_shares(self, ctx: RoundContext, shares: Mapping[str, bytes]) -> dict[str, int]:
        """Check every site's key share (it stops a man in the middle and a small-order key); fix the session.

        Per sender, in sorted order: length, Ed25519 signature, a large-order X25519 key (IntegrityError
        naming it). Then no two sites may present the same key: a party that drew the key itself names
        the other site; the aggregator cannot tell who copied whom and aborts the attempt.
        """
        secagg.check_ring_capacity(len(ctx.site_ids), self.ring_bits)
        check_roster(ctx, shares)
        raise_if_missing(ctx, shares, "key share")
        public = {}
        for site in ctx.site_ids:
            wire = shares[site]
            if len(wire) != KEY_BYTES + SIGNATURE_BYTES:
                raise IntegrityError(f"key share from {site!r} has {len(wire)} bytes, expected {KEY_BYTES + SIGNATURE_BYTES}", site=site)
            key = bytes(wire[:KEY_BYTES])
            open_signed(key_message(ctx.run_id, ctx.round_idx, site, key) + bytes(wire[KEY_BYTES:]), site, self._registry)
            secagg.check_public_key(site, key)
            public[site] = key
        self._check_distinct(ctx, public)
        self._attempt = _Attempt(ctx, public, secagg.session_id(ctx.run_id, ctx.round_idx, public))
        return {site: len(shares[site]) for site in ctx.site_ids}

    def _check_distinct(self, ctx: RoundContext, public: Mapping[str, bytes]) -> None:
        """IntegrityError naming a site that presents another's X25519 key, or AttemptAborted when no party here drew it."""
        holders: dict[bytes, list[str]] = {}
        for site in ctx.site_ids:
            holders.setdefault(public[site], []).append(site)
        for key, sites in holders.items():
            if len(sites) < 2:
                continue
            for owner in sites:  # a site this object plays, whose own ephemeral key this is
                mine = self._ephemeral.get((ctx.run_id, ctx.round_idx, ctx.site_ids, owner))
                if mine is not None and mine.public_key().public_bytes_raw() == key:
                    copier = next(s for s in sites if s != owner)
                    raise IntegrityError(f"key share from {copier!r} copies the X25519 key of {owner!r}", site=copier)
            raise AttemptAborted(f"round {ctx.round_idx}: sites {sites} present the same X25519 key; one copied"
                                 " the other's, which the aggregator cannot tell apart; attempt aborted", suspects=tuple(sites))

    def announce(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        """The per-block absmax of w_c Δ_c, signed and bound to this attempt (one pass: `site_pass`)."""
        attempt = self._current(ctx, agreed=False)
        check_layout(ctx, site, delta)
        absmax_B = weighted_absmax(flat_segments(ctx, delta, self.wire_start(ctx)), ctx.weight(site), self.block)
        if absmax_B is None:
            _raise_bad_update(ctx, site, delta, None, self.block)
        attempt.announced[site] = absmax_B
        header = announce_header(ctx.run_id, ctx.round_idx, site, ctx.spec, attempt.session, ctx.frozen)
        return sign(self._signing_key(site), pack_header(header) + absmax_B.numpy().astype("<f4").tobytes())

    def agree(self, ctx: RoundContext, announcements: Mapping[str, bytes]) -> None:
        """Fix the shared grid s_b = max_c min(a_{c,b}, f · a_(2),b) / 127 (module docstring; exact, order-free)."""
        attempt = self._current(ctx, agreed=False)
        check_roster(ctx, announcements)
        nb = num_blocks(self.wire_numel(ctx), self.block)
        absmax_CB = []
        for site in sorted(announcements):
            header, body = unpack_header(open_signed(announcements[site], site, self._registry)[0], site)
            check_binding(header, announce_header(ctx.run_id, ctx.round_idx, site, ctx.spec, attempt.session, ctx.frozen), site)
            if len(body) != 4 * nb:
                raise IntegrityError(f"announcement from {site!r} has {len(body)} bytes, expected {4 * nb}", site=site)
            absmax_CB.append(_read_f32(body, site, "block absmax values"))
        raise_if_missing(ctx, announcements, "announcement")
        attempt.absmax_B, capped_CB = robust_absmax(torch.stack(absmax_CB), self.outlier_factor)
        counts = capped_CB.sum(dim=1).tolist()
        attempt.capped = {site: int(n) for site, n in zip(sorted(announcements), counts) if n}
        for site, n in attempt.capped.items():
            _log.warning("round %d: %s announced an absmax above %g x the second-largest in %d of %d blocks; capped, its"
                         " values there saturate at ±127 codes", ctx.round_idx, site, self.outlier_factor, n, nb)
        attempt.scales_B = scales_from_absmax(attempt.absmax_B)
        attempt.grid = hashlib.sha256(attempt.scales_B.numpy().astype("<f4").tobytes()).hexdigest()[:_HEX]

    def grid_message(self, ctx: RoundContext) -> bytes:
        """The agreed per-block absmax (fp32), which every site needs to quantize on the shared grid."""
        return self._current(ctx, agreed=True).absmax_B.numpy().astype("<f4").tobytes()

    def accept_grid(self, ctx: RoundContext, message: bytes) -> None:
        """Take the aggregator's agreed absmax; the grid id binds every update to it."""
        attempt = self._current(ctx, agreed=False)
        nb = num_blocks(self.wire_numel(ctx), self.block)
        if len(message) != 4 * nb:
            raise IntegrityError(f"grid message from the aggregator has {len(message)} bytes, expected {4 * nb}")
        attempt.absmax_B = _read_f32(memoryview(message), "aggregator", "agreed absmax values")
        attempt.scales_B = scales_from_absmax(attempt.absmax_B)
        attempt.grid = hashlib.sha256(attempt.scales_B.numpy().astype("<f4").tobytes()).hexdigest()[:_HEX]

    def encode(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        """Quantize w_c Δ_c on the shared grid, add the pairwise mask in Z_{2^k}, sign: one pass, one buffer.

        Header, body and signature are written once, into the `bytes` that is returned (`new_payload`),
        the body hashed for the signature chunk by chunk as it is written: no copy, no second read.
        Values are checked against what the site announced: a capped block (an outlier) saturates, a
        value above its announced absmax means the update changed (ValueError).
        """
        attempt = self._current(ctx, agreed=True)
        check_layout(ctx, site, delta)
        private = self._ephemeral.get((ctx.run_id, ctx.round_idx, ctx.site_ids, site))
        if private is None:
            raise ValueError(f"secure_int8: {site!r} holds no key share for round {ctx.round_idx} of this attempt")
        key = self._signing_key(site)
        header = pack_header(secure_header(
            ctx.run_id, ctx.round_idx, site, ctx.spec, self.block, self.ring_bits, attempt.session, attempt.grid, ctx.frozen
        ))
        n, dtype = self.wire_numel(ctx), secagg.ring_dtype(self.ring_bits)
        payload, buffer_u8 = new_payload(len(header) + dtype.itemsize * n + SIGNATURE_BYTES)
        buffer_u8[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        streams = secagg.pair_streams(site, private, attempt.public, ctx.run_id, ctx.round_idx, attempt.session)
        announced_B = attempt.announced.get(site, attempt.absmax_B)
        body_N = buffer_u8[len(header) : len(header) + dtype.itemsize * n].view(dtype)
        sha = hashlib.sha256(header)
        if not quantize_mask_into(flat_segments(ctx, delta, self.wire_start(ctx)), ctx.weight(site), attempt.scales_B, announced_B, streams,
                                  self.ring_bits, self.block, body_N, sha.update):
            _raise_bad_update(ctx, site, delta, announced_B, self.block)
        buffer_u8[-SIGNATURE_BYTES:] = np.frombuffer(signature(key, sha.digest()), dtype=np.uint8)
        return payload

    def verify(self, ctx: RoundContext, payloads: Mapping[str, bytes]) -> Accepted:
        """Signatures, bindings to this attempt's session and grid, lengths and replays of every update."""
        attempt = self._current(ctx, agreed=True)
        dtype = secagg.ring_dtype(self.ring_bits)

        def expected_header(site: str, header: Mapping) -> dict:
            return secure_header(
                ctx.run_id, ctx.round_idx, site, ctx.spec, self.block, self.ring_bits, attempt.session, attempt.grid, ctx.frozen
            )

        bodies = verify_updates(
            ctx, payloads, self._registry, expected_header, dtype.itemsize * self.wire_numel(ctx), self._guard,
            aggregation_context(ctx, f"secure_int8/{attempt.session}/{attempt.grid}"),
        )
        bad = self.sum_out_of_range(ctx, bodies)
        if bad:
            raise AttemptAborted(
                f"round {ctx.round_idx}: the unmasked sum of {len(bodies)} updates lies outside ±127·{len(bodies)} at {bad}"
                f" of {self.wire_numel(ctx)} parameters on the wire; a contribution is corrupt (under masking no site can be named);"
                " nothing applied", suspects=tuple(sorted(bodies)))
        return Accepted(bodies)

    def sum_out_of_range(self, ctx: RoundContext, bodies: Mapping[str, memoryview]) -> int:
        """How many unmasked sums Σ_c q_c lie outside [-127 C, 127 C] (C = len(bodies)); slice by slice, in cache."""
        dtype = secagg.ring_dtype(self.ring_bits)
        vectors = [np.frombuffer(bodies[site], dtype=dtype) for site in sorted(bodies)]
        n = self.wire_numel(ctx)
        if self._ring_scratch.shape[0] < min(n, RANGE_CHUNK) or self._ring_scratch.dtype != dtype:
            self._ring_scratch = np.empty(min(n, RANGE_CHUNK), dtype=dtype)
        bad = 0
        for a in range(0, n, RANGE_CHUNK):
            b = min(n, a + RANGE_CHUNK)
            total_n = secagg.ring_sum([v[a:b] for v in vectors], self.ring_bits, out=self._ring_scratch[: b - a])
            bad += secagg.out_of_range(total_n, len(vectors), self.ring_bits)
        return bad

    def capped_blocks(self, ctx: RoundContext) -> dict[str, int]:
        """Per site, the blocks of this attempt whose announcement `agree` capped (its values saturate there)."""
        attempt = self._attempt
        return dict(attempt.capped) if attempt is not None and attempt.ctx == ctx else {}

    def fused_kernel(self, ctx: RoundContext, accepted: Accepted, lr: float, momentum: float) -> FusedKernel | None:
        """`native.lens_secure16_step` over this round's bodies (16-bit ring, a C compiler present), else None.

        The kernel self-checks each tile and returns -1, or the offset of a tile whose two evaluations differ.
        """
        lib = native.load()
        if lib is None or self.ring_bits != 16:
            return None
        attempt = self._current(ctx, agreed=True)
        sites = sorted(accepted.bodies)
        arrays = [np.frombuffer(accepted.bodies[site], dtype=np.uint8) for site in sites]  # kept alive below
        pointers = (ctypes.c_void_p * len(sites))(*[a.ctypes.data for a in arrays])
        scales_B = attempt.scales_B.contiguous()
        fused = int(native.torch_fuses_alpha())

        def kernel(start: int, p_n: torch.Tensor, m_n: torch.Tensor | None, new_p_n: torch.Tensor, new_m_n: torch.Tensor) -> int:
            _ = arrays
            return lib.lens_secure16_step(
                pointers, len(sites), start, p_n.numel(), scales_B.data_ptr(), self.block, p_n.data_ptr(),
                None if m_n is None else m_n.data_ptr(), momentum, lr, fused, new_p_n.data_ptr(), new_m_n.data_ptr(),
            )

        return kernel

    def mean_into(self, ctx: RoundContext, accepted: Accepted, start: int, out_n: np.ndarray) -> None:
        """Sum the slice exactly in Z_{2^k} (masks cancel), read Σ_c q_c, multiply by the shared scales."""
        attempt = self._current(ctx, agreed=True)
        n = out_n.shape[0]
        dtype = secagg.ring_dtype(self.ring_bits)
        sites = sorted(accepted.bodies)
        vectors = [np.frombuffer(accepted.bodies[site], dtype=dtype)[start : start + n] for site in sites]
        if self._ring_scratch.shape[0] < n or self._ring_scratch.dtype != dtype:  # reused: no page faults per chunk
            self._ring_scratch = np.empty(n, dtype=dtype)
        total_n = secagg.ring_sum(vectors, self.ring_bits, out=self._ring_scratch[:n])
        sum_q_n = secagg.from_ring(total_n, self.ring_bits)
        scales_B = attempt.scales_B.numpy()
        if self.ring_bits == 16:
            # |Σq| < 2^15, so q · s is exact in fp64 and the fp32 product is the same correctly rounded
            # value, computed at half the memory traffic.
            dequantize_range(sum_q_n, scales_B, start, self.block, out_n)
        else:  # a 32-bit ring's sums need fp64 before the one rounding to fp32
            out_n[...] = dequantize_range(sum_q_n, scales_B, start, self.block, np.empty(n, dtype=np.float64))
