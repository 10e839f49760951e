"""CI perf smoke (spec 08 §7): one inner+outer cycle of the toy config under a generous ceiling,
exact comm bytes at fp32 and int8, bitwise determinism of the outer step, the int8 round-trip bound.

The ceiling: one cycle (2 sites × 3 inner steps, secure int8 exchange, outer step) measured at
~0.35 s on the 2-core CPU class; CEILING_S = 30 s is ~85× that, loose enough for a loaded CI runner,
tight enough to catch an order-of-magnitude regression (e.g. a per-step recomputation).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from lensemble.config import parse_params
from lensemble.data.episodes import generate_episodes
from lensemble.data.windows import WindowSampler
from lensemble.federation.outer import aggregate_and_step, state_hash
from lensemble.federation.quant import dequantize_int8, quantize_int8
from lensemble.federation.secure_transport import expected_comm_bytes
from lensemble.federation.transport import RoundContext, param_spec
from lensemble.federation.transports import make_transport
from lensemble.model.world_model import federated_state, load_federated
from lensemble.sim.registry import make_embodiment
from lensemble.training import make_optimizer, train_steps
from lensemble.workflow import build_model
from tests.conftest import micro_params

CEILING_S = 30.0


def _cycle(transport_name: str) -> tuple[dict, dict[str, int], float]:
    params = parse_params(micro_params())
    p = params
    sites = {"site_a": "grid_point", "site_b": "grid_thruster"}
    model = build_model(p, "federated")
    global_state = federated_state(model)
    spec = param_spec(global_state)
    transport = make_transport(transport_name)
    t0 = time.perf_counter()
    ctx = RoundContext("smoke", 0, tuple(sorted(sites)), spec)
    setup = transport.begin_round(ctx)
    deltas = {}
    for site, emb in sites.items():
        env = make_embodiment(emb, p.data.image_size)
        eps = generate_episodes(env, 0, site, 2, p.data.episode_length, 0.5, 0.3, 4)
        local = build_model(p, f"site/{site}")
        load_federated(local, global_state)
        train_steps(local, make_optimizer(local, p.train), [(emb, WindowSampler(eps, p.data.num_steps, p.model.proprio_dim))], p.federate.inner_steps,
                    train=p.train, objective=p.objective, run_seed=0, round_idx=0, data_key=site)
        state = federated_state(local)
        deltas[site] = {n: state[n] - global_state[n] for n in spec_names(spec)}
    ann = {s: transport.announce(ctx, s, d) for s, d in deltas.items()}
    transport.agree(ctx, ann)
    payloads = {s: transport.encode(ctx, s, d) for s, d in deltas.items()}
    new_params, _ = aggregate_and_step(ctx, transport, payloads, global_state, None, 0.7, 0.9)
    seconds = time.perf_counter() - t0
    sent = {s: setup[s] + len(ann[s]) + len(payloads[s]) for s in sites}
    return new_params, sent, seconds


def spec_names(spec):
    return [name for name, _ in spec]


def test_one_inner_outer_cycle_under_the_ceiling_and_bytes_exact():
    for name in ("fp32", "int8", "secure_int8"):
        new_params, sent, seconds = _cycle(name)
        assert seconds < CEILING_S, f"{name}: one cycle took {seconds:.1f} s (ceiling {CEILING_S} s)"
        spec = param_spec(new_params)
        for site, nbytes in sent.items():
            assert nbytes == expected_comm_bytes(name, spec, 2, run_id="smoke", round_idx=0, site=site)["total"], (name, site)


def test_outer_step_is_bitwise_deterministic_across_runs():
    a, _, _ = _cycle("secure_int8")
    b, _, _ = _cycle("secure_int8")  # fresh keys, fresh masks: the sum and the step are the same
    assert state_hash(a) == state_hash(b)


def test_int8_round_trip_bound():
    x = torch.from_numpy(np.random.default_rng(0).standard_t(2, size=100_000).astype(np.float32))
    q, scales = quantize_int8(x, 4096)
    err = (dequantize_int8(q, scales, 4096) - x).abs()
    bound = scales.repeat_interleave(4096)[: x.numel()] * (0.5 + 2**-15)
    assert bool((err <= bound).all())
