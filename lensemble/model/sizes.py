"""The ViT configurations by name, without torch: params validation (`lensemble.config`) reads them, so a
bad params file is a one-line error before torch is imported (lensemble/model/vit.py builds the encoder).

Configurations follow the ViT paper's family (tiny 192/12/3, small 384/12/6, base 768/12/12,
large 1024/24/16) plus 2-block encoders for CPU runs: `micro` (width 64, the walking skeleton's
default) and `nano32` / `nano16` / `nano8` (widths 32, 16, 8): a world with a few degrees of freedom
spreads its embeddings over a few latent directions, so a narrow latent is the one it keeps well
used (see examples/grid-four-sites.params.yaml).
"""
from __future__ import annotations

from dataclasses import dataclass

from lensemble.errors import ConfigError


@dataclass(frozen=True)
class ViTConfig:
    width: int
    depth: int
    heads: int
    mlp_ratio: float = 4.0


VIT_CONFIGS: dict[str, ViTConfig] = {
    "micro": ViTConfig(64, 2, 4),
    "nano32": ViTConfig(32, 2, 2),
    "nano16": ViTConfig(16, 2, 2),
    "nano8": ViTConfig(8, 2, 2),
    "tiny": ViTConfig(192, 12, 3),
    "small": ViTConfig(384, 12, 6),
    "base": ViTConfig(768, 12, 12),
    "large": ViTConfig(1024, 24, 16),
}


def vit_config(name: str) -> ViTConfig:
    """The named configuration; ConfigError for an unknown name."""
    if name not in VIT_CONFIGS:
        raise ConfigError(f"model.encoder: unknown ViT config {name!r}; known: {sorted(VIT_CONFIGS)}")
    return VIT_CONFIGS[name]
