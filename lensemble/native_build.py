"""C sources compiled on first use and loaded with ctypes: an accelerator, never a dependency.

`compiled(sources)` builds the sources into one shared library with `cc -O3 -march=native
-ffp-contract=off` into `$LENSEMBLE_CACHE` (default `~/.cache/lensemble`), named by the hash of the
sources, the flags and the CPU, written atomically (a concurrent process sees no half-written library).
It returns None when there is no C compiler, the build fails, or `LENSEMBLE_NATIVE=0`: every caller
then takes its pure-Python or eager path, which gives the same results (their tests check both).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("LENSEMBLE_CACHE", Path.home() / ".cache" / "lensemble"))


def compiled(sources: Sequence[Path], name: str = "lensemble-native") -> ctypes.CDLL | None:
    """The library built from `sources`, or None when native code is disabled or cannot be built here."""
    if os.environ.get("LENSEMBLE_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = b"".join(Path(path).read_bytes() for path in sources)
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_id().encode() + platform.machine().encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            command = [compiler, *FLAGS, "-o", str(built), *map(str, sources), "-lm"]
            if subprocess.run(command, capture_output=True, text=True).returncode != 0:
                return None
            os.replace(built, target)
    return ctypes.CDLL(str(target))
