"""The native secure_int8 kernels, compiled on first use and loaded with ctypes.

`fused_step.c` is the aggregator's fused sum + outer step; `client_step.c` a site's one pass over its
update (checks, block absmax, quantization on the shared grid, masking; `secure_transport`).

The eager path in `outer` (NumPy + torch, one op at a time) moves every chunk through cache about a
dozen times, and its self-check evaluates each 1 MiB chunk twice; this kernel reads each input from
memory once and evaluates each 4096-element tile twice while it is still in L1/L2. It is an accelerator, never a dependency: with no C
compiler (or `LENSEMBLE_NATIVE=0`) `load()` returns None and the aggregator uses the eager path,
which gives the same bits (tests/test_outer.py checks both against `nesterov_step`, and
tests/test_client_path.py the site's pass against `quantize_with_scales` and `site_mask`).

Build: `lensemble.native_build.compiled` (`cc -O3 -march=native -ffp-contract=off`, cached by the hash of
the sources, the flags and the CPU).
`-ffp-contract=off` keeps every rounding torch's eager ops make; `fmaf` is used exactly where torch
fuses `add(alpha)`, which `torch_fuses_alpha` probes at run time (vectorized builds fuse, others
may not).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lensemble.native_build import compiled

TILE = 4096
"""Elements per self-checked tile in `fused_step.c`."""
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("fused_step.c", "client_step.c"))


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it is disabled or cannot be built here."""
    lib = compiled(_SOURCES)
    if lib is None:
        return None
    lib.lens_secure16_step.restype = ctypes.c_int64
    lib.lens_secure16_step.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int32,
        ctypes.c_void_p, ctypes.c_void_p,
    ]
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.lens_weighted_absmax.restype = i64
    lib.lens_weighted_absmax.argtypes = [ptr, i64, i64, f32, i64, f32, ptr]
    lib.lens_quantize_mask.restype = i64
    lib.lens_quantize_mask.argtypes = [
        ptr, i64, i64, f32, i64, ptr, ptr, f32, ctypes.POINTER(ctypes.c_void_p), ptr, ctypes.c_int32, ctypes.c_int32, ptr,
    ]
    return lib


@functools.cache
def torch_fuses_alpha() -> bool:
    """Whether torch's fp32 `add(a, b, alpha)` rounds once (a fused multiply-add) on this machine.

    Probed where one and two roundings differ: b = alpha = 1 + 2^-23, so alpha·b = 1 + 2^-22 + 2^-46,
    and a = -(1 + 2^-22): fused gives 2^-46, rounding the product first gives 0. 67 elements cover
    torch's vector loop and its tail.
    """
    x = 1.0 + 2.0**-23
    a, b = torch.full((67,), -(1.0 + 2.0**-22)), torch.full((67,), x)
    out = torch.add(a, b, alpha=x)
    fused = bool((out == 2.0**-46).all())
    if not fused and not bool((out == 0.0).all()):
        raise RuntimeError("torch's add(alpha) rounds inconsistently across its vector and tail loops")
    return fused
