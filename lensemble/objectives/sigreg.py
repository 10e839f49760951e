"""SIGReg (LeJEPA): sketched isotropic-Gaussian regularisation by the Epps–Pulley statistic.

For embeddings x ∈ R^{n×D}: project on M random unit directions u_m, and on each 1-D projection
compute n · ∫_ℝ |φ_n(t) − e^{−t²/2}|² e^{−t²/2} dt, where φ_n is the empirical characteristic
function. The integrand is even in t, so the integral is 2·∫_0^{t_max}, taken by the trapezoid rule
on `num_knots` points: weights dt at the ends and 2·dt inside (the factor 2 folds in the symmetry),
times e^{−t²/2}. SIGReg is the mean over directions.
"""
from __future__ import annotations

import contextlib
import math

import torch


def epps_pulley_weights(num_knots: int, t_max: float, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Knots t [K], target characteristic function e^{−t²/2} [K], quadrature weights [K]."""
    t = torch.linspace(0.0, t_max, num_knots, dtype=dtype)
    dt = t_max / (num_knots - 1)
    w = torch.full((num_knots,), 2.0 * dt, dtype=dtype)
    w[0] = w[-1] = dt
    phi = torch.exp(-0.5 * t * t)
    return t, phi, w * phi


def epps_pulley(x_NM: torch.Tensor, num_knots: int = 17, t_max: float = 3.0) -> torch.Tensor:
    """Epps–Pulley statistic of each column of x [N, M] against N(0,1); returns [M]. Accumulates in fp32 or wider."""
    dtype = torch.float64 if x_NM.dtype == torch.float64 else torch.float32
    x = x_NM.to(dtype)
    t, phi, weights = epps_pulley_weights(num_knots, t_max, dtype)
    xt = x[..., None] * t  # [N, M, K]
    cos_mean = torch.cos(xt).mean(0)  # [M, K]
    sin_mean = torch.sin(xt).mean(0)
    err = (cos_mean - phi).square() + sin_mean.square()
    return (err @ weights) * x.shape[0]


def epps_pulley_closed_form(x_N: torch.Tensor) -> torch.Tensor:
    """n · ∫_ℝ |φ_n(t) − e^{−t²/2}|² e^{−t²/2} dt exactly (float64), for one 1-D sample.

    Uses ∫ cos(tu) e^{−a t²} dt = √(π/a) e^{−u²/(4a)} on the three terms of the squared modulus.
    """
    x = x_N.to(torch.float64)
    n = x.shape[0]
    diff = x[:, None] - x[None, :]
    cross = math.sqrt(2 * math.pi) * torch.exp(-0.5 * diff * diff).sum() / n**2
    mixed = 2 * math.sqrt(math.pi) * torch.exp(-0.25 * x * x).sum() / n
    const = math.sqrt(2 * math.pi / 3)
    return n * (cross - mixed + const)


def random_directions(dim: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """[dim, num] unit directions from a seeded generator (same on every site for the same seed)."""
    u = torch.randn(dim, num, generator=gen)
    return u / u.norm(dim=0, keepdim=True)


def sigreg(z_ND: torch.Tensor, directions_DM: torch.Tensor, num_knots: int = 17, t_max: float = 3.0) -> torch.Tensor:
    """Mean Epps–Pulley statistic of z projected on the given directions, in fp32 whatever the autocast.

    Under bf16 autocast the projection and the quadrature (`@`) would otherwise run as bf16 matmuls despite
    the fp32 casts (autocast recasts matmul inputs), and the statistic and its gradient would come back in
    bf16 (~3e-4 and ~7e-3 relative error); autocast is switched off here, so both are the fp32 reference's.
    """
    device = z_ND.device.type  # "meta" (the pre-flight's FLOP count) has no autocast to switch off
    with torch.autocast(device_type=device, enabled=False) if device in ("cpu", "cuda") else contextlib.nullcontext():
        proj = z_ND.to(torch.float32) @ directions_DM.to(torch.float32)  # [N, M]
        return epps_pulley(proj, num_knots, t_max).mean()
