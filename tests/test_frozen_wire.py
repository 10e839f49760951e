"""A round whose encoder is frozen (`RoundContext.frozen`): the frozen prefix stays off the wire, bit for bit.

Every site's Δ over a frozen tensor is exactly 0, so sending it only costs bytes. With the prefix off the
wire the round must give the same parameters and momentum, bit for bit, as the round that sends the zeros
(every transport; the native and the eager aggregator), cost exactly the bytes `expected_comm_bytes`
says, and refuse a site whose frozen tensor moved, naming it. `round_frozen_prefix` reads the schedule.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.wire import native_disabled
from lensemble.config import parse_params
from lensemble.errors import IntegrityError
from lensemble.federation.dp import privatize
from lensemble.federation.outer import aggregate_and_step
from lensemble.federation.secure_transport import Int8Transport, SecureInt8Transport, expected_comm_bytes
from lensemble.federation.transport import PlainFP32, RoundContext, frozen_prefix, param_spec
from lensemble.federation.schedule import round_frozen_prefix

BLOCK = 64
SITES = ("s0", "s1", "s2")
# the encoder's 3 tensors hold 128 + 70 + 64 = 262 parameters: 4 whole blocks stay home, and encoder.c's last 6
# share the fifth block (256..319) with predictor.x, so they travel
SHAPES = {"encoder.a": (8, 16), "encoder.b": (70,), "encoder.c": (4, 4, 4), "predictor.x": (33, 9), "predictor.y": (130,)}


def _spec():
    return param_spec({k: torch.empty(s) for k, s in SHAPES.items()})


def _deltas(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {s: {k: (torch.zeros(shape) if k.startswith("encoder.") else torch.randn(shape, generator=gen) * 1e-2)
                for k, shape in SHAPES.items()} for s in SITES}


def _transport(name: str):
    if name == "fp32":
        return PlainFP32()
    if name == "int8":
        return Int8Transport(block=BLOCK)
    return SecureInt8Transport(block=BLOCK, outlier_factor=4.0)


def _round(name: str, frozen: int, deltas, params, momentum):
    """One whole round in one process: (new params, new momentum, payload bytes per site, setup + announcement bytes)."""
    t = _transport(name)
    ctx = RoundContext("run", 3, SITES, _spec(), frozen=frozen)
    setup = t.begin_round(ctx)
    announcements = {s: t.announce(ctx, s, deltas[s]) for s in SITES}
    t.agree(ctx, announcements)
    for s in SITES:
        t.accept_grid(ctx, t.grid_message(ctx))
    payloads = {s: t.encode(ctx, s, deltas[s]) for s in SITES}
    new_p, new_m = aggregate_and_step(ctx, t, payloads, params, momentum, lr=0.7, momentum=0.9)
    assert t.capped_blocks(ctx) == {}
    sent = {s: setup[s] + len(announcements[s]) + len(payloads[s]) for s in SITES}
    return new_p, new_m, sent


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def test_frozen_prefix_is_the_leading_encoder_tensors():
    spec = _spec()
    assert frozen_prefix(spec, lambda n: n.startswith("encoder.")) == 128 + 70 + 64
    assert frozen_prefix(spec, lambda n: n.startswith("predictor.")) == 0
    with pytest.raises(ValueError, match="tensor boundary"):
        RoundContext("run", 0, SITES, spec, frozen=100)


@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
@pytest.mark.parametrize("name", ["fp32", "int8", "secure_int8"])
def test_round_without_the_frozen_prefix_gives_the_same_bits_for_fewer_bytes(name, native):
    spec = _spec()
    frozen = frozen_prefix(spec, lambda n: n.startswith("encoder."))
    gen = torch.Generator().manual_seed(7)
    params = {k: torch.randn(shape, generator=gen) for k, shape in SHAPES.items()}
    momentum = {k: torch.randn(shape, generator=gen) * 1e-2 for k, shape in SHAPES.items()}
    for buf in (None, momentum):
        deltas = _deltas(11)
        if native:
            full, off = _round(name, 0, deltas, params, buf), _round(name, frozen, deltas, params, buf)
        else:
            with native_disabled():
                full, off = _round(name, 0, deltas, params, buf), _round(name, frozen, deltas, params, buf)
        assert _same(full[0], off[0]) and _same(full[1], off[1])
        # the frozen encoder still takes the step's momentum part, as the round that sends its zeros does
        if buf is not None:
            assert not torch.equal(off[0]["encoder.a"], params["encoder.a"])
        wire_start = frozen if name == "fp32" else frozen // BLOCK * BLOCK
        code_bytes = {"fp32": 4, "int8": 1, "secure_int8": 2}[name]
        scale_bytes = 0 if name == "fp32" else 4 * (math.ceil(sum(map(math.prod, SHAPES.values())) / BLOCK)
                                                   - math.ceil((sum(map(math.prod, SHAPES.values())) - wire_start) / BLOCK))
        for s in SITES:
            assert full[2][s] - off[2][s] == code_bytes * wire_start + scale_bytes, s
            assert off[2][s] == expected_comm_bytes(name, spec, len(SITES), run_id="run", round_idx=3, site=s, block=BLOCK,
                                                    frozen=frozen)["total"]


@pytest.mark.parametrize("name", ["fp32", "int8", "secure_int8"])
@pytest.mark.parametrize("where", ["encoder.a", "encoder.c"])
def test_a_site_that_moves_a_frozen_tensor_is_refused_by_name(name, where):
    """encoder.c's last element travels in the block it shares with predictor.x: it must still be exactly 0."""
    spec = _spec()
    t = _transport(name)
    ctx = RoundContext("run", 3, SITES, spec, frozen=frozen_prefix(spec, lambda n: n.startswith("encoder.")))
    t.begin_round(ctx)
    deltas = _deltas(3)
    deltas["s1"][where].view(-1)[-1] = 1e-6
    step = t.announce if name == "secure_int8" else t.encode
    with pytest.raises(IntegrityError, match=f"'s1' changes {where}, which is frozen in round 3") as info:
        step(ctx, "s1", deltas["s1"])
    assert info.value.site == "s1"


def test_a_frozen_payload_does_not_verify_in_an_unfrozen_round():
    """The prefix is bound into every header: an update cut for one layout is refused under the other."""
    spec = _spec()
    t = _transport("int8")
    frozen_ctx = RoundContext("run", 3, SITES, spec, frozen=frozen_prefix(spec, lambda n: n.startswith("encoder.")))
    t.begin_round(frozen_ctx)
    payloads = {s: t.encode(frozen_ctx, s, d) for s, d in _deltas(5).items()}
    with pytest.raises(IntegrityError, match="s0"):
        t.verify(RoundContext("run", 3, SITES, spec), payloads)


def test_dp_adds_no_noise_to_a_frozen_tensor():
    spec = _spec()
    ctx = RoundContext("run", 3, SITES, spec, frozen=frozen_prefix(spec, lambda n: n.startswith("encoder.")))
    noisy, _ = privatize(ctx, "s0", _deltas(1)["s0"], clip_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    assert all(not noisy[k].any() for k in SHAPES if k.startswith("encoder."))
    assert all(noisy[k].ne(_deltas(1)["s0"][k]).all() for k in SHAPES if k.startswith("predictor."))


def test_round_frozen_prefix_follows_the_encoder_schedule():
    """H = 25, 30 rounds, freeze at 0.25: the encoder learns through step 187, inside round 7; rounds 8.. are frozen."""
    raw = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())
    raw["federate"].update(rounds=30, inner_steps=25)
    raw["train"]["freeze_encoder_at"] = 0.25
    p = parse_params(raw)
    spec = _spec()
    prefix = frozen_prefix(spec, lambda n: n.startswith("encoder."))
    assert [round_frozen_prefix(p, spec, r) for r in (0, 7, 8, 29)] == [0, 0, prefix, prefix]
    raw["train"]["freeze_encoder_at"] = 1.0
    never = parse_params(raw)
    assert all(round_frozen_prefix(never, spec, r) == 0 for r in range(30))


def test_codes_on_the_frozen_elements_of_a_shared_block_move_nothing(monkeypatch):
    """encoder.c's last 6 elements share a block with predictor.x, so they travel (int8, secure_int8); a site
    that skips its own check and sends codes there still cannot move them: Δ̄ is 0 on the whole prefix."""
    from lensemble.federation import transport as transport_module

    spec = _spec()
    frozen = frozen_prefix(spec, lambda n: n.startswith("encoder."))
    assert (frozen, _transport("int8").wire_start(RoundContext("run", 3, SITES, spec, frozen=frozen))) == (262, 256)
    gen = torch.Generator().manual_seed(2)
    params = {k: torch.randn(shape, generator=gen) for k, shape in SHAPES.items()}
    honest = _deltas(4)
    t = _transport("int8")
    ctx = RoundContext("run", 3, SITES, spec, frozen=frozen)
    t.begin_round(ctx)
    reference = aggregate_and_step(ctx, t, {s: t.encode(ctx, s, honest[s]) for s in SITES}, params, None, lr=0.7, momentum=0.9)
    bad = {**honest, "s1": {**honest["s1"], "encoder.c": torch.full(SHAPES["encoder.c"], 0.5)}}
    monkeypatch.setattr(transport_module, "check_frozen", lambda *args: None)  # the malicious site's own check is gone
    t = _transport("int8")
    t.begin_round(ctx)
    attacked = aggregate_and_step(ctx, t, {s: t.encode(ctx, s, bad[s]) for s in SITES}, params, None, lr=0.7, momentum=0.9)
    for k in SHAPES:
        if k.startswith("encoder."):
            assert torch.equal(attacked[0][k], reference[0][k]) and torch.equal(attacked[0][k], params[k] * 1), k
    assert not torch.equal(attacked[0]["predictor.x"], reference[0]["predictor.x"])  # the block's scale did change
