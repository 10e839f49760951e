"""The objective L = L_pred + λ_sig · SIGReg(z) + λ_anc · L_anchor (DESIGN.md §2), as pure functions.

Shape legend: B batch, T frames, N tokens, D latent width, K action dim, P probe frames.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from lensemble.model.predictor import ActionHead, Predictor, rollout
from lensemble.model.vit import ViTEncoder
from lensemble.objectives.sigreg import sigreg


@dataclass(frozen=True)
class LossTerms:
    total: torch.Tensor
    pred: torch.Tensor
    sigreg: torch.Tensor
    anchor: torch.Tensor


def prediction_loss(predictor: Predictor, z_BTND: torch.Tensor, act_BTA: torch.Tensor, rollout_steps: int) -> torch.Tensor:
    """Teacher-forced MSE of ẑ_{t+1} vs z_{t+1}, plus an autoregressive rollout from z_0."""
    pred = predictor(z_BTND[:, :-1], act_BTA[:, :-1])  # [B, T-1, N, D]
    loss = F.mse_loss(pred, z_BTND[:, 1:])
    k = min(rollout_steps, z_BTND.shape[1] - 1)
    if k > 0:
        roll = rollout(predictor, z_BTND[:, 0], act_BTA[:, :k])  # [B, k, N, D]
        loss = loss + F.mse_loss(roll, z_BTND[:, 1 : k + 1])
    return loss


def anchor_loss(encoder: ViTEncoder, probe_PCHW: torch.Tensor, global_probe_PND: torch.Tensor) -> torch.Tensor:
    """MSE between the local encoder's probe embeddings and the round-start global encoder's."""
    z = encoder(probe_PCHW[:, None])[:, 0]  # [P, N, D]
    return F.mse_loss(z, global_probe_PND)


def world_model_loss(
    encoder: ViTEncoder,
    predictor: Predictor,
    head: ActionHead,
    frames_BTCHW: torch.Tensor,
    actions_BTK: torch.Tensor,
    directions_DM: torch.Tensor,
    sigreg_index: torch.Tensor | None = None,
    *,
    sigreg_weight: float,
    anchor_weight: float,
    num_knots: int,
    t_max: float,
    rollout_steps: int,
    sigreg_on: str = "tokens",
    probe_PCHW: torch.Tensor | None = None,
    global_probe_PND: torch.Tensor | None = None,
) -> LossTerms:
    """All terms of L for one batch; the anchor is 0 when no global probe embedding is given.

    The profiler spans (encoder_forward, predictor_step, sigreg_anchor) are the profiling plan's
    (spec 08 §6); `record_function` only labels, it changes no number.
    """
    use_anchor = probe_PCHW is not None and global_probe_PND is not None and anchor_weight > 0
    with record_function("encoder_forward"):
        if use_anchor:
            # One encoder pass over the batch's frames and the probe frames together: the anchor then
            # costs its frames' share of the forward, not a second pass with its own fixed overheads.
            B, T = frames_BTCHW.shape[:2]
            both = torch.cat([frames_BTCHW.flatten(0, 1), probe_PCHW])[None]  # [1, B*T + P, 3, H, W]
            z_all = encoder(both)[0]  # [B*T + P, N, D]
            z = z_all[: B * T].reshape(B, T, *z_all.shape[1:])  # [B, T, N, D]
            z_probe = z_all[B * T :]  # [P, N, D]
        else:
            z = encoder(frames_BTCHW)  # [B, T, N, D]
    with record_function("predictor_step"):
        act = head(actions_BTK)  # [B, T, A]
        pred = prediction_loss(predictor, z, act, rollout_steps)
    with record_function("sigreg_anchor"):
        if sigreg_on == "frames":
            tokens = z.mean(2).flatten(0, 1)  # [B*T, D] one pooled embedding per frame
        else:
            tokens = z.flatten(0, 2)  # [B*T*N, D]
            if sigreg_index is not None:
                tokens = tokens[sigreg_index]
        reg = sigreg(tokens, directions_DM, num_knots, t_max)
        if use_anchor:
            anc = F.mse_loss(z_probe, global_probe_PND)  # = anchor_loss(encoder, probe, global), same pass
        else:
            anc = torch.zeros((), dtype=pred.dtype)
    total = pred.float() + sigreg_weight * reg.float() + anchor_weight * anc.float()
    return LossTerms(total, pred.detach(), reg.detach(), anc.detach())
