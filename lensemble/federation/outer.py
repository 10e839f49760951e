"""The aggregator's half of a DiLoCo round: Δ̄ from the transport, then the outer Nesterov step.

`nesterov_step` reproduces `torch.optim.SGD(lr, momentum, nesterov=True, dampening=0)` bit for bit:
with gradient g = −Δ̄, buf ← g on the first step and buf ← momentum·buf + g after; the update is
p ← p − lr·(g + momentum·buf). The same tensor ops, in the same order, as PyTorch's single-tensor
implementation.

INV-AGG-DETERMINISM: `aggregate_and_step` evaluates the whole outer step twice from the same inputs
and compares the results' hashes; on mismatch it raises `NonDeterministicAggregation`.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from lensemble.errors import NonDeterministicAggregation
from lensemble.federation.transport import RoundContext, Transport

State = dict[str, torch.Tensor]


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, shapes, dtypes and raw bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def nesterov_step(
    params: Mapping[str, torch.Tensor], mean_delta: Mapping[str, torch.Tensor], momentum_buf: Mapping[str, torch.Tensor] | None, lr: float, momentum: float
) -> tuple[State, State]:
    """One outer step with gradient −Δ̄; returns (new params, new momentum buffer). Inputs are not modified."""
    new_params: State = {}
    new_buf: State = {}
    for name in sorted(params):
        grad = -mean_delta[name]
        if momentum_buf is None:
            buf = torch.clone(grad).detach()
        else:
            buf = momentum_buf[name].clone().mul_(momentum).add_(grad, alpha=1.0)
        step_grad = grad.add(buf, alpha=momentum)
        new_params[name] = params[name].clone().add_(step_grad, alpha=-lr)
        new_buf[name] = buf
    return new_params, new_buf


def aggregate_and_step(
    ctx: RoundContext,
    transport: Transport,
    payloads: Mapping[str, bytes],
    params: Mapping[str, torch.Tensor],
    momentum_buf: Mapping[str, torch.Tensor] | None,
    lr: float,
    momentum: float,
) -> tuple[State, State, State]:
    """Verify + average the payloads and take the outer step, twice; (params, buf, Δ̄) if both agree."""
    results = []
    for _ in range(2):
        mean_delta = transport.aggregate(ctx, payloads)
        new_params, new_buf = nesterov_step(params, mean_delta, momentum_buf, lr, momentum)
        results.append((state_hash(new_params), state_hash(new_buf), new_params, new_buf, mean_delta))
    if results[0][:2] != results[1][:2]:
        raise NonDeterministicAggregation(f"round {ctx.round_idx}: two evaluations of the outer step differ ({results[0][0][:12]} vs {results[1][0][:12]})")
    return results[0][2], results[0][3], results[0][4]
