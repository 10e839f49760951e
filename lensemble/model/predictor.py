"""Action-conditioned predictor core g_φ and the local action heads h_ψ^(c).

Shape legend: B batch, T time steps, C context steps, N tokens per frame, D latent width, W predictor
width, K embodiment action dim, A shared action-embedding width (d_a), Q proprioception width (the
federation's padded `model.proprio_dim`).

For each time step t the predictor sees N frame tokens of z_t, one proprioception token (q_t through
the federated proprio encoder) and one action token h(a_t); its mask is block-causal over time (a
token at step t attends to every token of steps ≤ t). The action also conditions every frame and
proprioception token of its step directly (a projection of h(a_t) added to each, as DINO-WM pairs the
action embedding with every patch): with the action token alone a frame token sees the action only
through attention, and the predictor learned to move the proprioception but hardly the frame latent
(latent action sensitivity 1.45 without, 1.68 with; point mass, 600 steps). The outputs at step t's frame tokens are the
prediction ẑ_{t+1}; the output at its proprioception token, through the proprio decoder, is q̂_{t+1}.
Proprioception enters normalised (divided by the embodiment's `proprio_scale`) and zero-padded to Q;
the loss reads only the embodiment's own components.
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


class ProprioAdapter(nn.Module):
    """a_ψ^(c): the embodiment's proprioception frame ↔ the federation's shared one, LOCAL like the action head.

    A robot that joins after the federation records proprioception whose components mean something
    else than those the federated proprio encoder was trained on (dm_control's reacher puts the
    fingertip-to-target vector at components 4-5, our reacher at 9-10). The adapter maps q into the
    shared frame before the predictor (`inp`, affine) and the predictor's change back into the
    embodiment's frame (`out`, linear): q̂_{t+1} = q_t + out(q̂'_{t+1} − inp(q_t)), masked to the embodiment's
    `valid` components. Identity at initialisation (an adapter that learnt nothing changes nothing),
    and the copy ("nothing moves") stays the residual's starting point whatever it learns.
    """

    def __init__(self, width: int, valid: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.out = nn.Linear(width, width, bias=False)  # a map of changes: no change in, none out
        nn.init.eye_(self.inp.weight)
        nn.init.zeros_(self.inp.bias)
        nn.init.eye_(self.out.weight)
        self.register_buffer("valid_Q", (torch.arange(width) < valid).float(), persistent=False)


class AdaptedPredictor(nn.Module):
    """g_φ seen through an embodiment's proprio adapter: the same call and cache as `Predictor`, in the embodiment's frame."""

    def __init__(self, predictor: Predictor, adapter: ProprioAdapter) -> None:
        super().__init__()
        self.predictor, self.adapter = predictor, adapter

    def forward(self, z_BTND: torch.Tensor, q_BTQ: torch.Tensor, act_BTA: torch.Tensor, cache: KVCache | None = None,
                return_cache: bool = False):
        shared_BTQ = self.adapter.inp(q_BTQ)
        out = self.predictor(z_BTND, shared_BTQ, act_BTA, cache, return_cache)
        q_next = q_BTQ + self.adapter.out(out[1] - shared_BTQ) * self.adapter.valid_Q
        return (out[0], q_next, *out[2:])


class Predictor(nn.Module):
    """g_φ: (z_{≤t}, q_{≤t}, h(a_{≤t})) → (ẑ_{t+1}, q̂_{t+1}), FEDERATED (proprio encoder/decoder included)."""

    def __init__(self, latent_dim: int, num_tokens: int, action_embed: int, width: int, depth: int, heads: int,
                 max_steps: int, proprio_dim: int) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.max_steps = max_steps
        self.proprio_dim = proprio_dim
        self.inp = nn.Linear(latent_dim, width)
        self.proprio_in = nn.Linear(proprio_dim, width)
        self.act = nn.Linear(action_embed, width)
        self.act_cond = nn.Linear(action_embed, width)
        self.space = nn.Parameter(torch.randn(1, 1, num_tokens + 2, width) * 0.02)
        self.time = nn.Parameter(torch.randn(1, max_steps, 1, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, 4.0) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, latent_dim)
        self.proprio_out = nn.Linear(width, proprio_dim)
        # Zero-initialised output layers: an untrained predictor says "nothing moves" (the residual's copy)
        # and training adds only the change it can explain, instead of starting from random deltas larger
        # than a step's real change (a 3 px motion moves a token by ~0.1 of its spread).
        for layer in (self.out, self.proprio_out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, z_BTND: torch.Tensor, q_BTQ: torch.Tensor, act_BTA: torch.Tensor, cache: KVCache | None = None,
                return_cache: bool = False):
        """Teacher-forced: (ẑ_{t+1} [B, T, N, D], q̂_{t+1} [B, T, Q]) for every t of T new steps that follow the
        cached ones (time positions t0..t0+T−1, t0 = cached steps); with `return_cache`, also the new cache.

        Block-causal attention computed incrementally: each new step's tokens attend to every cached
        step and to the new steps up to their own, so the result equals one pass over the whole
        sequence. The prediction is a residual: ẑ_{t+1} = z_t + Δ, q̂_{t+1} = q_t + Δq (copying is the
        starting point, the model learns what moves).
        """
        B, T, N, _ = z_BTND.shape
        t0 = 0 if cache is None else cache.steps
        if t0 + T > self.max_steps:
            raise ValueError(f"the predictor has {self.max_steps} time positions, got a sequence of {t0 + T}")
        cond = self.act_cond(act_BTA)[:, :, None]  # [B, T, 1, W]
        x = torch.cat([self.inp(z_BTND) + cond, self.proprio_in(q_BTQ)[:, :, None] + cond, self.act(act_BTA)[:, :, None]], dim=2)  # [B, T, N+2, W]
        x = (x + self.space + self.time[:, t0 : t0 + T]).flatten(1, 2)  # [B, T*(N+2), W]
        mask = None
        if T > 1:
            mask = block_causal_mask(t0 + T, N + 2)[t0 * (N + 2):].to(x.device)  # [T*(N+2), (t0+T)*(N+2)]
        kv = []
        for i, block in enumerate(self.blocks):
            x, layer_kv = block(x, mask, None if cache is None else cache.kv[i], return_kv=True)
            kv.append(layer_kv)
        x = self.norm(x).reshape(B, T, N + 2, -1)
        z_next, q_next = z_BTND + self.out(x[:, :, :N]), q_BTQ + self.proprio_out(x[:, :, N])
        return (z_next, q_next, KVCache(kv, t0 + T)) if return_cache else (z_next, q_next)


class KVCache:
    """Keys and values of every predictor block for the steps seen so far."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> None:
        self.kv, self.steps = kv, steps

    def prefix(self, steps: int) -> KVCache:
        """The cache of the first `steps` steps: a block-causal pass's keys and values at a step depend only on
        the steps up to it, so this is the cache a pass over those steps alone would have left."""
        if not 0 < steps <= self.steps:
            raise ValueError(f"a prefix of {steps} steps of a cache of {self.steps}")
        tokens = self.kv[0][0].shape[2] // self.steps * steps
        return KVCache([(k[:, :, :tokens], v[:, :, :tokens]) for k, v in self.kv], steps)


def rollout(predictor: Predictor | AdaptedPredictor, z_BCND: torch.Tensor, q_BCQ: torch.Tensor, act_BTA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive rollout from a context of C observations under T = C − 1 + H embedded actions
    (the C − 1 taken between the context's observations, then H new ones).

    Returns the H predicted observations after the context: (ẑ [B, H, N, D], q̂ [B, H, Q]). One
    block-causal pass over the context, then one cached step per prediction.
    """
    C = z_BCND.shape[1]
    H = act_BTA.shape[1] - C + 1
    if H < 1:
        raise ValueError(f"a rollout from {C} context steps needs at least {C} actions, got {act_BTA.shape[1]}")
    z_all, q_all, cache = predictor(z_BCND, q_BCQ, act_BTA[:, :C], return_cache=True)
    return continue_rollout(predictor, z_all[:, -1], q_all[:, -1], cache, act_BTA[:, C:])


def continue_rollout(predictor: Predictor | AdaptedPredictor, z_BND: torch.Tensor, q_BQ: torch.Tensor, cache: KVCache,
                     act_BHA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout from its first prediction (ẑ [B, N, D], q̂ [B, Q], made from the steps in `cache`): one cached step
    per further action (H − 1 of them). Returns (ẑ [B, H, N, D], q̂ [B, H, Q]), the first prediction included."""
    zs, qs = [z_BND], [q_BQ]
    for h in range(act_BHA.shape[1]):
        z_next, q_next, cache = predictor(zs[-1][:, None], qs[-1][:, None], act_BHA[:, h : h + 1], cache, return_cache=True)
        zs.append(z_next[:, 0])
        qs.append(q_next[:, 0])
    return torch.stack(zs, dim=1), torch.stack(qs, dim=1)
