"""Local training: the inner loop every site runs, and Stage A's pooled loop.

Both are `train_steps`: AdamW over batches drawn from one or more embodiments' WindowSamplers, with
SIGReg directions keyed by (run seed, round, step) so every site and every rerun projects alike.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.profiler import record_function

from lensemble.config import ObjectiveParams, TrainParams
from lensemble.data.windows import WindowSampler, frames_to_tensor
from lensemble.device import autocast, model_device, to_device
from lensemble.model.world_model import WorldModel
from lensemble.objectives.losses import anchor_uses, encode_batch, world_model_loss
from lensemble.objectives.sigreg import random_directions
from lensemble.seeds import generator


@dataclass
class StepLog:
    """Per-step scalar losses, averaged by `mean()`."""

    pred: list[float] = field(default_factory=list)
    proprio: list[float] = field(default_factory=list)
    sigreg: list[float] = field(default_factory=list)
    anchor: list[float] = field(default_factory=list)

    def mean(self) -> dict[str, float]:
        out = {}
        for name in ("pred", "proprio", "sigreg", "anchor"):
            vals = getattr(self, name)
            out[f"loss/{name}"] = sum(vals) / max(len(vals), 1)
        return out


def make_optimizer(model: WorldModel, train: TrainParams) -> torch.optim.AdamW:
    """Inner AdamW over every trainable parameter (federated and local)."""
    # foreach: one multi-tensor kernel per op instead of a Python loop over ~100 parameters
    return torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay, foreach=True)


def autocast_context(precision: str, device_type: str | None = None):
    """bf16 autocast when asked, on `device_type` (default: CUDA when torch sees a GPU, else CPU); a no-op for fp32."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return autocast(precision, device_type)


class StepDraws:
    """Every random draw of a training step, in one fixed order: Window batch, SIGReg directions,
    SIGReg token subset, probe rows. `train_steps` and `distributed.ddp_train_steps` both draw
    through this, so single-process and data-parallel training see the same batches."""

    def __init__(self, run_seed: int, round_idx: int, data_key: str) -> None:
        self.run_seed, self.round_idx = run_seed, round_idx
        self.batch_gen = generator(run_seed, "windows", round_idx, data_key)
        self.probe_gen = generator(run_seed, "probe_batch", round_idx, data_key)

    def draw(self, step: int, samplers: Sequence[tuple[str, WindowSampler]], model: WorldModel, train: TrainParams,
             objective: ObjectiveParams, probe_PCHW: torch.Tensor | None, global_probe_PND: torch.Tensor | None,
             latents: FrozenLatents | None = None):
        """(embodiment, sampler, frames [B,T,3,H,W], actions [B,T,K], proprio [B,T,Q], directions [D,M], token subset
        or None, probe, global probe).

        With `latents` (a frozen encoder's), the frames' and the probe rows' embeddings ([B,T,N,D], [P,N,D])
        stand where the frames and the probe rows would: the same draws, read from the cache."""
        i = step % len(samplers)
        embodiment, sampler = samplers[i]
        e_B1, steps_BT = sampler.draw(train.batch_size, self.batch_gen)
        actions, proprio = sampler.gather(e_B1, steps_BT)
        frames = frames_to_tensor(sampler.eps.frames_ELHWC[e_B1, steps_BT]) if latents is None else latents.z[i][e_B1, steps_BT]
        sig_gen = generator(self.run_seed, "sigreg", self.round_idx, step=step)
        directions = random_directions(model.latent_dim, objective.sketch_dim, sig_gen)
        num_tokens = steps_BT.size * model.encoder.num_tokens
        sig_index = torch.randperm(num_tokens, generator=sig_gen)[: objective.sigreg_tokens] if num_tokens > objective.sigreg_tokens else None
        probe = global_probe = None
        if probe_PCHW is not None and global_probe_PND is not None:
            idx = torch.randint(0, probe_PCHW.shape[0], (min(objective.probe_batch, probe_PCHW.shape[0]),), generator=self.probe_gen)
            probe = probe_PCHW[idx] if latents is None else None if latents.z_probe is None else latents.z_probe[idx]
            global_probe = global_probe_PND[idx]
        return embodiment, sampler, frames, actions, proprio, directions, sig_index, probe, global_probe


class FrozenLatents:
    """A frozen encoder's embedding of every frame the samplers can draw (and of every probe row), computed once.

    While the encoder is frozen (`train.freeze_encoder_at`'s later steps, a head re-fit, a joining robot's
    training) it maps a frame to the same embedding at every step, so a step can gather its batch's embeddings
    here instead of encoding its frames again. The encoder works frame by frame and row by row: encoded here
    in passes of exactly the training pass's shape (`pass_frames` rows, the last pass padded), in the step's
    autocast and grad mode, an embedding has the bits the step's own pass gives it. `build` checks that on a
    batch in another order than the cache's, and returns None (the steps then encode, as before) if any bit differs.
    """

    MAX_BYTES = 1 << 29
    """Caches larger than this (512 MiB) are not built: the steps encode their frames."""

    def __init__(self, z: list[torch.Tensor], z_probe: torch.Tensor | None) -> None:
        self.z, self.z_probe = z, z_probe  # [E, L, N, D] per sampler; [P, N, D] or None (no anchor)

    @classmethod
    def build(cls, encoder: torch.nn.Module, samplers: Sequence[tuple[str, WindowSampler]], probe_PCHW: torch.Tensor | None,
              batch_size: int, probe_batch: int, device: torch.device, precision: str) -> FrozenLatents | None:
        """The cache for `samplers` (and `probe_PCHW`, the probe rows of an anchored step), or None where its bits
        would not be the steps'. The encoder must be frozen (no parameter requires grad)."""
        if any(p.requires_grad for p in encoder.parameters()):
            raise ValueError("FrozenLatents needs a frozen encoder: a learning encoder's embeddings change every step")
        T = samplers[0][1].num_steps
        pass_frames = batch_size * T + (probe_batch if probe_PCHW is not None else 0)
        with autocast_context(precision, device.type):
            flat = [s.eps.frames_ELHWC.reshape(-1, *s.eps.frames_ELHWC.shape[2:]) for _, s in samplers]
            z = [cls._encode(encoder, f, pass_frames, device) for f in flat]
            z_probe = None if probe_PCHW is None else cls._encode(encoder, probe_PCHW, pass_frames, device)
            probe_rows = None if probe_PCHW is None else torch.arange(len(probe_PCHW)).flip(0).repeat(probe_batch)[:probe_batch]
            for i, (f, z_F) in enumerate(zip(flat, z)):  # a step's pass over rows in reverse order: each sits elsewhere in its pass here
                rows = np.resize(np.arange(len(f))[::-1], batch_size * T)
                frames = frames_to_tensor(f[rows])
                check_probe = probe_rows is not None and i == 0  # the probe rows once, in the first sampler's pass
                z_ref, z_probe_ref = encode_batch(encoder, to_device(frames.reshape(batch_size, T, *frames.shape[1:]), device),
                                                  to_device(probe_PCHW[probe_rows], device) if check_probe else None)
                if not torch.equal(z_ref.flatten(0, 1), z_F[torch.from_numpy(rows.copy()).to(z_F.device)]):
                    return None
                if check_probe and not torch.equal(z_probe_ref, z_probe[probe_rows.to(z_probe.device)]):
                    return None
        return cls([z_F.reshape(*s.eps.frames_ELHWC.shape[:2], *z_F.shape[1:]) for z_F, (_, s) in zip(z, samplers)], z_probe)

    @staticmethod
    def _encode(encoder: torch.nn.Module, frames, pass_frames: int, device: torch.device) -> torch.Tensor:
        """[F, N, D] embeddings of F frames (uint8 [F, H, W, 3] or float [F, 3, H, W]) in passes of `pass_frames` rows."""
        out = []
        for a in range(0, len(frames), pass_frames):
            chunk = frames[a : a + pass_frames]
            n = len(chunk)
            if isinstance(chunk, np.ndarray):
                chunk = frames_to_tensor(chunk)
            if n < pass_frames:  # padded with the chunk's first frame: every pass has the training pass's shape
                chunk = torch.cat([chunk, chunk[:1].expand(pass_frames - n, *chunk.shape[1:])])
            out.append(encoder(to_device(chunk, device)[None])[0][:n])
        return torch.cat(out)

    @classmethod
    def pays(cls, samplers: Sequence[tuple[str, WindowSampler]], probe_rows: int, frozen_steps: int, batch_size: int, num_tokens: int,
             width: int) -> bool:
        """Whether a cache saves work: it encodes at most half the frames the frozen steps would (the build also converts
        every frame and checks a pass: a thinner margin saves nothing measurable), and fits MAX_BYTES."""
        frames = sum(s.num_frames for _, s in samplers) + probe_rows
        steps_frames = frozen_steps * batch_size * samplers[0][1].num_steps
        return 2 * frames <= steps_frames and frames * num_tokens * width * 4 <= cls.MAX_BYTES


class PredBalance:
    """Per-embodiment weights on L_pred when one model trains on several embodiments (objective.pred_balance).

    Under one AdamW the embodiments share each parameter's second moment, so the one whose latent moves
    furthest a step (the largest copy error, and the largest L_pred gradients) sets the step size of all:
    in the default pooled run PushT's copy error is 3x the point mass's and the reacher's. `copy` weighs each
    embodiment's L_pred by the inverse of its copy error (a running mean over its own batches, decay
    `DECAY`), the weights averaging 1 over the embodiments: L_pred in units of "nothing moves", the units
    the dynamics diagnostics read, with the total weight on L_pred unchanged. Weight 1 until every
    embodiment has had a batch, and always with `none` or one embodiment (a site, local-only, a joining
    robot), whose training is then bit for bit the unbalanced one. The weights read only past batches of the
    same `train_steps` call (Stage A trains in one).
    """

    DECAY = 0.98

    def __init__(self, mode: str, embodiments: Sequence[str]) -> None:
        if mode not in ("none", "copy"):
            raise ValueError(f"objective.pred_balance must be 'none' or 'copy', got {mode!r}")
        self.active = mode == "copy" and len(set(embodiments)) > 1
        self.embodiments = sorted(set(embodiments))
        self.copy: dict[str, float] = {}

    def weight(self, embodiment: str) -> float:
        if not self.active or len(self.copy) < len(self.embodiments):
            return 1.0
        inverse = {e: 1.0 / max(self.copy[e], 1e-12) for e in self.embodiments}
        return inverse[embodiment] * len(inverse) / sum(inverse.values())

    def update(self, embodiment: str, copy: torch.Tensor | float) -> None:
        """After a step on `embodiment`: its batch's copy error (`LossTerms.copy`), read only when balancing."""
        if not self.active:
            return
        copy, before = float(copy), self.copy.get(embodiment)
        self.copy[embodiment] = copy if before is None else self.DECAY * before + (1.0 - self.DECAY) * copy


def scheduled_lr(train: TrainParams, step: int, total: int | None) -> float:
    """The inner learning rate at step `step` (0-based) of a `total`-step training; `total` None: `train.lr`.

    cosine: linear warm-up over `warmup_steps` to lr, then half a cosine from lr at the end of warm-up
    to `lr_final_fraction` x lr at the last step (step total - 1).
    """
    if train.lr_schedule == "constant" or total is None:
        return train.lr
    if not 0 <= step < total:
        raise ValueError(f"scheduled step {step} outside the {total}-step schedule")
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = total - 1 - train.warmup_steps
    progress = (step - train.warmup_steps) / span if span > 0 else 1.0
    final = train.lr_final_fraction
    return train.lr * (final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def encoder_learns(train: TrainParams, step: int, total: int) -> bool:
    """Whether the encoder learns at step `step` (0-based) of a `total`-step training: in the first
    round(train.freeze_encoder_at x total) steps (`TrainParams.freeze_encoder_at`)."""
    return step < round(train.freeze_encoder_at * total)


def set_trainable(module: torch.nn.Module, trainable: bool) -> None:
    """requires_grad of every parameter of `module`."""
    for p in module.parameters():
        p.requires_grad_(trainable)


def train_steps(
    model: WorldModel,
    optimizer: torch.optim.Optimizer,
    samplers: Sequence[tuple[str, WindowSampler]],
    steps: int,
    *,
    train: TrainParams,
    objective: ObjectiveParams,
    run_seed: int,
    round_idx: int,
    data_key: str,
    probe_PCHW: torch.Tensor | None = None,
    global_probe_PND: torch.Tensor | None = None,
    on_step: Callable[[int, Mapping[str, float]], None] | None = None,
    schedule: tuple[int, int] | None = None,
    reuse_frozen_latents: bool = True,
) -> StepLog:
    """`steps` AdamW steps; step i trains on samplers[i % len(samplers)] (round-robin pooling).

    `schedule` (offset, total): these steps are steps offset .. offset + steps - 1 of a `total`-step
    training, and take `scheduled_lr`'s rate there, the encoder learning only while `encoder_learns`;
    None: every step at the optimizer's own rate, the parameters trainable as the caller left them (a head re-fit).
    A frozen encoder gets no gradient, so AdamW leaves it untouched (no update, no weight decay); on return the
    encoder is trainable as it was on entry. While it is frozen the steps read their frames' embeddings from a
    `FrozenLatents` cache where one pays and has the steps' bits (`reuse_frozen_latents`; the same numbers either way).
    """
    if schedule is not None and schedule[0] + steps > schedule[1]:
        raise ValueError(f"steps {schedule[0]}..{schedule[0] + steps - 1} run past the {schedule[1]}-step schedule")
    model.train()
    log = StepLog()
    draws = StepDraws(run_seed, round_idx, data_key)
    balance = PredBalance(objective.pred_balance, [e for e, _ in samplers])
    device = model_device(model)
    freezes = schedule is not None and train.freeze_encoder_at < 1.0
    on_entry = [p.requires_grad for p in model.encoder.parameters()]
    learning = None
    frozen = not any(on_entry)  # without a schedule the caller's choice holds for every step
    anchored = anchor_uses(probe_PCHW, global_probe_PND, objective.anchor_weight)
    latents: FrozenLatents | None = None
    try:
        for step in range(steps):
            if freezes and learning != (learns := encoder_learns(train, schedule[0] + step, schedule[1])):
                set_trainable(model.encoder, learns)
                learning, frozen = learns, not learns
            if frozen and latents is None and reuse_frozen_latents and FrozenLatents.pays(
                    samplers, probe_PCHW.shape[0] if anchored else 0, steps - step, train.batch_size, model.encoder.num_tokens,
                    model.encoder.width):
                latents = FrozenLatents.build(model.encoder, samplers, probe_PCHW if anchored else None, train.batch_size,
                                              min(objective.probe_batch, probe_PCHW.shape[0]) if anchored else 0, device, train.precision)
                reuse_frozen_latents = latents is not None  # built once a call, or never
            embodiment, sampler, frames, actions, proprio, directions, sig_index, probe, global_probe = draws.draw(  # drawn on the CPU:
                step, samplers, model, train, objective, probe_PCHW, global_probe_PND, latents if frozen else None)  # the same on any device
            frames, actions, proprio, directions, sig_index, probe, global_probe = (
                None if t is None else to_device(t, device) for t in (frames, actions, proprio, directions, sig_index, probe, global_probe))
            encoded = None
            if frozen and latents is not None:  # the draws' embeddings, from the cache
                encoded, frames, probe = (frames, probe), None, None
            with autocast_context(train.precision, device.type):
                terms = world_model_loss(
                    model.encoder, model.predictor_for(embodiment), model.action_heads[embodiment], frames, actions, proprio, directions, sig_index,
                    proprio_valid=sampler.proprio_valid, proprio_weight=objective.proprio_weight,
                    sigreg_weight=objective.sigreg_weight, anchor_weight=objective.anchor_weight,
                    num_knots=objective.num_knots, t_max=objective.t_max, rollout_steps=objective.rollout_steps, sigreg_on=objective.sigreg_on,
                    probe_PCHW=probe, global_probe_PND=global_probe, pred_weight=balance.weight(embodiment),
                    encoded=encoded,
                )
            if schedule is not None:
                lr = scheduled_lr(train, schedule[0] + step, schedule[1])
                for group in optimizer.param_groups:
                    group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            with record_function("backward"):
                terms.total.backward()
            with record_function("optimizer_step"):
                optimizer.step()
            balance.update(embodiment, terms.copy)
            log.pred.append(float(terms.pred))
            log.proprio.append(float(terms.proprio))
            log.sigreg.append(float(terms.sigreg))
            log.anchor.append(float(terms.anchor))
            if on_step is not None:
                on_step(step, {"loss/pred": log.pred[-1], "loss/proprio": log.proprio[-1], "loss/sigreg": log.sigreg[-1],
                               "loss/anchor": log.anchor[-1]})
    finally:
        for p, flag in zip(model.encoder.parameters(), on_entry):
            p.requires_grad_(flag)
    return log


@torch.no_grad()
def encode_frames(model: WorldModel, frames_PCHW: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Encoder embeddings of single frames, [P, N, D], in eval mode, fp32 and on the CPU (gauge statistics read them)."""
    model.eval()
    device = model_device(model)
    out = [model.encoder(to_device(frames_PCHW[i : i + batch], device)[:, None])[:, 0].float().cpu()
           for i in range(0, frames_PCHW.shape[0], batch)]
    return torch.cat(out)
