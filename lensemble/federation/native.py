"""The native secure_int8 kernels, compiled on first use and loaded with ctypes.

`fused_step.c` is the aggregator's fused sum + outer step; `client_step.c` a site's one pass over its
update (checks, block absmax, quantization on the shared grid, masking; `secure_transport`).

The eager path in `outer` (NumPy + torch, one op at a time) moves every chunk through cache about a
dozen times, and its self-check evaluates each 1 MiB chunk twice; this kernel reads each input from
memory once and evaluates each 4096-element tile twice while it is still in L1/L2. It is an accelerator, never a dependency: with no C
compiler (or `LENSEMBLE_NATIVE=0`) `load()` returns None and the aggregator uses the eager path,
which gives the same bits (tests/test_outer.py checks both against `nesterov_step`, and
tests/test_client_path.py the site's pass against `quantize_with_scales` and `site_mask`).

Build: `cc -O3 -march=native -ffp-contract=off` into `$LENSEMBLE_CACHE` (default
`~/.cache/lensemble`), named by the hash of the sources, the flags and the CPU, written atomically.
`-ffp-contract=off` keeps every rounding torch's eager ops make; `fmaf` is used exactly where torch
fuses `add(alpha)`, which `torch_fuses_alpha` probes at run time (vectorized builds fuse, others
may not).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

TILE = 4096
"""Elements per self-checked tile in `fused_step.c`."""
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("fused_step.c", "client_step.c"))
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("LENSEMBLE_CACHE", Path.home() / ".cache" / "lensemble"))


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it is disabled or cannot be built here."""
    if os.environ.get("LENSEMBLE_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = b"".join(path.read_bytes() for path in _SOURCES)
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_id().encode() + platform.machine().encode())
    target = _cache_dir() / f"lensemble-native-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            command = [compiler, *_FLAGS, "-o", str(built), *map(str, _SOURCES), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                return None
            os.replace(built, target)  # atomic: a concurrent process sees no half-written library
    lib = ctypes.CDLL(str(target))
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
