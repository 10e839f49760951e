"""Gauge diagnostics against scipy and planted rotations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.linalg import orthogonal_procrustes
from scipy.stats import special_ortho_group

from lensemble.gauge import drift, effective_dim, procrustes, rotation_angles_deg, sample_pairs


def test_procrustes_matches_scipy_and_recovers_a_planted_rotation():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((200, 16))
    r_true = special_ortho_group.rvs(16, random_state=1)
    b = a @ r_true + 1e-3 * rng.standard_normal((200, 16))
    r, residual = procrustes(torch.from_numpy(a), torch.from_numpy(b))
    r_scipy, _ = orthogonal_procrustes(a, b)
    np.testing.assert_allclose(r.numpy(), r_scipy, atol=1e-10)
    np.testing.assert_allclose(r.numpy(), r_true, atol=1e-3)
    assert residual < 2e-3


def test_rotation_angles_of_a_planted_plane_rotation():
    theta = 30.0
    r = torch.eye(4, dtype=torch.float64)
    c, s = math.cos(math.radians(theta)), math.sin(math.radians(theta))
    r[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    angles, reflects = rotation_angles_deg(r)
    assert not reflects
    np.testing.assert_allclose(sorted(angles)[-2:], [theta, theta], atol=1e-9)
    np.testing.assert_allclose(sorted(angles)[:2], [0.0, 0.0], atol=1e-9)


def test_reflection_is_flagged_not_read_as_a_half_turn():
    r = torch.diag(torch.tensor([-1.0, 1.0, 1.0], dtype=torch.float64))
    angles, reflects = rotation_angles_deg(r)
    assert reflects
    assert np.allclose(angles, 0.0)


def test_identical_frames_have_zero_drift():
    z = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    d = drift(z, z)
    assert d["drift_angle_deg"] < 1e-5 and d["procrustes_residual"] < 1e-6 and d["reflection"] == 0.0


def test_effective_dim_closed_forms():
    rng = np.random.default_rng(0)
    # isotropic in 8 dims: participation ratio ≈ 8
    z = torch.from_numpy(rng.standard_normal((20000, 8)))
    assert effective_dim(z)["participation_ratio"] == pytest.approx(8.0, rel=0.02)
    assert effective_dim(z)["rankme"] == pytest.approx(8.0, rel=0.02)
    # rank-1 (collapsed): both measures ≈ 1
    z1 = torch.from_numpy(rng.standard_normal((500, 1)) @ rng.standard_normal((1, 8)))
    assert effective_dim(z1)["participation_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert effective_dim(z1)["rankme"] == pytest.approx(1.0, abs=1e-3)


def test_pair_sampling_is_bounded_and_distinct():
    sites = [f"s{i:02d}" for i in range(40)]
    pairs = sample_pairs(sites, 10, np.random.default_rng(0))
    assert len(pairs) == 10 and len(set(pairs)) == 10 and all(a < b for a, b in pairs)
    assert len(sample_pairs(sites[:3], 10, np.random.default_rng(0))) == 3
