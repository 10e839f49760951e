"""Where models train and plan (`run.device`), and the numerical contract there.

- `resolve_device`: `auto` takes the first CUDA GPU when torch sees one, else the CPU; `cuda` without
  one is a ConfigError before any work.
- Precision: bf16 autocast on either device (`train.precision: bf16`) with fp32 master weights (the
  parameters and AdamW state stay fp32); SIGReg, the anchor, the prediction MSEs and the loss sum
  are computed in fp32 whatever the autocast (objectives/), gauge statistics read fp32 copies on the CPU.
- Determinism (`run.deterministic`): on CUDA, `torch.use_deterministic_algorithms(True)`, cuDNN
  deterministic and not benchmarking, and the cuBLAS workspace setting those need
  (`CUBLAS_WORKSPACE_CONFIG=:4096:8`, set before the first cuBLAS call). CPU kernels at a fixed
  thread count are deterministic already.
- Host to device: batches are copied from pinned host memory with `non_blocking=True`, so the copy of
  step t+1's batch overlaps step t's kernels.
- `device_info` is what the RunManifest records: device, name, compute capability, determinism mode.

Aggregation never runs here: sites send CPU fp32 updates (`world_model.federated_state` copies to
the CPU), so the outer step is exact and bitwise whatever device the sites trained on.
"""
from __future__ import annotations

import contextlib
import os

import torch

from lensemble.errors import ConfigError

CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(requested: str) -> torch.device:
    """`auto` | `cpu` | `cuda` → the torch device to use; ConfigError naming the fix when CUDA is asked for and absent."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"run.device is {requested!r}; expected auto, cpu or cuda")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ConfigError(f"run.device is cuda but torch sees no CUDA GPU ({build}): set run.device to auto or cpu, or run on a GPU machine")
    return torch.device("cuda", torch.cuda.current_device())


def configure(device: torch.device, deterministic: bool) -> None:
    """Set the determinism mode for `device` (process-wide; call before the first kernel)."""
    if device.type != "cuda":
        return
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls stay fp32 (bf16 is asked for explicitly)
    torch.backends.cudnn.allow_tf32 = False


def device_info(device: torch.device, deterministic: bool) -> dict:
    """The RunManifest's record of where the stage computed."""
    info = {"type": device.type, "torch": torch.__version__, "deterministic": bool(deterministic)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": round(props.total_memory / 2**30, 1),
                 "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                 "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                 "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    else:
        info |= {"name": "cpu", "threads": torch.get_num_threads()}
    return info


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from pinned memory without blocking the host when `device` is a GPU."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def autocast(precision: str, device_type: str):
    """bf16 autocast on `device_type` when asked; a no-op context for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (the CPU for a model without any, e.g. a planted test model)."""
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device
