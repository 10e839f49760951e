"""Site-level DP: clipping, the noise shares, and the accountant against the closed form."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lensemble.errors import ConfigError
from lensemble.federation import dp
from lensemble.federation.transport import RoundContext

import opacus  # noqa: E402,F401  (a dev dependency: the accountant must be tested, never skipped)

SPEC = (("enc.w", (300, 100)), ("pred.b", (50,)))
CTX = RoundContext("run", 0, ("a", "b", "c"), SPEC, {"a": 0.5, "b": 0.3, "c": 0.2})


def test_clipping_scales_all_tensors_by_one_factor():
    g = torch.Generator().manual_seed(0)
    delta = {name: torch.randn(shape, generator=g) for name, shape in SPEC}
    clipped, norm = dp.clip_l2(delta, 2.0)
    assert norm == pytest.approx(dp.l2_norm(delta)) and dp.l2_norm(clipped) == pytest.approx(2.0, rel=1e-6)
    assert torch.allclose(clipped["pred.b"] / delta["pred.b"], torch.full((50,), 2.0 / norm))
    same, _ = dp.clip_l2(delta, 10 * norm)
    assert all(torch.equal(same[n], delta[n]) for n in delta)
    with pytest.raises(ConfigError, match="clip_norm"):
        dp.clip_l2(delta, 0.0)


def test_noise_shares_sum_to_the_mechanism_variance():
    z, s = 1.3, 0.7
    total = sum((CTX.weight(c) * dp.site_noise_std(CTX, c, z, s)) ** 2 for c in CTX.site_ids)
    assert total == pytest.approx((z * s * 0.5) ** 2, rel=1e-12)


def test_privatize_adds_noise_of_the_stated_std():
    delta = {name: torch.zeros(shape) for name, shape in SPEC}
    noisy, metrics = dp.privatize(CTX, "c", delta, 1.0, 0.8, torch.Generator().manual_seed(3))
    sample = torch.cat([t.reshape(-1) for t in noisy.values()])
    assert float(sample.std()) == pytest.approx(metrics["dp/noise_std"], rel=0.02)  # 30050 draws
    assert metrics["dp/clipped"] == 0.0 and metrics["dp/update_norm"] == 0.0


def test_accountant_matches_the_closed_form():
    z, rounds, delta = 1.1, 40, 1e-5
    orders = np.array(dp.RDP_ORDERS)
    assert np.allclose(dp.rdp_gaussian(z, rounds), rounds * orders / (2 * z**2), rtol=1e-12)
    # Balle et al. 2020, Theorem 21: the conversion Opacus implements.
    rdp = rounds * orders / (2 * z**2)
    closed = np.min(rdp - (math.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders))
    assert dp.epsilon(z, rounds, delta) == pytest.approx(float(closed), rel=1e-12)
    assert dp.epsilon(2 * z, rounds, delta) < dp.epsilon(z, rounds, delta) < dp.epsilon(z, 2 * rounds, delta)
    assert dp.epsilon(0.0, rounds, delta) == math.inf
    with pytest.raises(ConfigError, match="dp.delta"):
        dp.epsilon(z, rounds, 0.0)
