"""SIGReg / Epps–Pulley against closed forms, golden values and the LeJEPA sanity checks."""
from __future__ import annotations

import pytest
import torch

from lensemble.objectives.sigreg import epps_pulley, epps_pulley_closed_form, random_directions, sigreg
from lensemble.seeds import generator


def test_quadrature_agrees_with_the_closed_form_integral():
    gen = torch.Generator().manual_seed(0)
    for x in (torch.randn(300, generator=gen, dtype=torch.float64), torch.rand(300, generator=gen, dtype=torch.float64) * 2 - 1):
        quad = float(epps_pulley(x[:, None], num_knots=1025, t_max=8.0)[0])
        exact = float(epps_pulley_closed_form(x))
        assert quad == pytest.approx(exact, rel=1e-6)
        # the default 17 knots on [0, 3] stays within its quadrature + truncation error
        coarse = float(epps_pulley(x[:, None], num_knots=17, t_max=3.0)[0])
        assert coarse == pytest.approx(exact, rel=0.05, abs=0.01)


def test_golden_value_float64():
    x = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64)[:, None]
    # pinned bit-level golden value of the default quadrature; the exact integral (closed form,
    # 1.0355198596933630) lies within the 17-knot/t_max=3 quadrature error of it
    assert float(epps_pulley(x, 17, 3.0)[0]) == pytest.approx(1.0347854654174529, rel=1e-13)
    assert float(epps_pulley_closed_form(x[:, 0])) == pytest.approx(1.0355198596933630, rel=1e-13)


def test_gaussian_scores_low_collapsed_and_uniform_score_high():
    gen = torch.Generator().manual_seed(1)
    d = 16
    dirs = random_directions(d, 64, gen)
    gauss = torch.randn(2048, d, generator=gen)
    collapsed = torch.randn(2048, 1, generator=gen).expand(-1, d) * 0.01
    uniform = (torch.rand(2048, d, generator=gen) * 2 - 1) * 3**0.5  # unit variance, not Gaussian
    low = float(sigreg(gauss, dirs))
    # E[statistic] under H0 is ∫(1 − e^{−t²}) e^{−t²/2} dt = √(2π) − √(2π/3) ≈ 1.06, whatever n
    assert low == pytest.approx(2.5066 - 1.4472, abs=0.3)
    assert float(sigreg(collapsed, dirs)) > 100 * low
    # random directions average a product-uniform towards Gaussian (CLT); its axes are not
    assert float(sigreg(uniform, torch.eye(d))) > 5 * low


def test_directions_depend_only_on_run_round_step():
    a = random_directions(32, 64, generator(7, "sigreg", 3, step=11))
    b = random_directions(32, 64, generator(7, "sigreg", 3, step=11))
    c = random_directions(32, 64, generator(7, "sigreg", 3, step=12))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(a.norm(dim=0), torch.ones(64))


def test_sigreg_under_bf16_autocast_is_the_fp32_statistic_and_gradient():
    # Without switching autocast off inside, the projection and quadrature ran as bf16 matmuls: the statistic came
    # back bf16 with ~3e-4 relative error and its gradient with ~7e-3 (measured on this input).
    z = torch.randn(256, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    directions = random_directions(64, 32, torch.Generator().manual_seed(1))
    ref = sigreg(z, directions)
    (ref_grad,) = torch.autograd.grad(ref, z)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sigreg(z, directions)
    (grad,) = torch.autograd.grad(out, z)
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert ((grad - ref_grad).norm() / ref_grad.norm()).item() <= 1e-5
    # a bf16 encoder output is scored as its exact fp32 value
    z16 = z.detach().to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sigreg(z16, directions).item() == sigreg(z16.float(), directions).item()



def test_sigreg_runs_on_the_meta_device_the_preflight_counts_flops_on():
    with torch.device("meta"):  # as lensemble.compute.count_step_flops runs it: tensors made inside follow
        out = sigreg(torch.empty(8, 4), torch.empty(4, 2))
    assert out.device.type == "meta" and out.shape == () and out.dtype == torch.float32
