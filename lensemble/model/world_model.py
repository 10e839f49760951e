"""The world model: encoder f_θ and predictor g_φ (federated) plus one action head per embodiment (local), and a
local proprio adapter for each embodiment that joined after the federation (`proprio_adapters`).

`federated_state` / `load_federated` are the federation map: the only parameters that ever enter a
pseudo-gradient are those under `encoder.` and `predictor.`; action heads never do.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lensemble.config import ModelParams
from lensemble.model.predictor import (
    ActionHead,
    AdaptedPredictor,
    Predictor,
    ProprioAdapter,
)
from lensemble.model.sizes import vit_config
from lensemble.model.vit import ViTEncoder

ENCODER_PREFIX = "encoder."
FEDERATED_PREFIXES = (ENCODER_PREFIX, "predictor.")


class WorldModel(nn.Module):
    """f_θ + g_φ + {h_ψ^(c)} + {a_ψ^(c)}: `adapted` maps an embodiment to its proprio dimension where it has an adapter
    (none in the federation: its embodiments train the shared proprio encoder themselves)."""

    def __init__(self, params: ModelParams, image_size: int, action_dims: Mapping[str, int], max_steps: int,
                 adapted: Mapping[str, int] | None = None) -> None:
        super().__init__()
        cfg = vit_config(params.encoder)
        self.encoder = ViTEncoder(cfg, image_size, params.patch_size)
        self.predictor = Predictor(
            cfg.width, self.encoder.num_tokens, params.action_dim, params.predictor_width,
            params.predictor_depth, params.predictor_heads, max_steps, params.proprio_dim,
        )
        self.action_heads = nn.ModuleDict({name: ActionHead(k, params.action_dim) for name, k in sorted(action_dims.items())})
        self.proprio_adapters = nn.ModuleDict({name: ProprioAdapter(params.proprio_dim, p) for name, p in sorted((adapted or {}).items())})

    def predictor_for(self, embodiment: str) -> Predictor | AdaptedPredictor:
        """g_φ as `embodiment` calls it: through its proprio adapter where it has one, else g_φ itself."""
        if embodiment in self.proprio_adapters:
            return AdaptedPredictor(self.predictor, self.proprio_adapters[embodiment])
        return self.predictor

    @property
    def latent_dim(self) -> int:
        return self.encoder.width


def federated_state(model: WorldModel) -> dict[str, torch.Tensor]:
    """Detached fp32 copies of the federated parameters, by name, on the CPU (what the aggregator reads)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if n.startswith(FEDERATED_PREFIXES)}


def local_state(model: WorldModel) -> dict[str, torch.Tensor]:
    """Detached copies of the parameters that stay at the site (action heads, proprio adapters)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if not n.startswith(FEDERATED_PREFIXES)}


def load_federated(model: WorldModel, state: Mapping[str, torch.Tensor]) -> None:
    """Copy federated tensors into the model in place; the names must match exactly."""
    params = dict(model.named_parameters())
    expected = {n for n in params if n.startswith(FEDERATED_PREFIXES)}
    if set(state) != expected:
        raise KeyError(f"federated state names differ: extra {sorted(set(state) - expected)[:3]}, missing {sorted(expected - set(state))[:3]}")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
