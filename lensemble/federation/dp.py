"""Site-level differential privacy of the federated update: L2 clipping, Gaussian noise, (ε, δ).

Mechanism, per round: each site clips its pseudo-gradient to L2 norm S over all federated tensors,
Δ'_c = Δ_c · min(1, S / ‖Δ_c‖₂), and adds its share of Gaussian noise before the transport, so that
the weighted sum the aggregator sees is

    Δ̄ = Σ_c w_c Δ'_c + N(0, (z · S · w_max)² I),     w_max = max_c w_c, z the noise multiplier.

Adding or removing one site moves Σ_c w_c Δ'_c by at most w_max · S in L2, so this is the Gaussian
mechanism with noise multiplier z on that sensitivity (weights are fixed before the round and public).
Every site takes part in every round (no subsampling, q = 1), so T rounds compose to RDP
ε(α) = T · α / (2 z²); `epsilon` converts that to (ε, δ) with Opacus' RDP accountant.

The noise is distributed: site c adds N(0, σ_c²) with σ_c = z S w_max / (w_c √C), so the shares of
all C sites sum, after weighting, to the variance above. That holds only if every site adds its share
and none colludes with the aggregator; with `secure_int8` the aggregator never sees an individual
(less noisy) update. Noise is added before int8 quantization, which is post-processing.

In the pipeline (params `dp`, `federate.update_clip_norm`):
- `tasks.train.site_train` clips Δ_c at `update_clip(params)` right after training (dp.clip_norm when
  dp.enabled, else federate.update_clip_norm, else nothing: the Δ tensors are not touched at all) and
  releases `dp/update_norm` (before clipping) and `dp/clipped` with its metrics. These site metrics,
  like the losses, are outside the (ε, δ) guarantee, which covers the update only.
- The noise is added where the round's roster is known: `private_codec` wraps a site's codec so that
  its announcement and its encoding both see Δ'_c + N(0, σ_c²) with σ_c from the attempt's
  RoundContext (a dropout shrinks C, so the survivors' shares grow). The draw is seeded per
  (run seed, round, site) through `noise_seed`, hence reproducible and identical in both messages; a
  sovereign site mixes in a secret of its own (its signing key) so that the aggregator, which knows
  the run seed, cannot regenerate and subtract the noise. One-process (`local`) runs have no such
  secret: every party lives in the coordinator's process there anyway.
- The coordinator records per round `dp/epsilon` and `dp/delta` after rounds 0..r (`round_privacy`),
  `dp/clip_fraction` (sites clipped) and each site's `dp/noise_std`.
"""
from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping

import torch

from lensemble.errors import ConfigError
from lensemble.federation.transport import RoundContext, frozen_tensors
from lensemble.seeds import derive_seed

NOISE_PURPOSE = "dp/noise"

RDP_ORDERS = tuple([1 + x / 10 for x in range(1, 100)] + list(range(11, 256)) + [512, 1024])
"""Rényi orders α the accountant minimises over."""


def l2_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """Global L2 norm over every tensor, accumulated in fp64 in sorted name order (deterministic)."""
    return math.sqrt(sum(float(delta[name].double().square().sum()) for name in sorted(delta)))


def clip_l2(delta: Mapping[str, torch.Tensor], max_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """(Δ · min(1, S / ‖Δ‖₂), ‖Δ‖₂ before clipping); one factor for all tensors keeps directions."""
    if not max_norm > 0:
        raise ConfigError(f"dp.clip_norm must be > 0, got {max_norm}")
    norm = l2_norm(delta)
    factor = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {name: t * factor for name, t in delta.items()}, norm


def site_noise_std(ctx: RoundContext, site: str, noise_multiplier: float, clip_norm: float) -> float:
    """σ_c = z S w_max / (w_c √C): site c's share of the round's noise (module docstring)."""
    if noise_multiplier < 0:
        raise ConfigError(f"dp.noise_multiplier must be >= 0, got {noise_multiplier}")
    w_max = max(ctx.weight(s) for s in ctx.site_ids)
    return noise_multiplier * clip_norm * w_max / (ctx.weight(site) * math.sqrt(len(ctx.site_ids)))


def privatize(
    ctx: RoundContext,
    site: str,
    delta: Mapping[str, torch.Tensor],
    clip_norm: float,
    noise_multiplier: float,
    generator: torch.Generator,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Clip Δ_c and add site c's noise share; returns (Δ_c', scalar metrics for `dp/*`).

    `generator` must be seeded per (run, round, site) and kept secret to the site: the noise is
    what protects the update, so an aggregator that could replay the seed could remove it.
    """
    clipped, norm = clip_l2(delta, clip_norm)
    std = site_noise_std(ctx, site, noise_multiplier, clip_norm)
    frozen = set(frozen_tensors(ctx))  # they do not learn this round: exactly 0, off the wire, no noise to add
    noisy = {
        name: clipped[name] if name in frozen
        else clipped[name] + std * torch.randn(clipped[name].shape, generator=generator, dtype=clipped[name].dtype)
        for name in sorted(clipped)
    }
    metrics = {"dp/update_norm": norm, "dp/clipped": float(norm > clip_norm), "dp/noise_std": std}
    return noisy, metrics


def update_clip(params) -> float | None:
    """The L2 bound site_train clips Δ_c to: dp.clip_norm under DP, else federate.update_clip_norm (None: no clipping)."""
    return params.dp.clip_norm if params.dp.enabled else params.federate.update_clip_norm


def clip_update(delta: Mapping[str, torch.Tensor], max_norm: float | None) -> tuple[Mapping[str, torch.Tensor], dict[str, float]]:
    """(Δ clipped to `max_norm`, {dp/update_norm, dp/clipped}); `max_norm` None returns `delta` itself and no metrics.

    A Δ within the bound is returned as it is (no multiplication by 1.0), so clipping that never binds
    keeps the run bitwise identical to one without it.
    """
    if max_norm is None:
        return delta, {}
    norm = l2_norm(delta)
    metrics = {"dp/update_norm": norm, "dp/clipped": float(norm > max_norm)}
    if norm <= max_norm:
        return dict(delta), metrics
    return clip_l2(delta, max_norm)[0], metrics


def noise_seed(run_seed: int, round_idx: int, site: str, secret: bytes | None = None) -> int:
    """The seed of site c's noise in round r: `derive_seed(run seed, "dp/noise", r, c)`, keyed with the
    site's secret when it has one (HMAC-SHA256, 63 bits) so that only the site can reproduce it."""
    seed = derive_seed(run_seed, NOISE_PURPOSE, round_idx, site)
    if secret is None:
        return seed
    mac = hmac.new(secret, f"lensemble|{NOISE_PURPOSE}|{seed}".encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "big") & ((1 << 63) - 1)


class PrivateCodec:
    """A site codec whose announcement and update carry Δ'_c + N(0, σ_c²) (site c's noise share).

    Wraps any `SiteCodec` (Flower's DP wrappers are the model): the key exchange passes through, and
    `announce` and `encode` both privatize with a generator re-seeded from `noise_seed`, so the two
    messages of one attempt carry the same noisy Δ'_c and a rerun draws the same noise.
    """

    def __init__(self, codec, run_seed: int, clip_norm: float, noise_multiplier: float, secret: bytes | None = None) -> None:
        self.codec, self.run_seed, self.clip_norm, self.noise_multiplier = codec, run_seed, clip_norm, noise_multiplier
        self._secret = secret

    def _private(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(noise_seed(self.run_seed, ctx.round_idx, site, self._secret))
        noisy, _ = privatize(ctx, site, delta, self.clip_norm, self.noise_multiplier, gen)
        return noisy

    def register(self, site: str, public_key) -> None:
        self.codec.register(site, public_key)

    def key_share(self, ctx: RoundContext, site: str) -> bytes:
        return self.codec.key_share(ctx, site)

    def accept_shares(self, ctx: RoundContext, shares):
        return self.codec.accept_shares(ctx, shares)

    def announce(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        return self.codec.announce(ctx, site, self._private(ctx, site, delta))

    def accept_grid(self, ctx: RoundContext, message: bytes) -> None:
        self.codec.accept_grid(ctx, message)

    def encode(self, ctx: RoundContext, site: str, delta: Mapping[str, torch.Tensor]) -> bytes:
        return self.codec.encode(ctx, site, self._private(ctx, site, delta))


def private_codec(codec, params, secret: bytes | None = None):
    """`codec` wrapped in `PrivateCodec` when params enable DP; otherwise `codec` itself."""
    if not params.dp.enabled:
        return codec
    return PrivateCodec(codec, params.run.seed, params.dp.clip_norm, params.dp.noise_multiplier, secret)


def round_privacy(params, ctx: RoundContext, site_metrics: Mapping[str, Mapping[str, float]]) -> dict:
    """The coordinator's `dp/*` figures of a committed round (empty when nothing is clipped):
    {"round": {dp/epsilon, dp/delta, dp/clip_fraction}, "sites": {site: {dp/noise_std}}}.

    ε is of rounds 0..r (every round takes every site, q = 1), so it is the run's ε so far.
    """
    if update_clip(params) is None:
        return {}
    members = ctx.site_ids
    clipped = [float(site_metrics[s].get("dp/clipped", 0.0)) for s in members]
    out = {"round": {"dp/clip_fraction": sum(clipped) / len(members)}, "sites": {}}
    if params.dp.enabled:
        z, s = params.dp.noise_multiplier, params.dp.clip_norm
        out["round"].update({"dp/epsilon": epsilon(z, ctx.round_idx + 1, params.dp.delta), "dp/delta": params.dp.delta})
        out["sites"] = {c: {"dp/noise_std": site_noise_std(ctx, c, z, s)} for c in members}
    return out


def run_privacy(params, history: list[dict]) -> dict:
    """reports/federate.json `dp`: the mechanism and ε after the last committed round ({} when nothing is clipped)."""
    bound = update_clip(params)
    if bound is None:
        return {}
    fractions = [r["dp"]["dp/clip_fraction"] for r in history if "dp" in r]
    out = {"enabled": params.dp.enabled, "clip_norm": bound, "rounds": len(history),
           "clip_fraction_mean": sum(fractions) / len(fractions) if fractions else None}
    if params.dp.enabled:
        out.update(noise_multiplier=params.dp.noise_multiplier, delta=params.dp.delta,
                   epsilon=epsilon(params.dp.noise_multiplier, len(history), params.dp.delta) if history else 0.0)
    return out


def _opacus_rdp():
    """Opacus' RDP analysis module; an optional dependency that only DP runs need."""
    try:
        from opacus.accountants.analysis import rdp
    except ImportError:
        raise ConfigError("dp accounting needs Opacus: pip install opacus (CPU torch is enough)") from None
    return rdp


def rdp_gaussian(noise_multiplier: float, rounds: int, orders: tuple[float, ...] = RDP_ORDERS) -> list[float]:
    """RDP of T rounds of the Gaussian mechanism without subsampling, via Opacus (= T α / (2 z²))."""
    rdp = _opacus_rdp().compute_rdp(q=1.0, noise_multiplier=noise_multiplier, steps=rounds, orders=list(orders))
    return [float(v) for v in rdp]


def epsilon(noise_multiplier: float, rounds: int, delta: float, orders: tuple[float, ...] = RDP_ORDERS) -> float:
    """ε of (ε, δ)-DP after `rounds` rounds at noise multiplier z (Opacus' RDP-to-DP conversion)."""
    if not 0 < delta < 1:
        raise ConfigError(f"dp.delta must be in (0, 1), got {delta}")
    if noise_multiplier <= 0:
        return math.inf
    rdp = rdp_gaussian(noise_multiplier, rounds, orders)
    eps, _ = _opacus_rdp().get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)
