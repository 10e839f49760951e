"""One DiLoCo round, written once: the exchange between the sites and the aggregator, and the outer step.

`run_round` drives a round over declared roles, whatever runs them:

- `SiteCodec`: one site's side of the wire (key share, roster, announcement, grid, encoded update).
  It holds that site's signing key only and its peers' public keys.
- `AggregatorCodec`: the aggregator's side (accept key shares, agree on the grid, verify, average).
  It holds public keys only.
- `SitePool`: where the sites' steps run and how their messages come back: in this process
  (`InlineSites`), as Prefect tasks on threads or Dask, or at sovereign sites behind an exchange
  (the orchestration package). Each step returns what arrived and, per site, why nothing did.
- `OuterStep`: the verified average and the outer Nesterov step (`NesterovStep`, or a task around it).

Per attempt: the pool's public keys are registered with the aggregator; every site sends a key share,
the aggregator accepts them; every site takes the roster and announces; the aggregator agrees and
sends its grid; every site encodes; the outer step verifies and averages. A site that fails a step
(raise, timeout) or whose message does not verify (an `IntegrityError` naming it in `.site`) is
dropped and the attempt is redone with the survivors (`drop_policy="continue"`), or the round
aborts (`"abort"`); nothing of a dropped site is ever half-applied, because the parameters change
only when a whole attempt held. An attempt that fails a check naming no site (`AttemptAborted`: an
unmasked sum out of range, a copied key share; under masking the culprit is not identifiable) is
recorded (`RoundResult.aborts`, a warning in the log) and redone once with fresh keys and the same
sites; a second one, or the first under `"abort"`, fails the round with an IntegrityError and the
federation stops (INV-BOUNDED-INFLUENCE). Flower's strategy design is the model: one loop, variants differ
in the pool and the outer step they plug in.

The `Transport` classes (transport.py, secure_transport.py) implement both codec halves, since the
two sides share one wire format; in a federation every instance plays one role (`site_codec`,
`aggregator_codec` in transports.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from lensemble.errors import IntegrityError, ParticipantDropped
from lensemble.federation.outer import aggregate_and_step
from lensemble.federation.transport import Accepted, AttemptAborted, FusedKernel, ParamSpec, RoundContext

State = dict[str, torch.Tensor]
Failures = dict[str, str]
"""site -> why its step did not come back ("<ExceptionType>: message")."""
MAX_ABORTS = 1
"""Aborted attempts (`AttemptAborted`) a round redoes before it fails: one retry with fresh keys."""
_log = logging.getLogger("lensemble.rounds")


@runtime_checkable
class SiteCodec(Protocol):
    """One site's side of the wire; holds only that site's signing key."""

    def key_share(self, ctx: RoundContext, site: str) -> bytes: ...
    def accept_shares(self, ctx: RoundContext, shares: Mapping[str, bytes]) -> Mapping[str, int]: ...
    def announce(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes: ...
    def accept_grid(self, ctx: RoundContext, message: bytes) -> None: ...
    def encode(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes: ...


@runtime_checkable
class AggregatorCodec(Protocol):
    """The aggregator's side of the wire; holds public keys only."""

    def register(self, site: str, public_key) -> None: ...
    def accept_shares(self, ctx: RoundContext, shares: Mapping[str, bytes]) -> Mapping[str, int]: ...
    def agree(self, ctx: RoundContext, announcements: Mapping[str, bytes]) -> None: ...
    def grid_message(self, ctx: RoundContext) -> bytes: ...
    def verify(self, ctx: RoundContext, payloads: Mapping[str, bytes]) -> Accepted: ...
    def mean_into(self, ctx: RoundContext, accepted: Accepted, start: int, out_n: np.ndarray) -> None: ...
    def fused_kernel(self, ctx: RoundContext, accepted: Accepted, lr: float, momentum: float) -> FusedKernel | None: ...
    def wire_start(self, ctx: RoundContext) -> int: ...
    def capped_blocks(self, ctx: RoundContext) -> Mapping[str, int]: ...


class SitePool(Protocol):
    """Where the sites' steps run. Each step returns ({site: result}, {site: why it failed})."""

    work_seconds: float
    """The sites' own exchange work on the round's critical path so far (0 where it runs remotely)."""

    def train(self, round_idx: int, sites: Sequence[str], global_state: State, probe: torch.Tensor,
              global_probe: torch.Tensor) -> tuple[dict, Failures]: ...
    def public_keys(self, sites: Sequence[str]) -> tuple[dict, Failures]: ...
    def key_shares(self, ctx: RoundContext) -> tuple[dict[str, bytes], Failures]: ...
    def announce(self, ctx: RoundContext, shares: Mapping[str, bytes]) -> tuple[dict[str, bytes], Failures]: ...
    def encode(self, ctx: RoundContext, grid: bytes) -> tuple[dict[str, tuple[bytes, float | None]], Failures]: ...
    def next_attempt(self) -> None: ...
    def close(self, round_idx: int, sites: Sequence[str]) -> None: ...
    def finish(self) -> None: ...


class OuterStep(Protocol):
    """Verify the payloads, average, step: (params, momentum, seconds)."""

    def __call__(self, ctx: RoundContext, aggregator: AggregatorCodec, payloads: Mapping[str, bytes], params: State,
                 momentum: State | None) -> tuple[State, State, float]: ...


@dataclass(frozen=True)
class NesterovStep:
    """DiLoCo's outer step: the fused, self-checked average + Nesterov step (outer.py)."""

    lr: float
    momentum: float

    def __call__(self, ctx: RoundContext, aggregator: AggregatorCodec, payloads: Mapping[str, bytes], params: State,
                 momentum: State | None) -> tuple[State, State, float]:
        t0 = time.perf_counter()
        new_params, new_buf = aggregate_and_step(ctx, aggregator, payloads, params, momentum, self.lr, self.momentum)
        return new_params, new_buf, time.perf_counter() - t0


@dataclass(frozen=True)
class RoundResult:
    """A committed round: the attempt that held, the new global state, and what each site sent."""

    ctx: RoundContext
    params: State
    momentum: State
    setup_bytes: Mapping[str, int]
    announcement_bytes: Mapping[str, int]
    payload_bytes: Mapping[str, int]
    encode_seconds: Mapping[str, float | None]
    outer_seconds: float
    dropped: Mapping[str, str] = field(default_factory=dict)
    aborts: tuple[str, ...] = ()
    """Why each aborted attempt of this round was redone (AttemptAborted messages)."""
    capped: Mapping[str, int] = field(default_factory=dict)
    """Per site, the blocks whose announced absmax the grid agreement capped (its values saturated there)."""

    @property
    def members(self) -> tuple[str, ...]:
        return self.ctx.site_ids

    def comm_bytes(self, site: str) -> int:
        """Everything `site` put on the wire this round: key material, announcement, update."""
        return self.setup_bytes[site] + self.announcement_bytes[site] + self.payload_bytes[site]


def _attempt(ctx: RoundContext, sites: SitePool, aggregator: AggregatorCodec, params: State, momentum: State | None,
             outer: OuterStep) -> tuple[RoundResult | None, Failures]:
    """One attempt of the exchange and the outer step; (result, {}) or (None, the sites that failed)."""
    keys, failed = sites.public_keys(ctx.site_ids)
    if failed:
        return None, failed
    for site in ctx.site_ids:
        aggregator.register(site, keys[site])
    shares, failed = sites.key_shares(ctx)
    if failed:
        return None, failed
    setup = aggregator.accept_shares(ctx, shares)
    announcements, failed = sites.announce(ctx, shares)
    if failed:
        return None, failed
    aggregator.agree(ctx, announcements)
    encoded, failed = sites.encode(ctx, aggregator.grid_message(ctx))
    if failed:
        return None, failed
    payloads = {site: encoded[site][0] for site in ctx.site_ids}
    new_params, new_momentum, seconds = outer(ctx, aggregator, payloads, params, momentum)
    return RoundResult(ctx, new_params, new_momentum, dict(setup), {s: len(a) for s, a in announcements.items()},
                       {s: len(p) for s, p in payloads.items()}, {s: encoded[s][1] for s in ctx.site_ids}, seconds,
                       capped=dict(aggregator.capped_blocks(ctx))), {}


def run_round(run_id: str, round_idx: int, survivors: Sequence[str], spec: ParamSpec, sites: SitePool, aggregator: AggregatorCodec,
              params: State, momentum: State | None, outer: OuterStep, drop_policy: str = "continue", frozen: int = 0) -> RoundResult:
    """The exchange and the outer step of one round, redone with the survivors until an attempt holds.

    `frozen`: the round's frozen prefix (`RoundContext.frozen`, `schedule.round_frozen_prefix`).

    ParticipantDropped when every site dropped, or at the first failure under `drop_policy="abort"`;
    IntegrityError after MAX_ABORTS + 1 aborted attempts (the first under `"abort"`); an IntegrityError
    that names no site of the round propagates.
    """
    dropped: Failures = {}
    aborts: list[str] = []
    survivors = sorted(survivors)
    while True:
        if not survivors:
            raise ParticipantDropped(f"round {round_idx}: every site dropped: {dropped}")
        ctx = RoundContext(run_id, round_idx, tuple(survivors), spec, frozen=frozen)
        try:
            result, failed = _attempt(ctx, sites, aggregator, params, momentum, outer)
        except AttemptAborted as exc:
            aborts.append(str(exc))
            _log.warning("round %d: attempt aborted, nothing applied (%d of %d allowed): %s", round_idx, len(aborts),
                         MAX_ABORTS, exc)
            if drop_policy == "abort" or len(aborts) > MAX_ABORTS:
                raise IntegrityError(f"round {round_idx}: {len(aborts)} attempt(s) aborted by a check that names no site;"
                                     f" the federation stops (find the corrupt site out of band): {exc}") from exc
            sites.next_attempt()
            continue
        except IntegrityError as exc:
            if exc.site not in survivors:
                raise
            result, failed = None, {exc.site: f"IntegrityError: {exc}"}
        if result is not None:
            return RoundResult(**{**vars(result), "dropped": dropped, "aborts": tuple(aborts)})
        if drop_policy == "abort":
            raise ParticipantDropped(f"round {round_idx}: sites failed {failed}; federate.drop_policy is abort")
        dropped.update(failed)
        survivors = [s for s in survivors if s not in failed]
        sites.next_attempt()


class SiteEndpoint:
    """One site's side of the exchange, run in this process: its codec (holding only its own signing key),
    its Δ_c and the residency guard its messages leave through (`release`)."""

    def __init__(self, site: str, codec: SiteCodec, delta: Callable[[], Mapping[str, torch.Tensor]],
                 release: Callable[[bytes], bytes] = bytes, public_key=None) -> None:
        self.site, self.codec, self._delta, self._release, self.public_key = site, codec, delta, release, public_key

    def key_share(self, ctx: RoundContext) -> bytes:
        return self._release(self.codec.key_share(ctx, self.site))

    def announce(self, ctx: RoundContext, shares: Mapping[str, bytes]) -> bytes:
        """Take the roster (every accepted key share), then announce."""
        self.codec.accept_shares(ctx, shares)
        return self._release(self.codec.announce(ctx, self.site, self._delta()))

    def encode(self, ctx: RoundContext, grid: bytes) -> tuple[bytes, float]:
        """Take the aggregator's grid, then encode: (payload, seconds of the encoding itself)."""
        self.codec.accept_grid(ctx, grid)
        delta = self._delta()
        t0 = time.perf_counter()
        payload = self.codec.encode(ctx, self.site, delta)
        seconds = time.perf_counter() - t0
        return self._release(payload), seconds


def each_site(sites: Sequence[str], step: Callable[[str], object]) -> tuple[dict, Failures]:
    """`step(site)` for each site in this process; a raise is that site's failure, like a failed task."""
    ok, failed = {}, {}
    for site in sites:
        try:
            ok[site] = step(site)
        except Exception as exc:  # a site's failure is a dropout, recorded with its reason
            failed[site] = f"{type(exc).__name__}: {exc}"
    return ok, failed


class InlineSites:
    """A SitePool whose sites run in this process: exchange steps through their endpoints, training
    through `train` (round, site, global state, probe, global probe) -> the site's training result."""

    def __init__(self, endpoints: Mapping[str, SiteEndpoint],
                 train: Callable[[int, str, State, torch.Tensor, torch.Tensor], dict] | None = None) -> None:
        self.endpoints = dict(endpoints)
        self._train = train
        self.work_seconds = 0.0

    def train(self, round_idx: int, sites: Sequence[str], global_state: State, probe: torch.Tensor,
              global_probe: torch.Tensor) -> tuple[dict, Failures]:
        if self._train is None:
            raise ValueError("InlineSites: no training step was given")
        return each_site(sites, lambda s: self._train(round_idx, s, global_state, probe, global_probe))

    def public_keys(self, sites: Sequence[str]) -> tuple[dict, Failures]:
        return each_site(sites, lambda s: self.endpoints[s].public_key)

    def _timed(self, sites: Sequence[str], step: Callable[[str], object]) -> tuple[dict, Failures]:
        """Run a step at every site; the slowest site's seconds join the critical path."""
        seconds: dict[str, float] = {}

        def timed(site: str):
            t0 = time.perf_counter()
            out = step(site)
            seconds[site] = time.perf_counter() - t0
            return out

        ok, failed = each_site(sites, timed)
        self.work_seconds += max((seconds[s] for s in ok), default=0.0)
        return ok, failed

    def key_shares(self, ctx: RoundContext) -> tuple[dict[str, bytes], Failures]:
        return self._timed(ctx.site_ids, lambda s: self.endpoints[s].key_share(ctx))

    def announce(self, ctx: RoundContext, shares: Mapping[str, bytes]) -> tuple[dict[str, bytes], Failures]:
        return self._timed(ctx.site_ids, lambda s: self.endpoints[s].announce(ctx, shares))

    def encode(self, ctx: RoundContext, grid: bytes) -> tuple[dict[str, tuple[bytes, float | None]], Failures]:
        return self._timed(ctx.site_ids, lambda s: self.endpoints[s].encode(ctx, grid))

    def next_attempt(self) -> None:
        pass

    def close(self, round_idx: int, sites: Sequence[str]) -> None:
        self.work_seconds = 0.0

    def finish(self) -> None:
        pass
