"""Outer step and deterministic aggregation (INV-AGG-DETERMINISM)."""
from __future__ import annotations

import random

import pytest
import torch

from lensemble.errors import IntegrityError, NonDeterministicAggregation
from lensemble.federation import outer
from lensemble.federation.outer import aggregate_and_step, nesterov_step, state_hash
from lensemble.federation.transport import PlainFP32, RoundContext, param_spec


def _state(gen: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"encoder.w": torch.randn(7, 5, generator=gen) * scale, "predictor.b": torch.randn(11, generator=gen) * scale}


@pytest.mark.parametrize("foreach", [False, True])
def test_nesterov_step_matches_torch_sgd_bit_for_bit(foreach):
    gen = torch.Generator().manual_seed(0)
    params = _state(gen)
    torch_params = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.SGD(list(torch_params.values()), lr=0.7, momentum=0.9, nesterov=True, foreach=foreach)
    buf = None
    for _ in range(5):
        delta = _state(gen, 0.01)
        params, buf = nesterov_step(params, delta, buf, lr=0.7, momentum=0.9)
        for k, p in torch_params.items():
            p.grad = -delta[k]
        opt.step()
        for k in params:
            assert torch.equal(params[k], torch_params[k].detach()), k


def _ctx(sites, spec, round_idx=0):
    return RoundContext("run", round_idx, tuple(sorted(sites)), spec)


def test_fp32_aggregate_is_fp64_mean_in_site_order_and_arrival_independent():
    gen = torch.Generator().manual_seed(1)
    sites = [f"s{i}" for i in range(5)]
    deltas = {s: _state(gen, 1e-3) for s in sites}
    spec = param_spec(deltas["s0"])
    t = PlainFP32()
    ctx = _ctx(sites, spec)
    payloads = {s: t.encode(ctx, s, deltas[s]) for s in sites}
    expected = {k: sum(deltas[s][k].double() for s in sorted(sites)).div(5).float() for k in deltas["s0"]}
    hashes = set()
    for trial in range(4):
        order = sites[:]
        random.Random(trial).shuffle(order)
        mean = t.aggregate(ctx, {s: payloads[s] for s in order})
        hashes.add(state_hash(mean))
    assert len(hashes) == 1
    mean = t.aggregate(ctx, payloads)
    for k in mean:
        assert torch.allclose(mean[k], expected[k], atol=0, rtol=1e-7)


def test_fp32_payload_bytes_equal_formula():
    spec = (("encoder.w", (7, 5)), ("predictor.b", (11,)))
    t = PlainFP32()
    ctx = _ctx(["a", "b"], spec)
    payload = t.encode(ctx, "a", {"encoder.w": torch.zeros(7, 5), "predictor.b": torch.zeros(11)})
    header_len = int.from_bytes(payload[:4], "little")
    assert len(payload) == 4 + header_len + 4 * (35 + 11)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p[:-4], "body bytes"),
        (lambda p: p[:2], "truncated"),
        (lambda p: p.replace(b'"round":0', b'"round":1'), "bound to"),
    ],
)
def test_fp32_rejects_malformed_payloads(mutate, message):
    spec = (("encoder.w", (2, 2)),)
    t = PlainFP32()
    ctx = _ctx(["a"], spec)
    payload = t.encode(ctx, "a", {"encoder.w": torch.ones(2, 2)})
    with pytest.raises(IntegrityError, match=message):
        t.aggregate(ctx, {"a": mutate(payload)})


def test_encode_rejects_nan_wrong_shape_and_unknown_site():
    spec = (("encoder.w", (2, 2)),)
    t = PlainFP32()
    ctx = _ctx(["a"], spec)
    with pytest.raises(IntegrityError, match="NaN"):
        t.encode(ctx, "a", {"encoder.w": torch.tensor([[1.0, float("nan")], [0, 0]])})
    with pytest.raises(IntegrityError, match="shape"):
        t.encode(ctx, "a", {"encoder.w": torch.ones(3)})
    with pytest.raises(IntegrityError, match="not in the federation"):
        t.encode(ctx, "zz", {"encoder.w": torch.ones(2, 2)})


def test_outer_step_self_check_raises_on_nondeterminism(monkeypatch):
    spec = (("encoder.w", (3,)),)
    t = PlainFP32()
    ctx = _ctx(["a"], spec)
    payloads = {"a": t.encode(ctx, "a", {"encoder.w": torch.ones(3)})}
    params = {"encoder.w": torch.zeros(3)}
    calls = iter(range(100))
    real = outer.nesterov_step

    def flaky(p, d, b, lr, momentum):
        new_p, new_b = real(p, d, b, lr, momentum)
        if next(calls) % 2:
            new_p = {k: v + 1e-7 for k, v in new_p.items()}
        return new_p, new_b

    monkeypatch.setattr(outer, "nesterov_step", flaky)
    with pytest.raises(NonDeterministicAggregation):
        aggregate_and_step(ctx, t, payloads, params, None, 0.7, 0.9)


def test_two_aggregations_are_bitwise_identical():
    gen = torch.Generator().manual_seed(3)
    sites = ["a", "b", "c"]
    deltas = {s: _state(gen, 1e-2) for s in sites}
    spec = param_spec(deltas["a"])
    params = _state(gen)
    t = PlainFP32()
    ctx = _ctx(sites, spec)
    payloads = {s: t.encode(ctx, s, deltas[s]) for s in sites}
    a = aggregate_and_step(ctx, t, payloads, params, None, 0.7, 0.9)
    b = aggregate_and_step(ctx, t, dict(reversed(list(payloads.items()))), params, None, 0.7, 0.9)
    assert state_hash(a[0]) == state_hash(b[0]) and state_hash(a[1]) == state_hash(b[1])
