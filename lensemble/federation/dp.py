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
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from lensemble.errors import ConfigError
from lensemble.federation.transport import RoundContext

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
    noisy = {
        name: clipped[name] + std * torch.randn(clipped[name].shape, generator=generator, dtype=clipped[name].dtype)
        for name in sorted(clipped)
    }
    metrics = {"dp/update_norm": norm, "dp/clipped": float(norm > clip_norm), "dp/noise_std": std}
    return noisy, metrics


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
