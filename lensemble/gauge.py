"""Gauge diagnostics: frame drift between embedding frames and effective dimension.

SIGReg's isotropic target is rotation-invariant, so two sites' encoders can agree up to an
orthogonal map of the latent space. Orthogonal Procrustes finds that map; its angles say how far
a site's frame has turned, its residual how much is not a rotation at all.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def procrustes(a_ND: torch.Tensor, b_ND: torch.Tensor) -> tuple[torch.Tensor, float]:
    """R = argmin_{RᵀR=I} ‖a R − b‖_F (float64) and the relative residual ‖a R − b‖_F / ‖b‖_F."""
    a = a_ND.to(torch.float64)
    b = b_ND.to(torch.float64)
    u, _, vh = torch.linalg.svd(a.T @ b)
    r = u @ vh
    residual = float(torch.linalg.norm(a @ r - b) / torch.linalg.norm(b).clamp_min(1e-30))
    return r, residual


def rotation_angles_deg(r_DD: torch.Tensor) -> tuple[np.ndarray, bool]:
    """Principal rotation angles in degrees (one per conjugate eigenvalue pair) and whether R reflects.

    A reflection (det R = −1) is reported as such, not folded into an angle: its −1 eigenvalue would
    otherwise read as a 180° turn.
    """
    r = r_DD.to(torch.float64).numpy()
    reflects = bool(np.linalg.det(r) < 0)
    eig = np.linalg.eigvals(r)
    angles = np.degrees(np.abs(np.angle(eig)))
    if reflects:
        # drop one eigenvalue closest to −1: the reflection axis
        angles = np.delete(angles, int(np.argmin(np.abs(eig + 1.0))))
    return np.sort(angles), reflects


def drift(a_ND: torch.Tensor, b_ND: torch.Tensor) -> dict[str, float]:
    """Mean and max rotation angle (degrees), relative residual and reflection flag of a vs b."""
    r, residual = procrustes(a_ND, b_ND)
    angles, reflects = rotation_angles_deg(r)
    return {
        "drift_angle_deg": float(angles.mean()) if angles.size else 0.0,
        "drift_angle_max_deg": float(angles.max()) if angles.size else 0.0,
        "procrustes_residual": residual,
        "reflection": float(reflects),
    }


def effective_dim(z_ND: torch.Tensor) -> dict[str, float]:
    """RankMe (exp entropy of normalised singular values) and participation ratio of the covariance."""
    z = z_ND.to(torch.float64)
    z = z - z.mean(0, keepdim=True)
    s = torch.linalg.svdvals(z)
    p = s / s.sum().clamp_min(1e-30)
    p = p[p > 0]
    rankme = float(torch.exp(-(p * torch.log(p)).sum()))
    lam = s * s
    pr = float(lam.sum() ** 2 / (lam * lam).sum().clamp_min(1e-30))
    return {"rankme": rankme, "participation_ratio": pr}


def collapse_tripwire(federated: list[float], pooled: list[float], drop_fraction: float) -> bool:
    """True when any round's federated effective dimension falls below (1 − drop_fraction) × the pooled model's
    at the same point of training: collapse is read against what the pooled data supports, not against round 1
    (a run that starts collapsed and partly recovers would never trip a round-1 reference)."""
    if len(federated) != len(pooled):
        raise ValueError(f"{len(federated)} federated rounds but {len(pooled)} pooled checkpoints")
    return any(f < (1.0 - drop_fraction) * p for f, p in zip(federated, pooled))


def sample_pairs(sites: list[str], num_pairs: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """A fixed-size sample of distinct site pairs (never all O(C²) when C is large)."""
    all_pairs = [(a, b) for i, a in enumerate(sites) for b in sites[i + 1 :]]
    if len(all_pairs) <= num_pairs:
        return all_pairs
    idx = rng.choice(len(all_pairs), size=num_pairs, replace=False)
    return [all_pairs[i] for i in sorted(idx)]


def pool_tokens(z_PND: torch.Tensor) -> torch.Tensor:
    """Per-frame embedding for the diagnostics: the mean over tokens, [P, D]."""
    return z_PND.mean(1)


def angle_between_deg(u: torch.Tensor, v: torch.Tensor) -> float:
    """Angle between two vectors in degrees (for tests and reports)."""
    c = float(torch.dot(u, v) / (u.norm() * v.norm()))
    return math.degrees(math.acos(max(-1.0, min(1.0, c))))
