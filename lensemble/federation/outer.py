"""The aggregator's half of a DiLoCo round: Δ̄ from the transport, then the outer Nesterov step.

`nesterov_step` reproduces `torch.optim.SGD(lr, momentum, nesterov=True, dampening=0)` bit for bit:
with gradient g = −Δ̄, buf ← g on the first step and buf ← momentum·buf + g after; the update is
p ← p − lr·(g + momentum·buf). The same tensor ops, in the same order, as PyTorch's single-tensor
implementation. It is the readable reference.

`aggregate_and_step` is the production path. It fuses averaging and the outer step: for each chunk
of `chunk` parameters it has the transport compute Δ̄ on that slice alone (`Transport.mean_into`),
then applies the step, so Δ̄ never exists as a whole vector and every chunk's working set stays in
cache: the memory traffic is one read of the C payloads, of the params and of the buffer, and one
write of both results. The step's ops on a slice are

    buf' = momentum·buf − Δ̄                 (first step: buf' = −Δ̄)
    r    = Δ̄ − momentum·buf'                (= −(g + momentum·buf'), negation is exact)
    p'   = p + lr·r                         (= p − lr·(g + momentum·buf'))

which are PyTorch's ops with the signs moved: IEEE rounding is symmetric under negation and
torch's `add(alpha)` fuses the multiply-add the same way at every length (its vector and tail
loops agree), so p' and buf' equal `nesterov_step`'s bit for bit (tests/test_outer.py).

Where the transport has a native kernel (`Transport.fused_kernel`: secure_int8 on the 16-bit ring,
`native.py`), one C pass per chunk does the sum and the step with the same roundings; otherwise the
eager NumPy/torch ops above run. Both give the bits of `nesterov_step`.

INV-AGG-DETERMINISM: every chunk (eager path) or 4096-element tile (native kernel) is evaluated
twice from the same inputs — transport sum and step — while it is in cache, and the two results
are compared bit for bit; on a mismatch `NonDeterministicAggregation` names the tensor and range. Inputs are never modified, so the round
can abort and recompute (the Prefect task retries once).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

from lensemble.errors import NonDeterministicAggregation
from lensemble.federation import native
from lensemble.federation.transport import Accepted, RoundContext, Transport

State = dict[str, torch.Tensor]
DEFAULT_CHUNK = 1 << 18
"""Parameters per fused chunk: 1 MiB of fp32, so one chunk's working set sits in L2/L3."""


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


def outer_step_chunk(
    transport: Transport, ctx: RoundContext, accepted: Accepted, start: int, p_n: torch.Tensor,
    m_n: torch.Tensor | None, scratch_n: torch.Tensor, new_p_n: torch.Tensor, new_m_n: torch.Tensor, lr: float,
    momentum: float,
) -> None:
    """Δ̄ on one slice into `scratch_n`, then the outer step on that slice into new_p_n, new_m_n.

    One evaluation of the eager path; `apply_outer_step` runs it twice per chunk (its self-check),
    and the wire benchmark (`benchmarks/wire.py`) times it alone. `start` is an offset into the wire's vector.
    """
    transport.mean_into(ctx, accepted, start, scratch_n.numpy())
    step_from_mean(scratch_n, p_n, m_n, new_p_n, new_m_n, lr, momentum)


def step_from_mean(q_n: torch.Tensor, p_n: torch.Tensor, m_n: torch.Tensor | None, new_p_n: torch.Tensor, new_m_n: torch.Tensor,
                   lr: float, momentum: float) -> None:
    """The outer step on one slice given Δ̄ there in `q_n` (which it overwrites): the ops of the module docstring."""
    scratch_n, q_n, new_m = q_n, q_n.numpy(), new_m_n.numpy()
    if m_n is None:
        np.negative(q_n, out=new_m)
    else:  # two roundings, as torch's mul_ then add_: NumPy's ufuncs have less call overhead
        np.subtract(np.multiply(m_n.numpy(), np.float32(momentum), out=new_m), q_n, out=new_m)
    torch.sub(scratch_n, new_m_n, alpha=momentum, out=scratch_n)
    torch.add(p_n, scratch_n, alpha=lr, out=new_p_n)


def _chunk_ranges(numel: int, chunk: int, split: int) -> list[tuple[int, int]]:
    """[a, b) slices of a tensor of `numel` elements, at most `chunk` long, none straddling `split`."""
    cuts = sorted({*range(0, numel, chunk), *([split] if 0 < split < numel else []), numel})
    return list(zip(cuts[:-1], cuts[1:]))


def _same_bits(a_n: torch.Tensor, b_n: torch.Tensor) -> bool:
    return bool(np.array_equal(a_n.numpy().view(np.uint32), b_n.numpy().view(np.uint32)))


def apply_outer_step(
    ctx: RoundContext,
    transport: Transport,
    accepted: Accepted,
    params: Mapping[str, torch.Tensor],
    momentum_buf: Mapping[str, torch.Tensor] | None,
    lr: float,
    momentum: float,
    *,
    out: tuple[State, State] | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[State, State]:
    """Fused average + outer step over verified updates, self-checked chunk by chunk (module docstring).

    `out` = (params, buffer) dicts to write into — a long-running aggregator passes the buffers of
    the round before last, which saves page-faulting fresh memory every round; they must not alias
    the inputs. Without it, new tensors are allocated. Params and buffer must be contiguous fp32.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of parameters, got {chunk}")
    if out is None:
        out = ({name: torch.empty_like(params[name]) for name, _ in ctx.spec},
               {name: torch.empty_like(params[name]) for name, _ in ctx.spec})
    new_params, new_buf = out
    scratch = [torch.empty(chunk, dtype=torch.float32) for _ in range(3)]  # Δ̄, and the re-evaluation's buf, p
    kernel = transport.fused_kernel(ctx, accepted, lr, momentum)
    # the round's frozen prefix takes Δ̄ = 0 whatever the wire says: its whole blocks are not on it, and any codes a
    # site put on the few frozen elements of the block it shares with the first learning tensor are ignored
    wire_start = transport.wire_start(ctx)
    offset = 0
    for name, shape in ctx.spec:
        p_N = params[name]
        if p_N.dtype != torch.float32 or not p_N.is_contiguous() or tuple(p_N.shape) != shape:
            raise ValueError(f"outer step: {name} must be a contiguous fp32 tensor of shape {shape}")
        for dst in (new_params[name], new_buf[name]):
            if dst.data_ptr() == p_N.data_ptr() or (momentum_buf is not None and dst.data_ptr() == momentum_buf[name].data_ptr()):
                raise ValueError(f"outer step: the output for {name} aliases an input; inputs must stay untouched")
        p_N, new_p_N, new_m_N = p_N.view(-1), new_params[name].view(-1), new_buf[name].view(-1)
        m_N = None if momentum_buf is None else momentum_buf[name].contiguous().view(-1)
        for a, b in _chunk_ranges(p_N.numel(), chunk, ctx.frozen - offset):
            m_n = None if m_N is None else m_N[a:b]
            q_n, check_m_n, check_p_n = (t[: b - a] for t in scratch)
            if offset + a < ctx.frozen:  # a frozen slice: the step with Δ̄ = 0, the eager ops' bits (which the kernel shares)
                for new_p_n, new_m_n in ((new_p_N[a:b], new_m_N[a:b]), (check_p_n, check_m_n)):
                    step_from_mean(q_n.zero_(), p_N[a:b], m_n, new_p_n, new_m_n, lr, momentum)
                consistent = _same_bits(new_p_N[a:b], check_p_n) and _same_bits(new_m_N[a:b], check_m_n)
                where = f"{name}[{a}:{b}]"
            elif kernel is not None:  # evaluates every tile twice itself
                bad = kernel(offset + a - wire_start, p_N[a:b], m_n, new_p_N[a:b], new_m_N[a:b])
                consistent, where = bad < 0, f"{name}[{a + bad}:{min(b, a + bad + native.TILE)}]"
            else:
                start = offset + a - wire_start
                outer_step_chunk(transport, ctx, accepted, start, p_N[a:b], m_n, q_n, new_p_N[a:b], new_m_N[a:b], lr, momentum)
                outer_step_chunk(transport, ctx, accepted, start, p_N[a:b], m_n, q_n, check_p_n, check_m_n, lr, momentum)
                consistent = _same_bits(new_p_N[a:b], check_p_n) and _same_bits(new_m_N[a:b], check_m_n)
                where = f"{name}[{a}:{b}]"
            if not consistent:
                raise NonDeterministicAggregation(f"round {ctx.round_idx}: two evaluations of the outer step differ on {where}")
        offset += p_N.numel()
    return new_params, new_buf


def aggregate_and_step(
    ctx: RoundContext,
    transport: Transport,
    payloads: Mapping[str, bytes],
    params: Mapping[str, torch.Tensor],
    momentum_buf: Mapping[str, torch.Tensor] | None,
    lr: float,
    momentum: float,
    *,
    out: tuple[State, State] | None = None,
) -> tuple[State, State]:
    """Verify the round's payloads, then the fused, self-checked average + outer step: (params, buffer)."""
    return apply_outer_step(ctx, transport, transport.verify(ctx, payloads), params, momentum_buf, lr, momentum, out=out)
