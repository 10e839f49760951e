"""Int8 quantization of a flat fp32 vector with one absmax scale per block.

Scheme (used by the "int8" and "secure_int8" transports):

- The vector x ∈ R^N is cut into nb = ceil(N / block) blocks (the last one zero-padded; padding
  never changes a block's absmax). Block b gets the scale s_b = max|x_b| / 127 (fp32), or s_b = 0
  when max|x_b| < FLUSH_BELOW (the block is flushed to zero: a scale in the fp32 subnormal range
  would lose the relative precision the bound below relies on).
- q_i = clamp(round(x_i / s_b), -127, 127) as int8, round-half-to-even (deterministic), or, with a
  seeded `generator`, stochastic rounding q_i = floor(x_i / s_b + u_i), u_i ~ U[0, 1).
- x̂_i = q_i · s_b.

-128 is never produced, so the grid is symmetric and the negation of a vector quantizes to the
negation of its codes.

Round-trip error bound, per element i in block b (see `roundtrip_bound`):

    |x_i - x̂_i| <= s_b · (1/2 + 2^-15)   round to nearest
    |x_i - x̂_i| <= s_b · (1   + 2^-15)   stochastic rounding
    |x_i - x̂_i| <= FLUSH_BELOW           flushed block (s_b = 0)

The 2^-15 slack covers the fp32 rounding of x_i / s_b, of x_i / s_b + u_i and of q_i · s_b: each is
2^-24 relative to a magnitude of at most 128, so at most 2^-17 · s_b, three of them < 2^-15 · s_b.
The bound holds for any scale s_b >= max|x_b| / 127, which is what a shared grid (the max of several
sites' absmax) gives.

Bias of the mean: stochastic rounding is unbiased, E[x̂_i] = x_i (up to the fp32 rounding of
x_i / s_b + u_i, relative 2^-24). Round to nearest is deterministic but biased: the error of the
mean of n elements is at most max_b s_b / 2 and in the worst case does not shrink with n.

Domain: finite values with |x| <= MAX_ABS (2^100); `scales_from_absmax` raises ValueError above it,
because 127 · s_b could overflow fp32 near its maximum, and no real pseudo-gradient is that large.
"""
from __future__ import annotations

import numpy as np
import torch

QMAX = 127
"""Largest code magnitude; -128 is unused so that the grid is symmetric."""
FLUSH_BELOW = 2.0**-100
"""Blocks whose absmax is below this quantize to zero (scale 0)."""
MAX_ABS = 2.0**100
"""Largest |x| accepted by the quantizer."""
SLACK = 2.0**-15
"""Relative slack in the error bound for fp32 rounding of x / s and q · s."""
DEFAULT_BLOCK = 4096


def num_blocks(numel: int, block: int) -> int:
    """nb = ceil(numel / block); ValueError when the block size is not positive."""
    if block <= 0:
        raise ValueError(f"quantization block must be a positive integer, got {block}")
    return -(-numel // block)


def _blocks(x_N: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh [nb, block] `dtype` copy of a flat vector, the tail zero-padded (callers modify it in place)."""
    nb = num_blocks(x_N.numel(), block)
    out = torch.empty(nb * block, dtype=dtype)
    out[: x_N.numel()] = x_N
    out[x_N.numel() :] = 0
    return out.view(nb, block)


def block_absmax(x_N: torch.Tensor, block: int) -> torch.Tensor:
    """max|x| of every block: [N] fp32 -> [nb] fp32 (+0 for a zero block). What a site announces for a shared grid."""
    if x_N.dim() != 1 or x_N.dtype != torch.float32:
        raise ValueError(f"expected a flat fp32 vector, got shape {tuple(x_N.shape)} dtype {x_N.dtype}")
    if x_N.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    # max(max x, -min x) over views of the full blocks and the tail: no copy and no |x| temporary. For a
    # block of zeros that pair is ±0 in either order and torch's vector and scalar `maximum` break the tie
    # differently, so the result goes through abs: every zero block announces +0 on every machine.
    x_N = x_N.contiguous()
    full = x_N.numel() // block * block
    parts = [x_N[:full].view(-1, block), x_N[full:].view(1, -1)] if full < x_N.numel() else [x_N.view(-1, block)]
    return torch.cat([torch.maximum(p.amax(dim=1), -p.amin(dim=1)) for p in parts if p.numel()]).abs_()


def scales_from_absmax(absmax_B: torch.Tensor) -> torch.Tensor:
    """s_b = absmax_b / 127, or 0 for blocks below FLUSH_BELOW: [nb] fp32 -> [nb] fp32."""
    absmax_B = absmax_B.to(torch.float32)
    if not torch.isfinite(absmax_B).all() or (absmax_B < 0).any():
        raise ValueError("block absmax must be finite and non-negative")
    if absmax_B.numel() and float(absmax_B.max()) > MAX_ABS:
        raise ValueError(f"block absmax {float(absmax_B.max()):.3g} exceeds the quantizer's domain {MAX_ABS:.3g}")
    scales = absmax_B / QMAX
    return torch.where(absmax_B < FLUSH_BELOW, torch.zeros_like(scales), scales)


def robust_absmax(absmax_CB: torch.Tensor, factor: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared grid's absmax, robust to one outlier: [C, nb] fp32 -> ([nb] fp32, [C, nb] bool capped).

    A_b = max_c min(a_{c,b}, cap_b), cap_b = fp32(factor · max(a_(2),b, m)), a_(2),b the second-largest
    a_{c,b} and m the median over blocks of a_(2),b (the products in fp64, rounded once). Every min
    returns one of its inputs, so when no announcement exceeds its cap A_b = max_c a_{c,b} bit for bit;
    factor None is the uncapped max. m is the floor for a block that one site moves alone (the others
    announce 0: proprioception columns only one embodiment has, measured on the default params); without it such
    an honest block would be flushed. One malicious site raises no a_(2),b above the largest honest
    announcement H_b, hence neither m above the median of the H_b. One site alone (C = 1) has nothing to
    compare with: its own absmax, uncapped. `capped` marks the (site, block) announcements above the cap.
    """
    if absmax_CB.dim() != 2 or absmax_CB.dtype != torch.float32:
        raise ValueError(f"expected [C, nb] fp32 announcements, got shape {tuple(absmax_CB.shape)} dtype {absmax_CB.dtype}")
    if absmax_CB.shape[0] < 2 or factor is None:
        return absmax_CB.amax(dim=0), torch.zeros_like(absmax_CB, dtype=torch.bool)
    second_B = absmax_CB.topk(2, dim=0).values[1]
    floor = second_B.median()  # the lower median: one of the announcements
    cap_B = (torch.maximum(second_B, floor).to(torch.float64) * factor).to(torch.float32)
    return torch.minimum(absmax_CB, cap_B).amax(dim=0), absmax_CB > cap_B


def quantize_with_scales(
    x_N: torch.Tensor, scales_B: torch.Tensor, block: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Codes of x on a given grid: [N] fp32, [nb] fp32 -> [N] int8.

    The grid must cover x (scales_B[b] >= max|x_b| / 127 for every block, or 0 for a flushed block);
    a shared grid built from the max of several sites' `block_absmax` does. `generator` switches to
    stochastic rounding (unbiased); without it rounding is to nearest, half to even.
    """
    numel = x_N.numel()
    if scales_B.shape != (num_blocks(numel, block),):
        raise ValueError(f"expected {num_blocks(numel, block)} scales for {numel} values, got {tuple(scales_B.shape)}")
    if numel == 0:
        return torch.zeros(0, dtype=torch.int8)
    s_B1 = scales_B.to(torch.float32)[:, None]
    # A flushed block divides by +inf, which gives ±0 for every finite x: no 0/0, no masking pass.
    y_Bk = _blocks(x_N, block).div_(torch.where(s_B1 > 0, s_B1, torch.full_like(s_B1, float("inf"))))
    if generator is None:
        y_Bk.round_()
    else:
        y_Bk.add_(torch.rand(y_Bk.shape, generator=generator, dtype=torch.float32)).floor_()
    return y_Bk.clamp_(-QMAX, QMAX).to(torch.int8).reshape(-1)[:numel]


def quantize_int8(
    x_N: torch.Tensor, block: int = DEFAULT_BLOCK, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize on x's own grid: [N] fp32 -> ([N] int8 codes, [nb] fp32 scales)."""
    scales_B = scales_from_absmax(block_absmax(x_N, block))
    return quantize_with_scales(x_N, scales_B, block, generator), scales_B


def dequantize_int8(
    q_N: torch.Tensor, scales_B: torch.Tensor, block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x̂ = q · s per block: [N] integer codes, [nb] fp32 scales -> [N] `dtype`.

    Works for any integer codes, including the sum of several sites' codes on a shared grid. With
    dtype=float64 every product q · s of an int8 (or up to 2^29 magnitude) code and an fp32 scale is exact.
    """
    numel = q_N.numel()
    if scales_B.shape != (num_blocks(numel, block),):
        raise ValueError(f"expected {num_blocks(numel, block)} scales for {numel} codes, got {tuple(scales_B.shape)}")
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    return _blocks(q_N, block, dtype).mul_(scales_B.to(dtype)[:, None]).reshape(-1)[:numel]


def dequantize_range(q_n: np.ndarray, scales_B: np.ndarray, start: int, block: int, out_n: np.ndarray) -> np.ndarray:
    """x̂[start : start + n] = q · s into `out_n`: [n] integer codes of that slice, [nb] fp32 scales.

    The aggregator's chunked form of `dequantize_int8`: element i of the slice uses the scale of block
    (start + i) // block, so a slice need not start on a block boundary. Each product is one IEEE
    multiplication in `out_n`'s dtype (the codes convert exactly), so every element has the same bits
    as in `dequantize_int8` with that dtype.
    """
    n = q_n.shape[0]
    pos = 0
    while pos < n:
        b, offset = divmod(start + pos, block)
        if offset == 0 and n - pos >= block:  # a run of whole blocks: one broadcast multiply
            k = (n - pos) // block
            seg = slice(pos, pos + k * block)
            np.multiply(q_n[seg].reshape(k, block), scales_B[b : b + k, None], out=out_n[seg].reshape(k, block), dtype=out_n.dtype)
            pos += k * block
        else:  # the part of one block that lies in the slice
            end = min(n, pos + block - offset)
            np.multiply(q_n[pos:end], scales_B[b], out=out_n[pos:end], dtype=out_n.dtype)
            pos = end
    return out_n


def roundtrip_bound(scales_B: torch.Tensor, numel: int, block: int, stochastic: bool = False) -> torch.Tensor:
    """The documented per-element bound on |x - x̂|: [nb] fp32 -> [N] fp64 (see the module docstring)."""
    factor = (1.0 if stochastic else 0.5) + SLACK
    per_block_B = torch.where(
        scales_B > 0, scales_B.to(torch.float64) * factor, torch.full_like(scales_B, FLUSH_BELOW, dtype=torch.float64)
    )
    return per_block_B.repeat_interleave(block)[:numel]
