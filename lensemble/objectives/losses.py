"""The objective L = L_pred + λ_prop · L_proprio + λ_sig · SIGReg(z) + λ_anc · L_anchor (DESIGN.md §2), as pure functions.

Shape legend: B batch, T frames, N tokens, D latent width, K action dim, Q proprio width (padded),
P probe frames.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from lensemble.model.predictor import ActionHead, AdaptedPredictor, Predictor, continue_rollout
from lensemble.model.vit import ViTEncoder
from lensemble.objectives.sigreg import sigreg


@dataclass(frozen=True)
class LossTerms:
    total: torch.Tensor
    pred: torch.Tensor
    proprio: torch.Tensor
    sigreg: torch.Tensor
    anchor: torch.Tensor
    copy: torch.Tensor
    """The batch's copy error (detached): what L_pred's teacher-forced term would be if the latent never moved."""


def prediction_loss(predictor: Predictor | AdaptedPredictor, z_BTND: torch.Tensor, q_BTQ: torch.Tensor, act_BTA: torch.Tensor, rollout_steps: int,
                    proprio_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent, proprio) prediction MSE: teacher-forced ẑ_{t+1}, q̂_{t+1} for every t, plus an autoregressive
    rollout of the window's last k = `rollout_steps` steps from the T - k before them (the context a
    planner gives it). The proprio error reads the embodiment's first `proprio_valid` components only.

    The rollout does not run its own pass over the context: under the block-causal mask the teacher-forced
    pass's outputs and keys/values at the first C = T − k steps are those of a pass over them alone, so the
    rollout starts from the teacher-forced ẑ_C and that pass's cache (`rollout` gives the same numbers, up to
    float rounding; the predictor then runs T − 1 + k − 1 time steps a batch instead of T − 1 + T − 1)."""
    T = z_BTND.shape[1]
    k = min(rollout_steps, T - 1)
    z_pred, q_pred, cache = predictor(z_BTND[:, :-1], q_BTQ[:, :-1], act_BTA[:, :-1], return_cache=True)  # [B, T-1, N, D], [B, T-1, Q]
    lat = F.mse_loss(z_pred.float(), z_BTND[:, 1:].float())  # fp32 whatever the autocast (DESIGN.md: fp32 statistics)
    prop = F.mse_loss(q_pred[..., :proprio_valid].float(), q_BTQ[:, 1:, :proprio_valid].float())
    if k > 0:
        C = T - k
        z_roll, q_roll = continue_rollout(predictor, z_pred[:, C - 1], q_pred[:, C - 1], cache.prefix(C),
                                          act_BTA[:, C : T - 1])  # [B, k, N, D], [B, k, Q]
        lat = lat + F.mse_loss(z_roll.float(), z_BTND[:, C:].float())
        prop = prop + F.mse_loss(q_roll[..., :proprio_valid].float(), q_BTQ[:, C:, :proprio_valid].float())
    return lat, prop


def copy_error(z_BTND: torch.Tensor) -> torch.Tensor:
    """MSE of "nothing moves" on a batch, fp32 and detached: ẑ_{t+1} = z_t against z_{t+1} for every t."""
    return F.mse_loss(z_BTND[:, :-1].detach().float(), z_BTND[:, 1:].detach().float())


def sigreg_tokens(z_BTND: torch.Tensor, sigreg_on: str, sigreg_index: torch.Tensor | None) -> torch.Tensor:
    """The embeddings SIGReg tests, [n, D].

    `tokens`: every token embedding (a seeded subset); `frames`: one token-mean embedding per frame;
    `centered_tokens`: token embeddings minus their position's mean over the batch's frames, so the
    fixed patch layout (what every frame shares at a position) is not what SIGReg spreads, the
    frame-to-frame variation (the state) is.
    """
    if sigreg_on == "frames":
        return z_BTND.mean(2).flatten(0, 1)  # [B*T, D]
    if sigreg_on == "centered_tokens":
        z_BTND = z_BTND - z_BTND.mean(dim=(0, 1), keepdim=True)
    tokens = z_BTND.flatten(0, 2)  # [B*T*N, D]
    return tokens[sigreg_index] if sigreg_index is not None else tokens


def anchor_uses(probe: torch.Tensor | None, global_probe_PND: torch.Tensor | None, anchor_weight: float) -> bool:
    """Whether a step has an anchor term: probe rows, their global embedding and a positive λ_anc."""
    return probe is not None and global_probe_PND is not None and anchor_weight > 0


def encode_batch(encoder: ViTEncoder, frames_BTCHW: torch.Tensor, probe_PCHW: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch's embeddings z [B, T, N, D] and, given probe frames (an anchored step), theirs [P, N, D].

    One encoder pass over the batch's frames and the probe frames together: the anchor then costs its
    frames' share of the forward, not a second pass with its own fixed overheads.
    """
    if probe_PCHW is None:
        return encoder(frames_BTCHW), None  # [B, T, N, D]
    B, T = frames_BTCHW.shape[:2]
    both = torch.cat([frames_BTCHW.flatten(0, 1), probe_PCHW])[None]  # [1, B*T + P, 3, H, W]
    z_all = encoder(both)[0]  # [B*T + P, N, D]
    return z_all[: B * T].reshape(B, T, *z_all.shape[1:]), z_all[B * T :]


def anchor_loss(encoder: ViTEncoder, probe_PCHW: torch.Tensor, global_probe_PND: torch.Tensor) -> torch.Tensor:
    """MSE between the local encoder's probe embeddings and the round-start global encoder's."""
    z = encoder(probe_PCHW[:, None])[:, 0]  # [P, N, D]
    return F.mse_loss(z.float(), global_probe_PND.float())


def world_model_loss(
    encoder: ViTEncoder,
    predictor: Predictor | AdaptedPredictor,
    head: ActionHead,
    frames_BTCHW: torch.Tensor | None,
    actions_BTK: torch.Tensor,
    proprio_BTQ: torch.Tensor,
    directions_DM: torch.Tensor,
    sigreg_index: torch.Tensor | None = None,
    *,
    proprio_valid: int,
    proprio_weight: float,
    sigreg_weight: float,
    anchor_weight: float,
    num_knots: int,
    t_max: float,
    rollout_steps: int,
    sigreg_on: str = "tokens",
    probe_PCHW: torch.Tensor | None = None,
    global_probe_PND: torch.Tensor | None = None,
    pred_weight: float = 1.0,
    encoded: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> LossTerms:
    """All terms of L for one batch; the anchor is 0 when no global probe embedding is given.

    `pred_weight` multiplies L_pred in the total (pooled training's per-embodiment balance,
    `training.PredBalance`; 1 everywhere else). The returned terms are unweighted.
    `encoded`: `encode_batch`'s (z, z_probe) for this batch when the caller has them (a frozen encoder's,
    `training.FrozenLatents`); then `frames_BTCHW` and `probe_PCHW` are not read and the encoder does not run.

    The profiler spans (encoder_forward, predictor_step, sigreg_anchor) are the profiling plan's
    (spec 08 §6); `record_function` only labels, it changes no number.
    """
    use_anchor = anchor_uses(probe_PCHW if encoded is None else encoded[1], global_probe_PND, anchor_weight)
    with record_function("encoder_forward"):
        z, z_probe = encode_batch(encoder, frames_BTCHW, probe_PCHW if use_anchor else None) if encoded is None else encoded
    with record_function("predictor_step"):
        act = head(actions_BTK)  # [B, T, A]
        pred, prop = prediction_loss(predictor, z, proprio_BTQ, act, rollout_steps, proprio_valid)
    with record_function("sigreg_anchor"):
        reg = sigreg(sigreg_tokens(z, sigreg_on, sigreg_index), directions_DM, num_knots, t_max)
        if use_anchor:
            anc = F.mse_loss(z_probe.float(), global_probe_PND.float())  # = anchor_loss(encoder, probe, global), same pass
        else:
            anc = torch.zeros((), dtype=torch.float32, device=pred.device)
    total = weighted_total(pred, prop, reg, anc, pred_weight, proprio_weight, sigreg_weight, anchor_weight)
    return LossTerms(total, pred.detach(), prop.detach(), reg.detach(), anc.detach(), copy_error(z))


def weighted_total(pred: torch.Tensor, prop: torch.Tensor, reg: torch.Tensor, anc: torch.Tensor, pred_weight: float,
                   proprio_weight: float, sigreg_weight: float, anchor_weight: float) -> torch.Tensor:
    """L = w_pred · L_pred + λ_prop · L_proprio + λ_sig · SIGReg + λ_anc · L_anchor, accumulated in fp32."""
    latent = pred.float() if pred_weight == 1.0 else pred_weight * pred.float()  # weight 1: the unweighted bits
    return latent + proprio_weight * prop.float() + sigreg_weight * reg.float() + anchor_weight * anc.float()
