"""Action-conditioned predictor core g_φ and the local action heads h_ψ^(c).

Shape legend: B batch, T time steps, N tokens per frame, D latent width, W predictor width,
K embodiment action dim, A shared action-embedding width (d_a).

The predictor sees, for each time step t, the N frame tokens of z_t and one action token h(a_t);
its mask is block-causal over time (a token at step t attends to every token of steps ≤ t). The
output at the frame tokens of step t is the prediction ẑ_{t+1}.
"""
from __future__ import annotations

import torch
from torch import nn

from lensemble.model.vit import Block


def block_causal_mask(T: int, tokens_per_step: int) -> torch.Tensor:
    """Boolean [S, S] mask, S = T * tokens_per_step: True where attention is allowed."""
    step_S = torch.arange(T).repeat_interleave(tokens_per_step)
    return step_S[None, :] <= step_S[:, None]


class ActionHead(nn.Module):
    """h_ψ^(c): R^K → R^A. LOCAL to its site (INV-ACTIONHEAD-LOCAL)."""

    def __init__(self, action_dim: int, embed_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(action_dim, embed_dim), nn.GELU(), nn.Linear(embed_dim, embed_dim))

    def forward(self, actions_BTK: torch.Tensor) -> torch.Tensor:
        return self.net(actions_BTK)  # [B, T, A]


class Predictor(nn.Module):
    """g_φ: (z_{≤t}, h(a_{≤t})) → ẑ_{t+1}, FEDERATED."""

    def __init__(self, latent_dim: int, num_tokens: int, action_embed: int, width: int, depth: int, heads: int, max_steps: int = 64) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.inp = nn.Linear(latent_dim, width)
        self.act = nn.Linear(action_embed, width)
        self.space = nn.Parameter(torch.randn(1, 1, num_tokens + 1, width) * 0.02)
        self.time = nn.Parameter(torch.randn(1, max_steps, 1, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, 4.0) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, latent_dim)

    def forward(self, z_BTND: torch.Tensor, act_BTA: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: ẑ_{t+1} for every t; [B, T, N, D]."""
        B, T, N, _ = z_BTND.shape
        x = torch.cat([self.inp(z_BTND), self.act(act_BTA)[:, :, None]], dim=2)  # [B, T, N+1, W]
        x = (x + self.space + self.time[:, :T]).flatten(1, 2)  # [B, T*(N+1), W]
        mask = block_causal_mask(T, N + 1).to(x.device)
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x).reshape(B, T, N + 1, -1)[:, :, :N]
        return self.out(x)


def rollout(predictor: Predictor, z0_BND: torch.Tensor, act_BTA: torch.Tensor) -> torch.Tensor:
    """Autoregressive latent rollout from z_0 under T embedded actions; returns ẑ_1..ẑ_T [B, T, N, D]."""
    z_hist = z0_BND[:, None]  # [B, 1, N, D]
    preds = []
    for t in range(act_BTA.shape[1]):
        z_next = predictor(z_hist, act_BTA[:, : t + 1])[:, -1]  # [B, N, D]
        preds.append(z_next)
        z_hist = torch.cat([z_hist, z_next[:, None]], dim=1)
    return torch.stack(preds, dim=1)
