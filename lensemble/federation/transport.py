"""The wire between sites and the aggregator: one interface, several encodings.

The round loop (`lensemble.federation.rounds`) is written once against `Transport`; a transport
decides how a site's pseudo-gradient Δ_c is put on the wire (plain fp32, int8, secure int8) and how
the aggregator turns the accepted payloads into the weighted mean Δ̄ = Σ_c w_c Δ_c.

Protocol per round, in this order:
1. `begin_round(ctx)` - key agreement etc.; returns the setup bytes each site put on the wire.
2. `announce(ctx, site, delta)` on every site - optional small message (for example the scale a
   shared quantization grid needs); `agree(ctx, announcements)` on the aggregator.
3. `encode(ctx, site, delta)` on every site - the serialized update.
4. `aggregate(ctx, payloads)` on the aggregator - verify each payload and return Δ̄ (fp32) computed
   in sorted site order with fp64 or exact integer accumulation. It is `verify(ctx, payloads)` (the
   checks, once per round: signatures, bindings, lengths, replay) followed by
   `mean_into(ctx, accepted, start, out)`, which computes any slice Δ̄[start : start + len(out)] on
   its own with the same bits as the whole vector has there; `outer.aggregate_and_step` uses it to
   fuse averaging with the outer step chunk by chunk, in cache.

`payload` bytes are exactly what the comms accountant counts.

A round whose encoder no longer learns (`train.freeze_encoder_at`) has a frozen prefix
(`RoundContext.frozen`: the leading tensors of the spec, which every party derives from params through
`schedule.round_frozen_prefix`). Every site's Δ there is exactly 0 (`check_delta` / `check_frozen` refuse
a site that moved one, naming it), so it stays home: payloads carry Δ[wire_start:] (`Transport.wire_start`:
the prefix, rounded down to whole quantization blocks so that every block on the wire keeps its bounds),
the header's spec hash binds the prefix, `mean_into` offsets are into the wire's vector, and the outer
step takes Δ̄ = 0 on the whole prefix, whatever the wire says (`outer.apply_outer_step`). The round's parameters and momentum are the
bits of the round that sends the zeros; its bytes are 2 (secure_int8) x the prefix fewer a site.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from lensemble.errors import IntegrityError, ParticipantDropped

ParamSpec = tuple[tuple[str, tuple[int, ...]], ...]
"""Ordered (name, shape) of every federated tensor; the same at every site."""


def param_spec(state: Mapping[str, torch.Tensor]) -> ParamSpec:
    """The spec of a state dict, in sorted name order."""
    return tuple((name, tuple(state[name].shape)) for name in sorted(state))


def spec_numel(spec: ParamSpec) -> int:
    """Number of scalar parameters a spec describes."""
    total = 0
    for _, shape in spec:
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


@dataclass(frozen=True)
class RoundContext:
    """What every party knows about a round before it starts."""

    run_id: str
    round_idx: int
    site_ids: tuple[str, ...]
    spec: ParamSpec
    weights: Mapping[str, float] = field(default_factory=dict)
    frozen: int = 0
    """Parameters at the head of the flat update (spec order, whole tensors) that do not learn this round:
    every site's Δ there is exactly 0 (`check_delta` refuses anything else), Δ̄ there is 0, and they stay
    off the wire (`frozen_prefix`; a transport sends from `Transport.wire_start` on)."""

    def __post_init__(self) -> None:
        if tuple(sorted(self.site_ids)) != self.site_ids:
            raise ValueError("RoundContext.site_ids must be sorted")
        if self.frozen not in _tensor_boundaries(self.spec):
            raise ValueError(f"RoundContext.frozen must end on a tensor boundary of the spec, got {self.frozen}")

    def weight(self, site: str) -> float:
        """w_c; uniform when no weights were given."""
        if not self.weights:
            return 1.0 / len(self.site_ids)
        return float(self.weights[site])


def _tensor_boundaries(spec: ParamSpec) -> set[int]:
    """Offsets at which a tensor of the flat vector starts or the vector ends."""
    offsets, total = {0}, 0
    for _, shape in spec:
        total += math.prod(shape)
        offsets.add(total)
    return offsets


def frozen_prefix(spec: ParamSpec, frozen_names: Callable[[str], bool]) -> int:
    """Parameters in the leading tensors of `spec` for which `frozen_names(name)` holds (RoundContext.frozen)."""
    total = 0
    for name, shape in spec:
        if not frozen_names(name):
            break
        total += math.prod(shape)
    return total


def frozen_tensors(ctx: RoundContext) -> list[str]:
    """Names of the tensors in the round's frozen prefix."""
    names, total = [], 0
    for name, shape in ctx.spec:
        if total >= ctx.frozen:
            break
        names.append(name)
        total += math.prod(shape)
    return names


def block_aligned_start(frozen: int, block: int) -> int:
    """The wire's start for a block-quantizing transport: the frozen prefix rounded down to whole blocks, so every
    block on the wire keeps the bounds (and every code the bits) it has without a frozen prefix."""
    return frozen // block * block


def check_frozen(ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> None:
    """IntegrityError naming the site and the tensor when Δ_c moves a tensor that is frozen this round."""
    for name in frozen_tensors(ctx):
        if bool(delta[name].detach().to(device="cpu").reshape(-1).ne(0).any()):
            raise IntegrityError(f"update from {site!r} changes {name}, which is frozen in round {ctx.round_idx}"
                                 " (train.freeze_encoder_at); a frozen tensor's update must be exactly 0", site=site)


def check_delta(ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> None:
    """Names, shapes, dtype and finiteness of a site's Δ_c against the round's spec; zero on the frozen prefix."""
    if site not in ctx.site_ids:
        raise IntegrityError(f"site {site!r} is not in the federation {list(ctx.site_ids)}", site=site)
    names = tuple(sorted(delta))
    expected = tuple(name for name, _ in ctx.spec)
    if names != expected:
        extra = sorted(set(names) - set(expected))
        missing = sorted(set(expected) - set(names))
        raise IntegrityError(f"update from {site!r} has wrong names: extra {extra}, missing {missing}", site=site)
    for name, shape in ctx.spec:
        t = delta[name]
        if tuple(t.shape) != shape:
            raise IntegrityError(f"update from {site!r}: {name} has shape {tuple(t.shape)}, expected {shape}", site=site)
        if not torch.isfinite(t).all():
            raise IntegrityError(f"update from {site!r}: {name} holds NaN or Inf", site=site)
    check_frozen(ctx, site, delta)


def flatten(spec: ParamSpec, delta: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Concatenate a state dict into one fp32 vector in spec order."""
    return torch.cat([delta[name].detach().reshape(-1).to(torch.float32) for name, _ in spec])


def unflatten(spec: ParamSpec, vec: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of `flatten`."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in spec:
        n = 1
        for s in shape:
            n *= s
        out[name] = vec[offset : offset + n].reshape(shape).clone()
        offset += n
    return out


def spec_hash(spec: ParamSpec, frozen: int = 0) -> str:
    """A short hash binding a payload to the federated parameter layout (and the round's frozen prefix, when there is one)."""
    return hashlib.sha256(json.dumps(spec if frozen == 0 else [spec, frozen]).encode()).hexdigest()[:16]


def pack_header(header: dict) -> bytes:
    """Length-prefixed canonical JSON header (u32 little endian length)."""
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<I", len(raw)) + raw


def unpack_header(payload: bytes, site: str) -> tuple[dict, memoryview]:
    """Split a payload into its header and body; IntegrityError if it is malformed."""
    if len(payload) < 4:
        raise IntegrityError(f"update from {site!r} is truncated ({len(payload)} bytes)", site=site)
    (n,) = struct.unpack_from("<I", payload, 0)
    if 4 + n > len(payload):
        raise IntegrityError(f"update from {site!r} has a header longer than the payload", site=site)
    try:
        header = json.loads(bytes(payload[4 : 4 + n]))
    except ValueError as exc:
        raise IntegrityError(f"update from {site!r} has an unreadable header: {exc}", site=site) from None
    return header, memoryview(payload)[4 + n :]


class AttemptAborted(IntegrityError):
    """A round attempt failed a check that names no culprit (INV-BOUNDED-INFLUENCE): an unmasked sum out
    of range, two sites with the same key share. Nothing was applied; the round driver records it and
    redoes the attempt with fresh keys, once (`rounds.run_round`). `suspects`: the sites it may involve.
    """

    def __init__(self, message: str, *, suspects: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.suspects = suspects


@dataclass(frozen=True)
class Accepted:
    """What the aggregator accepted in one round: each site's verified body, in sorted site order.

    `scales` holds per-site fp32 block scales where a transport sends them (int8); empty otherwise.
    """

    bodies: dict[str, memoryview]
    scales: dict[str, np.ndarray] = field(default_factory=dict)


FusedKernel = Callable[[int, torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor], int]
"""(start, p_n, m_n or None, new_p_n, new_m_n) -> -1 or the offset of a slice whose two evaluations
differ: the self-checked outer step on Δ̄[start : start + n], see outer.py."""


class Transport(ABC):
    """How Δ_c travels; see the module docstring for the call order."""

    name: str = ""

    def register(self, site: str, public_key) -> None:
        """Aggregator side (and a site's, for its peers): take a site's Ed25519 public key; nothing to do unsigned."""

    def begin_round(self, ctx: RoundContext) -> dict[str, int]:
        """Per-round setup when every site's side lives in this object: each site's key share, accepted.

        Returns the setup bytes each site put on the wire (0 when there is none).
        """
        return self.accept_shares(ctx, {site: self.key_share(ctx, site) for site in ctx.site_ids})

    def key_share(self, ctx: RoundContext, site: str) -> bytes:
        """Site side: this site's key-setup message for the round attempt (empty when there is none)."""
        return b""

    def accept_shares(self, ctx: RoundContext, shares: Mapping[str, bytes]) -> dict[str, int]:
        """Either side: check every site's key share and fix the attempt; returns bytes per site."""
        return {site: len(shares.get(site, b"")) for site in ctx.site_ids}

    def grid_message(self, ctx: RoundContext) -> bytes:
        """Aggregator side, after `agree`: what it broadcasts back to the sites (empty when nothing)."""
        return b""

    def accept_grid(self, ctx: RoundContext, message: bytes) -> None:
        """Site side: take the aggregator's `grid_message` before `encode`."""

    def announce(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        """An optional small message before `encode`; empty by default."""
        return b""

    def agree(self, ctx: RoundContext, announcements: Mapping[str, bytes]) -> None:
        """The aggregator's answer to the announcements; nothing by default."""

    @abstractmethod
    def encode(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        """Serialize (and protect) one site's Δ_c."""

    @abstractmethod
    def verify(self, ctx: RoundContext, payloads: Mapping[str, bytes]) -> Accepted:
        """Check a whole round's payloads (IntegrityError, ParticipantDropped) and keep their bodies."""

    @abstractmethod
    def mean_into(self, ctx: RoundContext, accepted: Accepted, start: int, out_n: np.ndarray) -> None:
        """Δ̄[start : start + n] = Σ_c w_c Δ_c over that slice of the wire's vector (offsets from `wire_start`),
        into the fp32 array `out_n` of length n."""

    def fused_kernel(self, ctx: RoundContext, accepted: Accepted, lr: float, momentum: float) -> FusedKernel | None:
        """A native one-pass average + outer step over slices, if this transport has one (none by default)."""
        return None

    def wire_start(self, ctx: RoundContext) -> int:
        """Where the wire's vector starts in the flat update: the frozen prefix stays home (`RoundContext.frozen`).

        Payloads carry Δ[wire_start:]; `mean_into` and a fused kernel take offsets into that vector. A
        block-quantizing transport rounds down to whole blocks, so the blocks keep the bounds they have
        without a frozen prefix (and every code its bits).
        """
        return ctx.frozen

    def wire_numel(self, ctx: RoundContext) -> int:
        """Parameters on the wire: N - wire_start."""
        return spec_numel(ctx.spec) - self.wire_start(ctx)

    def capped_blocks(self, ctx: RoundContext) -> dict[str, int]:
        """Aggregator side, after `agree`: per site, the blocks whose announcement was capped (none by default)."""
        return {}

    def aggregate(self, ctx: RoundContext, payloads: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
        """Verify every payload and return Δ̄ = Σ_c w_c Δ_c (fp32), deterministically."""
        accepted = self.verify(ctx, payloads)
        out_N = torch.zeros(spec_numel(ctx.spec), dtype=torch.float32)
        self.mean_into(ctx, accepted, 0, out_N[self.wire_start(ctx) :].numpy())
        out_N[: ctx.frozen] = 0.0  # the frozen prefix does not learn, whatever a site put on its shared block
        return unflatten(ctx.spec, out_N)


class PlainFP32(Transport):
    """Full-precision deltas: header + raw little-endian fp32; fp64 accumulation in site order."""

    name = "fp32"

    def encode(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        check_delta(ctx, site, delta)
        header = {"run": ctx.run_id, "round": ctx.round_idx, "site": site, "spec": spec_hash(ctx.spec, ctx.frozen)}
        body = flatten(ctx.spec, delta)[self.wire_start(ctx) :].numpy().astype("<f4").tobytes()
        return pack_header(header) + body

    def verify(self, ctx: RoundContext, payloads: Mapping[str, bytes]) -> Accepted:
        numel = self.wire_numel(ctx)
        unknown = sorted(set(payloads) - set(ctx.site_ids))
        if unknown:
            raise IntegrityError(f"update from {unknown[0]!r}: site is not in the federation {list(ctx.site_ids)}", site=unknown[0])
        missing = sorted(set(ctx.site_ids) - set(payloads))
        if missing:
            raise ParticipantDropped(f"round {ctx.round_idx}: no update from {missing}; rerun the round with the surviving sites")
        bodies = {}
        for site in sorted(payloads):
            header, body = unpack_header(payloads[site], site)
            expected = {"run": ctx.run_id, "round": ctx.round_idx, "site": site, "spec": spec_hash(ctx.spec, ctx.frozen)}
            if header != expected:
                raise IntegrityError(f"update from {site!r} is bound to {header}, expected {expected}", site=site)
            if len(body) != 4 * numel:
                raise IntegrityError(f"update from {site!r} has {len(body)} body bytes, expected {4 * numel}", site=site)
            if not np.isfinite(np.frombuffer(body, dtype="<f4")).all():
                raise IntegrityError(f"update from {site!r} holds NaN or Inf", site=site)
            bodies[site] = body
        return Accepted(bodies)

    def mean_into(self, ctx: RoundContext, accepted: Accepted, start: int, out_n: np.ndarray) -> None:
        stop = start + out_n.shape[0]
        acc_n = np.zeros(out_n.shape[0], dtype=np.float64)
        for site in sorted(accepted.bodies):  # fixed order: fp64 addition is not associative
            x_n = np.frombuffer(accepted.bodies[site], dtype="<f4")[start:stop]
            acc_n += x_n.astype(np.float64) * ctx.weight(site)
        out_n[...] = acc_n  # one fp64 -> fp32 rounding per element
