"""Warm start: initialise the encoder f_θ from a local checkpoint, before any training; no downloads.

Accepted checkpoints (`torch.load(..., weights_only=True)`):
  - a full WorldModel state dict (`models/centralized.pt`): the `encoder.*` tensors are used;
  - a site state `{"model": <WorldModel state dict>, "optimizer": ...}` (`models/sites/<site>.pt`);
  - an encoder-only state dict (`ViTEncoder.state_dict()`).
Every encoder tensor must be present with the model's shape; otherwise `ConfigError` names the field
(`model.warm_start`), the checkpoint and the first offending tensor, and the model is left untouched.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from lensemble.errors import ConfigError
from lensemble.observability.manifest import file_sha256

FIELD = "model.warm_start"
PREFIX = "encoder."


def load_checkpoint(path: str | Path) -> Mapping[str, torch.Tensor]:
    """The state dict in `path` (unwrapping a site state's "model"); ConfigError if unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{FIELD}: checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch.load raises several types for one cause: not a checkpoint
        raise ConfigError(f"{FIELD}: {path} is not a readable torch checkpoint ({type(exc).__name__})") from None
    if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
        state = state["model"]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{FIELD}: {path} does not hold a state dict of tensors")
    return state


def encoder_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's tensors by their name inside the encoder (prefix `encoder.` stripped if present)."""
    if any(name.startswith(PREFIX) for name in state):
        return {name[len(PREFIX):]: t for name, t in state.items() if name.startswith(PREFIX)}
    return dict(state)


def check_encoder_state(encoder: nn.Module, tensors: Mapping[str, torch.Tensor], source: str | Path) -> None:
    """ConfigError unless `tensors` has exactly the encoder's names, shapes and floating dtypes."""
    expected = encoder.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ConfigError(
            f"{FIELD}: {source} does not match the encoder: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}"
        )
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ConfigError(
                f"{FIELD}: {source}: tensor encoder.{name} has shape {tuple(got.shape)}, "
                f"the configured encoder expects {tuple(want.shape)}"
            )
        if not got.is_floating_point():
            raise ConfigError(f"{FIELD}: {source}: tensor encoder.{name} has dtype {got.dtype}, expected floating point")


def warm_start_encoder(model: nn.Module, checkpoint_path: str | Path) -> dict[str, object]:
    """Copy a checkpoint's encoder weights into `model.encoder` (all checked before any is copied).

    Returns provenance for the RunManifest: path, sha256 of the file, number of tensors loaded.
    """
    tensors = encoder_tensors(load_checkpoint(checkpoint_path))
    check_encoder_state(model.encoder, tensors, checkpoint_path)
    model.encoder.load_state_dict(tensors, strict=True)  # copies, in the model's dtype and device
    return {"path": str(checkpoint_path), "sha256": file_sha256(Path(checkpoint_path)), "tensors": len(tensors)}


def validate_warm_start(params, root: str | Path = ".") -> None:
    """Fail fast: check `params.model.warm_start` against the configured encoder's shapes, loading nothing.

    Builds the model on the meta device, so it is cheap enough to call when params are parsed.
    """
    if params.model.warm_start is None:
        return
    from lensemble.model.sizes import vit_config
    from lensemble.model.vit import ViTEncoder

    with torch.device("meta"):
        encoder = ViTEncoder(vit_config(params.model.encoder), params.data.image_size, params.model.patch_size)
    path = Path(root) / params.model.warm_start
    check_encoder_state(encoder, encoder_tensors(load_checkpoint(path)), path)
