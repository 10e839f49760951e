"""Intra-site data parallelism: one site's inner loop on torch.distributed (DDP; FSDP2 for large configs).

Launched with `torchrun` (see scripts/ddp_train.py); every rank runs `ddp_train_steps` on the same
model, and the result equals single-process `lensemble.training.train_steps` on the same global
batch up to floating-point summation order:

- Batch. Every rank draws the whole global batch of B windows from the same seeded generator, with
  the same calls in the same order as `train_steps`, and keeps rows [r·B/W, (r+1)·B/W). The union of
  the shards is the single-process batch; B must be divisible by the world size W.
- L_pred is a mean over equal shards, so the mean of the W shard losses is the global loss, and
  DDP's gradient average (all-reduce sum / W) is the global-mean gradient.
- SIGReg is NOT a per-sample mean: the Epps–Pulley statistic of a shard is not 1/W of that of the
  batch, so computing it per rank would change the objective. The embeddings are all-gathered with
  an autograd-aware all-gather (`gather_rows`) into the global [B, T, N, D] in rank order, i.e. the
  single-process batch order; every rank computes the same SIGReg on the same seeded token subset.
  The all-gather's backward sums the W identical gradients that reach each shard, and DDP's 1/W
  average cancels that factor: the SIGReg gradient is exactly the single-process one.
- L_anchor: the probe batch is not sharded; every rank computes the same anchor term, so the
  average of W identical gradients is that gradient. (Redundant work, cheap at probe_batch sizes.)

FSDP2 (`shard_fsdp`) shards parameters, gradients and AdamW moments across the ranks; its gradient
reduce-scatter also averages, so the same argument holds. `full_state` / `load_optimizer_state`
convert between a sharded model + optimizer and the single-process state dicts that
`tasks.train.site_train` saves, so a site can switch between the two between rounds.

The match is to fp tolerance, not bitwise: the shard gradients are summed in a different order.
With a `schedule`, the learning rate and the encoder's freeze (train.freeze_encoder_at) follow it as in
`train_steps`; DDP fixes its reduced parameters at wrap time, so the steps after the freeze get a wrap of their own.

Shape legend: B global batch, b = B/W per-rank batch, T frames, N tokens, D latent width,
K action dim, P probe frames.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lensemble.config import ObjectiveParams, TrainParams
from lensemble.data.windows import WindowSampler
from lensemble.errors import ConfigError
from lensemble.model.world_model import WorldModel
from lensemble.objectives.losses import LossTerms, anchor_loss, copy_error, prediction_loss, sigreg_tokens, weighted_total
from lensemble.objectives.sigreg import sigreg
from lensemble.training import PredBalance, StepDraws, StepLog, autocast_context, encoder_learns, scheduled_lr, set_trainable


def shard_rows(x_B: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows [rank·B/W, (rank+1)·B/W) of a global batch; ConfigError unless W divides B."""
    B = x_B.shape[0]
    if B % world_size:
        raise ConfigError(f"train.batch_size ({B}) must be divisible by the data-parallel world size ({world_size})")
    b = B // world_size
    return x_B[rank * b : (rank + 1) * b]


def gather_rows(x_b: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's shard concatenated in rank order, [W·b, ...]; differentiable, the backward sums
    the gradients of all ranks for each shard (a reduce-scatter).

    `all_gather_single` is what torch 2.13 names as the successor of the deprecated
    `torch.distributed.nn.functional.all_gather`; it works on gloo and NCCL.
    """
    return funcol.all_gather_single(x_b.contiguous(), 0, group)


def sharded_world_model_loss(
    encoder: nn.Module,
    predictor: nn.Module,
    head: nn.Module,
    frames_bTCHW: torch.Tensor,
    actions_bTK: torch.Tensor,
    proprio_bTQ: torch.Tensor,
    proprio_valid: int,
    directions_DM: torch.Tensor,
    sigreg_index: torch.Tensor | None,
    objective: ObjectiveParams,
    group: dist.ProcessGroup,
    probe_PCHW: torch.Tensor | None = None,
    global_probe_PND: torch.Tensor | None = None,
    pred_weight: float = 1.0,
) -> LossTerms:
    """`world_model_loss` on this rank's shard, with SIGReg on the all-gathered global embeddings.

    Same terms and weights as `lensemble.objectives.losses.world_model_loss`; only the token set
    SIGReg sees differs (global instead of local), see the module docstring.
    """
    z = encoder(frames_bTCHW)  # [b, T, N, D]
    pred, prop = prediction_loss(predictor, z, proprio_bTQ, head(actions_bTK), objective.rollout_steps, proprio_valid)
    z_all = gather_rows(z, group)  # [B, T, N, D]
    reg = sigreg(sigreg_tokens(z_all, objective.sigreg_on, sigreg_index), directions_DM, objective.num_knots, objective.t_max)
    if probe_PCHW is not None and global_probe_PND is not None and objective.anchor_weight > 0:
        anc = anchor_loss(encoder, probe_PCHW, global_probe_PND)
    else:
        anc = torch.zeros((), dtype=pred.dtype)
    total = weighted_total(pred, prop, reg, anc, pred_weight, objective.proprio_weight, objective.sigreg_weight, objective.anchor_weight)
    return LossTerms(total, pred.detach(), prop.detach(), reg.detach(), anc.detach(), copy_error(z_all))  # the global batch's


class SiteLoss(nn.Module):
    """The modules one site's loss uses (encoder, predictor, its embodiments' heads), as one module.

    DDP needs the forward to go through the wrapped module; holding only the heads that are used
    keeps every wrapped parameter used, so DDP needs no unused-parameter search with one embodiment.
    """

    def __init__(self, model: WorldModel, embodiments: Sequence[str]) -> None:
        super().__init__()
        self.encoder = model.encoder
        self.predictor = model.predictor
        self.heads = nn.ModuleDict({e: model.action_heads[e] for e in sorted(set(embodiments))})

    def forward(self, embodiment: str, frames_bTCHW, actions_bTK, proprio_bTQ, proprio_valid: int, directions_DM, sigreg_index,
                objective: ObjectiveParams, group: dist.ProcessGroup, probe_PCHW=None, global_probe_PND=None,
                pred_weight: float = 1.0) -> LossTerms:
        return sharded_world_model_loss(self.encoder, self.predictor, self.heads[embodiment], frames_bTCHW, actions_bTK, proprio_bTQ,
                                        proprio_valid, directions_DM, sigreg_index, objective, group, probe_PCHW, global_probe_PND,
                                        pred_weight)


def shard_fsdp(model: WorldModel, mesh=None) -> WorldModel:
    """FSDP2 (`fully_shard`) over the world model, in place: each transformer block, then the encoder,
    the predictor and every action head as units. Build the optimizer after this call.

    WorldModel has no forward of its own, so it is not a unit; every parameter lives in one of the
    units above, which keeps every parameter a DTensor (one optimizer over one tensor kind).
    `mesh` defaults to every rank on CPU (gloo), where the inner loop runs today; on GPUs pass a
    CUDA mesh and move the model and batches to the device first (not wired in this codebase yet).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in [*model.encoder.blocks, *model.predictor.blocks]:
        fully_shard(block, mesh=mesh)
    for unit in [model.encoder, model.predictor, *model.action_heads.values()]:
        fully_shard(unit, mesh=mesh)
    return model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def ddp_train_steps(
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
    group: dist.ProcessGroup | None = None,
    schedule: tuple[int, int] | None = None,
) -> StepLog:
    """`train_steps`, data-parallel over the ranks of `group` (default: the world); call on every rank.

    `schedule` (offset, total) as in `train_steps`: the scheduled learning rate, and the encoder frozen where
    `encoder_learns` says so. DDP fixes at wrap time which parameters it reduces, so a call whose steps
    straddle the freeze step wraps twice: the steps before it with the encoder, the steps after without.

    `model` is a plain WorldModel (wrapped in DDP here; identical on every rank, DDP broadcasts
    rank 0's parameters at wrap time) or one already sharded by `shard_fsdp` (then `optimizer` must
    have been built after sharding). Same arguments, seeds and draw order as `train_steps`. Returns
    the same StepLog on every rank: L_pred averaged over the shards (= the global-batch L_pred),
    SIGReg and anchor as computed (identical on every rank).
    """
    if schedule is not None and schedule[0] + steps > schedule[1]:
        raise ValueError(f"steps {schedule[0]}..{schedule[0] + steps - 1} run past the {schedule[1]}-step schedule")
    split = steps
    if schedule is not None:  # the first step of this call at which the encoder no longer learns
        split = next((s for s in range(steps) if not encoder_learns(train, schedule[0] + s, schedule[1])), steps)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # SIGReg's all-gather runs inside backward while DDP all-reduces gradient buckets: its own group
    # keeps the two streams of collectives from interleaving on one communicator
    gather_group = dist.new_group(dist.get_process_group_ranks(group) if group is not None else None, backend=dist.get_backend(group))
    model.train()
    log = StepLog()
    draws = StepDraws(run_seed, round_idx, data_key)  # the same draws as train_steps, on every rank
    balance = PredBalance(objective.pred_balance, [e for e, _ in samplers])
    on_entry = [p.requires_grad for p in model.encoder.parameters()]
    try:
        for first, stop, learns in ((0, split, True), (split, steps, False)):
            if first == stop:
                continue
            if not learns:
                set_trainable(model.encoder, False)
            loss_module: nn.Module = SiteLoss(model, [e for e, _ in samplers])
            if not is_fsdp(model):
                loss_module = DistributedDataParallel(loss_module, process_group=group, find_unused_parameters=len(loss_module.heads) > 1)
            for step in range(first, stop):
                embodiment, sampler, frames, actions, proprio, directions, sig_index, probe, global_probe = draws.draw(
                    step, samplers, model, train, objective, probe_PCHW, global_probe_PND)
                with autocast_context(train.precision):
                    terms = loss_module(embodiment, shard_rows(frames, rank, world), shard_rows(actions, rank, world),
                                        shard_rows(proprio, rank, world), sampler.proprio_valid, directions, sig_index, objective, gather_group,
                                        probe, global_probe, balance.weight(embodiment))
                if schedule is not None:
                    for g in optimizer.param_groups:
                        g["lr"] = scheduled_lr(train, schedule[0] + step, schedule[1])
                optimizer.zero_grad(set_to_none=True)
                terms.total.backward()
                optimizer.step()
                balance.update(embodiment, terms.copy)  # the global batch's copy error: the same weights on every rank
                log.pred.append(float(terms.pred))
                log.proprio.append(float(terms.proprio))
                log.sigreg.append(float(terms.sigreg))
                log.anchor.append(float(terms.anchor))
    finally:
        for p, flag in zip(model.encoder.parameters(), on_entry):
            p.requires_grad_(flag)
    pred = torch.tensor(log.pred, dtype=torch.float64)
    dist.all_reduce(pred, group=group)  # one collective for the whole log, not one per step
    log.pred = (pred / world).tolist()
    dist.destroy_process_group(gather_group)
    return log


# ---------------------------------------------------------------- state in site_train's format
# FSDP2 keeps parameters and AdamW moments as DTensors sharded on dim 0. These two functions convert
# to and from plain single-process state dicts directly (full_tensor / distribute_tensor), not through
# torch.distributed.checkpoint.state_dict: that path re-keys the optimizer by name and, on load,
# initialises AdamW state for every parameter (a zero-grad step), which adds state entries for
# parameters this site never trains (other embodiments' heads) that single-process training lacks.


def _full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state(model: WorldModel, optimizer: torch.optim.Optimizer) -> dict:
    """{"model", "optimizer"} as single-process state dicts, `tasks.train.site_train`'s format.

    FSDP: a collective (every rank must call it) and every rank gets the full tensors.
    """
    msd = {n: _full(t) for n, t in model.state_dict().items()}
    osd = optimizer.state_dict()
    osd = {"state": {i: {k: _full(v) for k, v in st.items()} for i, st in osd["state"].items()}, "param_groups": osd["param_groups"]}
    return {"model": msd, "optimizer": osd}


def load_optimizer_state(model: WorldModel, optimizer: torch.optim.Optimizer, osd: Mapping) -> None:
    """Load a single-process AdamW state dict into the optimizer of a plain or FSDP-sharded model.

    Load model values before sharding (`model.load_state_dict`, `load_federated` on the plain model);
    the optimizer only exists after sharding, so its state comes in through this. FSDP: a
    collective; every rank passes the same full state and keeps its shard of each moment.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in optimizer.param_groups for p in g["params"]]

    def shard_like(value, param):
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
            return distribute_tensor(value, param.device_mesh, param.placements)
        return value  # AdamW's scalar `step`, or a plain parameter's state

    osd = {"state": {i: {k: shard_like(v, params[i]) for k, v in st.items()} for i, st in osd["state"].items()}, "param_groups": osd["param_groups"]}
    optimizer.load_state_dict(osd)
