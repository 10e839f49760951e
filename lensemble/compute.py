"""Compute accounting for one training step: parameter counts, counted FLOPs, a memory estimate.

Everything is a function of `Params`. Models are built on the meta device (shapes, no storage), so
the figures exist before launch for every configuration up to ViT-L in well under a second;
`compute_summary` bundles them into a plain dict for the RunManifest.

A *training step* is what `lensemble.training.train_steps` does once: `world_model_loss` on a batch
of `train.batch_size` Windows of `data.num_steps` frames (teacher-forced prediction, a
`objective.rollout_steps` rollout, SIGReg on `objective.sigreg_tokens` tokens, and — in a federated
inner step, `anchor=True` — the anchor loss on `objective.probe_batch` probe frames), its backward,
and one AdamW step.

FLOPs are counted, not estimated: `step_flops` runs one forward and one backward of
`world_model_loss` under `torch.utils.flop_counter.FlopCounterMode`, which counts matmul-class ops
(mm, addmm, bmm, convolution, attention). PyTorch has no formula for the CPU flash-attention kernel,
so one is supplied here; attention backward counts 2x its forward (model FLOPs, the MFU convention:
flash attention's recomputation of QKᵀ is not counted), which makes counts on the meta device, where
attention decomposes into two bmm, and on the CPU identical.

Memory estimate (bytes), with P the parameter count (every parameter counted as trained; the
action heads are a few thousand of them):

    fp32 master 4P + bf16 working copy 2P (precision bf16 only) + gradients 4P
    + AdamW moments 8P + activations + inputs

Gradients are counted because `train_steps` clears them (set to None) only after the next forward,
so at the end of a forward — the step's peak — last step's gradients, the moments and every saved
activation are alive together. `activation_bytes` gives the saved-for-backward tensors from the
model shapes (formula in its docstring); `saved_tensor_bytes` measures the same quantity on a real
forward with `torch.autograd.graph.saved_tensors_hooks`, and the tests hold the two together.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from lensemble.config import Params
from lensemble.model.sizes import vit_config
from lensemble.model.vit import ViTEncoder
from lensemble.model.world_model import FEDERATED_PREFIXES, WorldModel
from lensemble.objectives.losses import world_model_loss
from lensemble.workflow import build_model

GIB = 2**30
FP32 = 4


@dataclass(frozen=True)
class StepShape:
    """The sizes one training step works on, read from Params."""

    batch: int  # B Windows
    frames: int  # T frames per Window
    image: int  # H = W
    tokens: int  # N tokens per frame
    width: int  # D encoder width
    depth: int
    heads: int
    pred_width: int  # W predictor width
    pred_depth: int
    pred_heads: int
    action_embed: int  # A
    proprio: int  # Q padded proprio width
    probe: int  # P probe frames (0: no anchor term)
    sigreg_tokens: int  # n embeddings SIGReg tests (tokens, or one pooled per frame)
    directions: int  # M
    knots: int  # K
    rollout: int  # k autoregressive steps
    precision: str

    @property
    def working_bytes(self) -> int:
        """Bytes per element of autocast's working dtype (matmul inputs and outputs)."""
        return 2 if self.precision == "bf16" else FP32


def step_shape(params: Params, anchor: bool | None = None) -> StepShape:
    """The step's sizes. The anchor term is in (a federated inner step) unless `anchor=False`
    (a Stage A step, which has no global probe) or `objective.anchor_weight` is 0."""
    cfg = vit_config(params.model.encoder)
    tokens = (params.data.image_size // params.model.patch_size) ** 2
    B, T = params.train.batch_size, params.data.num_steps
    use_anchor = params.objective.anchor_weight > 0 and (anchor is None or anchor)
    return StepShape(
        batch=B, frames=T, image=params.data.image_size, tokens=tokens, width=cfg.width, depth=cfg.depth,
        heads=cfg.heads, pred_width=params.model.predictor_width, pred_depth=params.model.predictor_depth,
        pred_heads=params.model.predictor_heads, action_embed=params.model.action_dim, proprio=params.model.proprio_dim,
        probe=params.objective.probe_batch if use_anchor else 0,
        sigreg_tokens=B * T if params.objective.sigreg_on == "frames" else min(params.objective.sigreg_tokens, B * T * tokens),
        directions=params.objective.sketch_dim,
        knots=params.objective.num_knots, rollout=min(params.objective.rollout_steps, T - 1),
        precision=params.train.precision,
    )


# ---------------------------------------------------------------------------------------- models


def meta_model(params: Params) -> WorldModel:
    """`workflow.build_model(params)` on the meta device: every shape, no storage, RNG untouched."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return build_model(params, "meta")


def action_dim(model: WorldModel, embodiment: str) -> int:
    """K, the action dimension the embodiment's head takes."""
    return model.action_heads[embodiment].net[0].in_features


def param_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters by federation role: federated (encoder + predictor) and local (action heads)."""
    counts = {"encoder": 0, "predictor": 0, "federated": 0, "local": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith(FEDERATED_PREFIXES):
            counts["federated"] += n
            counts[name.split(".", 1)[0]] += n
        else:
            counts["local"] += n
    counts["total"] = counts["federated"] + counts["local"]
    return counts


def encoder_param_count(encoder: str, image_size: int, patch_size: int) -> int:
    """Parameters of the ViT encoder alone (patch embedding, positions, blocks, final norm)."""
    with torch.device("meta"):
        enc = ViTEncoder(vit_config(encoder), image_size, patch_size)
    return sum(p.numel() for p in enc.parameters())


# ----------------------------------------------------------------------------------------- FLOPs


Shape = tuple[int, ...]


def _cpu_flash_forward(query: Shape, key: Shape, value: Shape, *args: object, **kwargs: object) -> int:
    return sdpa_flop_count(query, key, value)  # [b, h, s, d]: QKᵀ and PV, 2 · 2·b·h·s²·d


def _cpu_flash_backward(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args: object, **kwargs: object) -> int:
    return 2 * sdpa_flop_count(query, key, value)  # model FLOPs: the recomputed QKᵀ is not counted


_ATEN = torch.ops.aten
FLOP_FORMULAS = {
    _ATEN._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def flop_counter() -> FlopCounterMode:
    """A silent FlopCounterMode that also knows the CPU flash-attention kernels."""
    return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)


@dataclass
class StepInputs:
    """Arguments of `world_model_loss` for one step (values irrelevant to counting)."""

    frames_BTCHW: torch.Tensor
    actions_BTK: torch.Tensor
    proprio_BTQ: torch.Tensor
    proprio_valid: int
    directions_DM: torch.Tensor
    sigreg_index: torch.Tensor | None
    probe_PCHW: torch.Tensor | None
    global_probe_PND: torch.Tensor | None


def step_inputs(model: WorldModel, shape: StepShape, embodiment: str, gen: torch.Generator | None = None) -> StepInputs:
    """Random inputs of the step's shapes on the model's device (uninitialised on meta)."""
    device = next(model.parameters()).device
    k = action_dim(model, embodiment)
    B, T, H, N, D = shape.batch, shape.frames, shape.image, shape.tokens, shape.width

    def rand(*size: int) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(size, device=device)
        return torch.randn(size, generator=gen).to(device)

    index = torch.arange(shape.sigreg_tokens, device=device) if B * T * N > shape.sigreg_tokens else None
    probe = rand(shape.probe, 3, H, H) if shape.probe else None
    global_probe = rand(shape.probe, N, D) if shape.probe else None
    q = model.predictor.proprio_dim
    return StepInputs(rand(B, T, 3, H, H), rand(B, T, k), rand(B, T, q), q, rand(D, shape.directions), index, probe, global_probe)


def step_loss(model: WorldModel, params: Params, inputs: StepInputs, embodiment: str) -> torch.Tensor:
    """`world_model_loss(...).total` of one step, exactly as `train_steps` calls it."""
    obj = params.objective
    return world_model_loss(
        model.encoder, model.predictor, model.action_heads[embodiment], inputs.frames_BTCHW, inputs.actions_BTK, inputs.proprio_BTQ,
        inputs.directions_DM, inputs.sigreg_index, proprio_valid=inputs.proprio_valid, proprio_weight=obj.proprio_weight,
        sigreg_weight=obj.sigreg_weight,
        anchor_weight=obj.anchor_weight, num_knots=obj.num_knots,
        t_max=obj.t_max, rollout_steps=obj.rollout_steps, sigreg_on=obj.sigreg_on, probe_PCHW=inputs.probe_PCHW,
        global_probe_PND=inputs.global_probe_PND,
    ).total


def count_step_flops(model: WorldModel, params: Params, inputs: StepInputs, embodiment: str) -> dict[str, int]:
    """Counted FLOPs of one forward and one backward of `world_model_loss` on `inputs`."""
    from lensemble.training import autocast_context

    device = next(model.parameters()).device
    with torch.device(device):  # tensors created inside the loss (knots, masks) follow the model
        with flop_counter() as fwd, autocast_context(params.train.precision):
            loss = step_loss(model, params, inputs, embodiment)
        with flop_counter() as bwd:
            loss.backward()
    f, b = fwd.get_total_flops(), bwd.get_total_flops()
    return {"forward": f, "backward": b, "total": f + b}


def step_flops(params: Params, anchor: bool | None = None) -> dict[str, int]:
    """Counted FLOPs per training step of `params`, on the meta device (any size, no compute)."""
    model = meta_model(params)
    embodiment = next(iter(model.action_heads))
    return count_step_flops(model, params, step_inputs(model, step_shape(params, anchor), embodiment), embodiment)


# ---------------------------------------------------------------------------------------- memory


def block_activation_bytes(seq: int, width: int, heads: int, working: int, mlp_ratio: float = 4.0) -> int:
    """Bytes one pre-norm `Block` saves for backward on one sequence of `seq` tokens.

    Residual stream fp32 (the fp32 positions / previous residual promote it under autocast), matmul
    tensors in the working dtype:
      2 LayerNorm inputs (fp32)                                    2 · S·D · 4
      qkv input, qkv output (q, k, v share it), attention output,
      fc1 input                                                    6 · S·D · w
      GELU input, fc2 input                                        2 · S·F · w
      LayerNorm mean/rstd (2 norms), attention logsumexp (fp32)    (4 + heads) · S · 4
    The attention output is saved in [S, heads, D/heads] order, so the proj input is a view of it.
    """
    hidden = int(width * mlp_ratio)
    return seq * width * (2 * FP32 + 6 * working) + 2 * seq * hidden * working + (4 + heads) * seq * FP32


def encoder_activation_bytes(s: StepShape, frames: int) -> int:
    """One encoder pass over `frames` single frames: blocks, final norm, its output z (kept as target)."""
    per_frame = s.depth * block_activation_bytes(s.tokens, s.width, s.heads, s.working_bytes)
    per_frame += 2 * s.tokens * s.width * FP32 + 2 * s.tokens * FP32  # final norm input + output z, stats
    cast = frames * 3 * s.image**2 * s.working_bytes if s.working_bytes != FP32 else 0  # bf16 patch input
    return frames * per_frame + cast


def predictor_activation_bytes(s: StepShape, steps: int) -> int:
    """One block-causal predictor pass over `steps` time steps of B sequences (N frame tokens, one proprio
    and one action token each), with its MSE inputs; no mask for a single step."""
    seq = steps * (s.tokens + 2)
    blocks = s.batch * s.pred_depth * block_activation_bytes(seq, s.pred_width, s.pred_heads, s.working_bytes)
    mask = s.pred_depth * seq * seq * s.working_bytes if steps > 1 else 0  # the boolean mask, made additive per block
    rows, step_rows = s.batch * steps * s.tokens, s.batch * steps
    io = (rows * s.width + step_rows * (s.action_embed + s.proprio)) * s.working_bytes  # inp, act, proprio_in inputs
    io += s.batch * seq * s.pred_width * FP32 + s.batch * seq * 2 * FP32  # final norm input, stats
    io += (rows + step_rows) * s.pred_width * s.working_bytes  # out and proprio_out inputs
    io += (rows * s.width + step_rows * s.proprio) * FP32  # residual predictions (fp32 for MSE)
    return blocks + mask + io


def cached_step_activation_bytes(s: StepShape, total_steps: int) -> int:
    """One cached rollout step: a one-step pass whose attention also reads the cached keys/values; the
    concatenated keys and values of all `total_steps` steps are new tensors every block saves."""
    kv = s.pred_depth * s.batch * 2 * total_steps * (s.tokens + 2) * s.pred_width * s.working_bytes
    return predictor_activation_bytes(s, 1) + kv


def sigreg_activation_bytes(s: StepShape) -> int:
    """Tested embeddings [n, D] (gathered or pooled) and projections times knots [n, M, K] (cos, sin)."""
    return s.sigreg_tokens * s.width * FP32 + s.sigreg_tokens * s.directions * s.knots * FP32


def activation_bytes(s: StepShape) -> dict[str, int]:
    """Saved-for-backward bytes of one step, by term (shape formula; see the functions above)."""
    # the rollout term: k − 1 cached steps (its context pass is the teacher-forced pass, `prediction_loss`)
    context = s.frames - s.rollout
    rollout = 0
    if s.rollout:  # + the k stacked predictions the rollout MSE saves (fp32)
        rollout = sum(cached_step_activation_bytes(s, context + j) for j in range(1, s.rollout))
        rollout += s.batch * s.rollout * (s.tokens * s.width + s.proprio) * FP32
    terms = {
        "encoder": encoder_activation_bytes(s, s.batch * s.frames),
        "predictor": predictor_activation_bytes(s, s.frames - 1) + rollout,
        "sigreg": sigreg_activation_bytes(s),
        "anchor": encoder_activation_bytes(s, s.probe) if s.probe else 0,
    }
    if s.probe and s.working_bytes == FP32:
        # the anchor shares the encoder pass: the patch conv saves the concatenated batch + probe frames
        # (under autocast it saves the bf16 cast, already counted in encoder_activation_bytes)
        terms["anchor"] += (s.batch * s.frames + s.probe) * 3 * s.image**2 * FP32
    terms["total"] = sum(terms.values())
    return terms


def input_bytes(s: StepShape, action_dim: int) -> int:
    """The step's batch: frames, actions and padded proprio (fp32), and the probe batch with its global embeddings."""
    frame = 3 * s.image**2 * FP32
    batch = s.batch * s.frames * (frame + (action_dim + s.proprio) * FP32)
    return batch + s.probe * (frame + s.tokens * s.width * FP32)


def memory_estimate(params: Params, num_params: int, anchor: bool | None = None, action_dim: int = 2) -> dict[str, int]:
    """Estimated peak bytes of a training step, by term (see the module docstring); K = `action_dim`."""
    s = step_shape(params, anchor)
    terms = {
        "master_fp32": FP32 * num_params,
        "working_bf16": 2 * num_params if s.precision == "bf16" else 0,
        "gradients": FP32 * num_params,
        "adamw_moments": 2 * FP32 * num_params,
        "activations": activation_bytes(s)["total"],
        "inputs": input_bytes(s, action_dim),
    }
    terms["total"] = sum(terms.values())
    return terms


# ------------------------------------------------------------------------------ measured activations


@contextlib.contextmanager
def saved_tensor_bytes(model: torch.nn.Module, inputs: tuple[torch.Tensor | None, ...] = ()) -> Iterator[dict[str, int]]:
    """Measure what autograd saves for backward inside the block, in distinct storages.

    Yields a dict filled on exit: `activations` (everything else), `working_copy` (autocast's casts
    of parameters), `params` and `inputs` (saved references to existing tensors, no new memory).
    """
    param_ids = {id(p.untyped_storage()) for p in model.parameters()}
    input_ids = {id(t.untyped_storage()) for t in inputs if t is not None}
    seen: dict[int, tuple[str, torch.UntypedStorage]] = {}  # holding the storage keeps its id unique
    result = {"activations": 0, "working_copy": 0, "params": 0, "inputs": 0}

    def kind(t: torch.Tensor, key: int) -> str:
        if key in param_ids:
            return "params"
        if key in input_ids:
            return "inputs"
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            nxt = fn.next_functions[0][0] if fn.next_functions else None
            if nxt is not None and type(nxt).__name__ == "AccumulateGrad":
                return "working_copy"
        return "activations"

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in seen:
            seen[key] = (kind(t, key), storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    for name, storage in seen.values():
        result[name] += storage.nbytes()


# ------------------------------------------------------------------------------------------ summary


def compute_summary(params: Params, anchor: bool | None = None) -> dict:
    """Parameter counts, counted FLOPs and the memory estimate of one step, as a plain dict.

    The step trains the first embodiment's action head (sorted order); heads differ only in K.
    """
    model = meta_model(params)
    counts = param_counts(model)
    embodiment = next(iter(model.action_heads))
    shape = step_shape(params, anchor)
    flops = count_step_flops(model, params, step_inputs(model, shape, embodiment), embodiment)
    memory = memory_estimate(params, counts["total"], anchor, action_dim(model, embodiment))
    return {
        "step": asdict(shape),
        "params": counts,
        "flops_per_step": flops,
        "memory_bytes": memory,
        "memory_estimate_gib": memory["total"] / GIB,
    }

