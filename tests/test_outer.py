"""Outer step and deterministic aggregation (INV-AGG-DETERMINISM)."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from lensemble.errors import IntegrityError, NonDeterministicAggregation
from lensemble.federation import native, outer
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
    spec = (("encoder.w", (3000,)),)
    t = PlainFP32()
    ctx = _ctx(["a"], spec)
    payloads = {"a": t.encode(ctx, "a", {"encoder.w": torch.ones(3000)})}
    params = {"encoder.w": torch.zeros(3000)}
    calls = iter(range(100))
    real = outer.outer_step_chunk

    def flaky(*args):
        real(*args)
        if next(calls) == 3:  # the re-evaluation of the second chunk drifts by one ulp in one element
            new_p_n = args[7]
            new_p_n[5] = torch.nextafter(new_p_n[5], torch.tensor(1.0))

    monkeypatch.setattr(outer, "outer_step_chunk", flaky)
    with pytest.raises(NonDeterministicAggregation, match=r"encoder.w\[1000:2000\]"):
        outer.apply_outer_step(ctx, t, t.verify(ctx, payloads), params, None, 0.7, 0.9, chunk=1000)
    assert torch.equal(params["encoder.w"], torch.zeros(3000))  # inputs untouched: the round can recompute


def _transports():
    from lensemble.federation.secure_transport import Int8Transport, SecureInt8Transport

    return [PlainFP32(), Int8Transport(block=64), SecureInt8Transport(block=64), SecureInt8Transport(block=64, ring_bits=32)]


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("chunk", [1, 63, 1000, 1 << 18])
def test_fused_step_equals_aggregate_then_reference_step_bit_for_bit(index, chunk, kernel_path):
    # Chunks that split blocks and tensors anywhere, three rounds so momentum is None, then carried.
    transport = _transports()[index]
    gen = torch.Generator().manual_seed(11)
    params = {"a.w": torch.randn(3, 5, generator=gen), "b": torch.randn(1000, generator=gen), "c": torch.randn(2049, generator=gen)}
    spec, sites = param_spec(params), ("s0", "s1", "s2")
    ref_params, ref_buf, buf = params, None, None
    for r in range(3):
        ctx = RoundContext("run", r, sites, spec, {"s0": 0.5, "s1": 0.3, "s2": 0.2})
        deltas = {s: {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in params.items()} for s in sites}
        transport.begin_round(ctx)
        transport.agree(ctx, {s: transport.announce(ctx, s, deltas[s]) for s in sites})
        payloads = {s: transport.encode(ctx, s, deltas[s]) for s in sites}
        ref_params, ref_buf = nesterov_step(ref_params, transport.aggregate(ctx, payloads), ref_buf, lr=0.7, momentum=0.9)
        params, buf = outer.apply_outer_step(ctx, transport, transport.verify(ctx, payloads), params, buf, 0.7, 0.9, chunk=chunk)
        assert state_hash(params) == state_hash(ref_params) and state_hash(buf) == state_hash(ref_buf)


@pytest.mark.parametrize("num_sites", range(1, 11))
def test_secure_step_equals_the_reference_at_every_site_count(num_sites, kernel_path):
    # The native ring sum groups up to four bodies a pass (4 + 4 + 2 + 1 ...): every site count from 1 to 10
    # takes a different grouping, and every one must give the reference's bits. Codes near ±127 at every
    # site make the sums wrap the ring's 16 bits before the masks cancel.
    from lensemble.federation.secure_transport import SecureInt8Transport

    gen = torch.Generator().manual_seed(num_sites)
    numel = 2 * native.TILE + 77  # tiles and a ragged tail
    params = {"w": torch.randn(numel, generator=gen)}
    sites = tuple(f"s{i}" for i in range(num_sites))
    transport, buf, ref_params, ref_buf = SecureInt8Transport(block=64), None, params, None
    for r in range(2):
        ctx = RoundContext("run", r, sites, param_spec(params))
        deltas = {s: {"w": torch.randn(numel, generator=gen).sign() * 1e-2} for s in sites}
        transport.begin_round(ctx)
        transport.agree(ctx, {s: transport.announce(ctx, s, deltas[s]) for s in sites})
        payloads = {s: transport.encode(ctx, s, deltas[s]) for s in sites}
        ref_params, ref_buf = nesterov_step(ref_params, transport.aggregate(ctx, payloads), ref_buf, lr=0.7, momentum=0.9)
        params, buf = outer.apply_outer_step(ctx, transport, transport.verify(ctx, payloads), params, buf, 0.7, 0.9)
        assert state_hash(params) == state_hash(ref_params) and state_hash(buf) == state_hash(ref_buf)


def test_the_native_kernel_is_used_where_it_can_be_built_and_self_checks_every_tile():
    from lensemble.federation.secure_transport import SecureInt8Transport

    if native.load() is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    transport, sites = SecureInt8Transport(block=64), ("a", "b", "c")
    params = {"w": torch.zeros(3 * native.TILE + 5)}
    ctx = RoundContext("run", 0, sites, param_spec(params))
    deltas = {s: {"w": torch.full((3 * native.TILE + 5,), 1e-3 * (i + 1))} for i, s in enumerate(sites)}
    transport.begin_round(ctx)
    transport.agree(ctx, {s: transport.announce(ctx, s, deltas[s]) for s in sites})
    accepted = transport.verify(ctx, {s: transport.encode(ctx, s, deltas[s]) for s in sites})
    assert transport.fused_kernel(ctx, accepted, 0.7, 0.9) is not None
    fault = ctypes.c_int64.in_dll(native.load(), "lens_fault_at")
    fault.value = 2 * native.TILE  # the third tile's re-evaluation drifts by one ulp
    try:
        with pytest.raises(NonDeterministicAggregation, match=rf"w\[{2 * native.TILE}:{3 * native.TILE}\]"):
            outer.apply_outer_step(ctx, transport, accepted, params, None, 0.7, 0.9)
    finally:
        fault.value = -1
    assert torch.equal(params["w"], torch.zeros(3 * native.TILE + 5))
    outer.apply_outer_step(ctx, transport, accepted, params, None, 0.7, 0.9)  # recomputes cleanly


def test_outer_step_refuses_outputs_that_alias_its_inputs():
    spec = (("w", (4,)),)
    t = PlainFP32()
    ctx = _ctx(["a"], spec)
    accepted = t.verify(ctx, {"a": t.encode(ctx, "a", {"w": torch.ones(4)})})
    params = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match="aliases an input"):
        outer.apply_outer_step(ctx, t, accepted, params, None, 0.7, 0.9, out=(params, {"w": torch.empty(4)}))


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
