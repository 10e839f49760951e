"""Int8 block quantization: the documented round-trip bound (property tests), bias, golden codes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lensemble.federation.quant import (
    MAX_ABS, QMAX, block_absmax, dequantize_int8, num_blocks, quantize_int8, quantize_with_scales,
    roundtrip_bound, scales_from_absmax,
)

DISTRIBUTIONS = ("gaussian", "cauchy", "student_t2", "student_t1.5")


def _sample(kind: str, n: int, magnitude: float, seed: int) -> torch.Tensor:
    """n fp32 draws from a light- or heavy-tailed distribution, times `magnitude`."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        x = rng.standard_normal(n)
    elif kind == "cauchy":
        x = rng.standard_cauchy(n)
    else:
        x = rng.standard_t(float(kind.removeprefix("student_t")), n)
    return torch.from_numpy((x * magnitude).astype(np.float32))


def _assert_within_bound(x: torch.Tensor, block: int, stochastic: bool, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed) if stochastic else None
    q, scales = quantize_int8(x, block, generator)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert int(q.abs().max()) <= QMAX
    err = (x.double() - dequantize_int8(q, scales, block).double()).abs()
    bound = roundtrip_bound(scales, x.numel(), block, stochastic)
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"x={x[worst].item()!r} err={err[worst].item()} > bound={bound[worst].item()}"


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(DISTRIBUTIONS),
    n=st.integers(1, 5000),
    block=st.sampled_from([1, 7, 64, 256, 4096]),
    log10_magnitude=st.floats(-25, 25),
    seed=st.integers(0, 2**32 - 1),
    stochastic=st.booleans(),
)
def test_roundtrip_within_bound_gaussian_and_heavy_tailed(kind, n, block, log10_magnitude, seed, stochastic):
    _assert_within_bound(_sample(kind, n, 10.0**log10_magnitude, seed), block, stochastic, seed)


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-MAX_ABS, MAX_ABS, width=32)),
    block=st.sampled_from([1, 3, 16, 128]),
    stochastic=st.booleans(),
)
def test_roundtrip_within_bound_any_float(x, block, stochastic):
    # Subnormals, exact zeros, ties and values near 2^100 are all in this domain.
    _assert_within_bound(torch.from_numpy(x), block, stochastic)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(DISTRIBUTIONS), seed=st.integers(0, 2**32 - 1), widen=st.floats(1.0, 50.0))
def test_bound_holds_on_a_coarser_shared_grid(kind, seed, widen):
    # A shared grid (max of several sites' absmax) is coarser than a site's own; the bound uses its scale.
    x, block = _sample(kind, 1000, 1.0, seed), 64
    scales = scales_from_absmax(block_absmax(x, block) * widen)
    q = quantize_with_scales(x, scales, block)
    err = (x.double() - dequantize_int8(q, scales, block).double()).abs()
    assert bool((err <= roundtrip_bound(scales, x.numel(), block)).all())


def test_golden_codes():
    x = torch.tensor([1.0, -0.3, 0.25, 0.004, 0.0, 2.0, -2.0, 1.0])
    q, scales = quantize_int8(x, block=4)
    assert q.tolist() == [127, -38, 32, 1, 0, 127, -127, 64]
    assert scales.tolist() == [pytest.approx(1 / 127), pytest.approx(2 / 127)]


def test_stochastic_rounding_is_unbiased_and_round_to_nearest_is_deterministic():
    block, reps = 256, 2000
    one_block = _sample("gaussian", block, 1.0, seed=1)
    x = one_block.repeat(reps)  # every block identical, so every block has the same scale
    q, scales = quantize_int8(x, block, torch.Generator().manual_seed(7))
    y = one_block / scales[0]  # the exact codes' expectation
    mean_code = q.double().reshape(reps, block).mean(dim=0)
    # |q - y| < 1, so the std of a mean of 2000 draws is < 0.5 / sqrt(2000) = 0.011; allow 5 sigma.
    assert float((mean_code - y.double()).abs().max()) < 0.056
    assert torch.equal(quantize_int8(x, block)[0], quantize_int8(x, block)[0])


def test_flushed_and_zero_blocks_quantize_to_zero():
    x = torch.tensor([0.0, 0.0, 1e-35, -1e-33, 3.0, 0.0])
    q, scales = quantize_int8(x, block=2)
    assert scales[0] == 0 and scales[1] == 0 and scales[2] > 0
    assert q.tolist() == [0, 0, 0, 0, 127, 0]


def test_sum_of_codes_dequantizes_exactly_in_fp64():
    # The secure transport dequantizes Σ_c q_c once; in fp64 that equals Σ_c dequantize(q_c) exactly.
    xs = [_sample("cauchy", 999, 1.0, seed) for seed in range(5)]
    block = 100
    scales = scales_from_absmax(torch.stack([block_absmax(x, block) for x in xs]).amax(dim=0))
    codes = [quantize_with_scales(x, scales, block) for x in xs]
    summed = dequantize_int8(sum(c.to(torch.int32) for c in codes), scales, block, torch.float64)
    one_by_one = sum(dequantize_int8(c, scales, block, torch.float64) for c in codes)
    assert torch.equal(summed, one_by_one)


def test_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="positive integer"):
        num_blocks(10, 0)
    with pytest.raises(ValueError, match="exceeds the quantizer's domain"):
        quantize_int8(torch.tensor([2.0**101]), 4)
    with pytest.raises(ValueError, match="expected 3 scales"):
        dequantize_int8(torch.zeros(10, dtype=torch.int8), torch.ones(2), 4)
    with pytest.raises(ValueError, match="flat fp32"):
        block_absmax(torch.zeros(2, 2), 4)
