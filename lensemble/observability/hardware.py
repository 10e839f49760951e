"""Hardware string and hardware class: budgets compare only within a class."""
from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, or platform.processor()."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def memory_gib() -> float:
    """Physical memory in GiB."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def hardware_string() -> str:
    """Everything that moves a throughput figure, on one line."""
    cores = os.cpu_count() or 0
    parts = [f"cpu={cpu_model()}", f"cores={cores}", f"mem={memory_gib():.0f}GiB"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        parts.append(f"gpu={torch.cuda.get_device_name(0)}x{n}")
    return "; ".join(parts)


def hardware_class(override: str = "auto") -> str:
    """`cpu-<cores>c` or `gpu-<name>x<count>`; `override` wins unless it is 'auto'."""
    if override != "auto":
        return override
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").split()[0]
        return f"gpu-{name}x{torch.cuda.device_count()}"
    return f"cpu-{os.cpu_count() or 0}c"
