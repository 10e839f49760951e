"""ViT encoder f_θ: frames → latent tokens.

Shape legend: B batch, T frames per clip, C channels (3), H/W image side, N tokens per frame
(patches), D latent width.

The configurations by name (micro ... large) live in lensemble/model/sizes.py, which imports no torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lensemble.errors import ConfigError
from lensemble.model.sizes import ViTConfig


class Block(nn.Module):
    """Pre-norm transformer block; `mask` is an additive or boolean attention mask."""

    def __init__(self, width: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        if width % heads:
            raise ConfigError(f"transformer width {width} must be divisible by heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x_BSD: torch.Tensor, mask_SR: torch.Tensor | None = None, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                return_kv: bool = False):
        """The block over S new tokens that also attend to R − S cached ones (keys/values [B, heads, R−S, D/heads]).

        `mask_SR` (True = attend) covers new × (cached + new); None lets every new token see all R.
        With `return_kv`, also the keys/values of all R tokens (the next call's cache). Always called
        through `__call__`, so module hooks (FSDP's unshard) run for cached steps too.
        """
        B, S, D = x_BSD.shape
        qkv = self.qkv(self.norm1(x_BSD)).reshape(B, S, 3, self.heads, D // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, S, D/heads]
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # [B, heads, R, D/heads]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_SR)
        x_BSD = x_BSD + self.proj(attn.transpose(1, 2).reshape(B, S, D))
        out = x_BSD + self.mlp(self.norm2(x_BSD))
        return (out, (k, v)) if return_kv else out


class PatchEmbed(nn.Conv2d):
    """Non-overlapping p×p patches → D-wide tokens: a Conv2d with kernel = stride = p (its weight [D, 3, p, p] and
    state-dict keys), computed as one matmul over the unfolded patches. The same linear map; on the CPU the
    convolution's backward cost 3× the matmul's (fp32, 100 frames of 64×64 at p = 32: 20.5 vs 6.5 ms forward +
    backward, one thread), and it was the step's largest single kernel after the predictor's matmuls."""

    def __init__(self, width: int, patch_size: int) -> None:
        super().__init__(3, width, kernel_size=patch_size, stride=patch_size)
        self.patch_size = patch_size

    def forward(self, frames_BCHW: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] → [B, N, D], tokens in row-major patch order (the convolution's flatten order)."""
        B, C, H, W = frames_BCHW.shape
        p = self.patch_size
        patches = frames_BCHW.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), C * p * p)
        return F.linear(patches, self.weight.flatten(1), self.bias)


class ViTEncoder(nn.Module):
    """Per-frame ViT: patch embedding, learned positions, blocks, final norm."""

    def __init__(self, cfg: ViTConfig, image_size: int, patch_size: int) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ConfigError(f"model.patch_size {patch_size} must divide data.image_size {image_size}")
        self.width = cfg.width
        self.num_tokens = (image_size // patch_size) ** 2
        self.patch = PatchEmbed(cfg.width, patch_size)
        self.pos = nn.Parameter(torch.randn(1, self.num_tokens, cfg.width) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)

    def forward(self, frames_BTCHW: torch.Tensor) -> torch.Tensor:
        """[B, T, 3, H, W] → [B, T, N, D]."""
        B, T = frames_BTCHW.shape[:2]
        x = self.patch(frames_BTCHW.flatten(0, 1)) + self.pos  # [B*T, N, D]
        for block in self.blocks:
            x = block(x)
        return self.norm(x).reshape(B, T, self.num_tokens, self.width)
