"""Added aggregator cost of the INV-BOUNDED-INFLUENCE range check (every unmasked sum within ±127·C) on a
10M-parameter vector, beside signature verification and the fused aggregation + outer step.

    python benchmarks/range_check.py [C ...]      # default C = 3
"""
from __future__ import annotations

import sys
import time

import torch

from lensemble.federation import native
from lensemble.federation.outer import apply_outer_step
from lensemble.federation.secure_transport import SecureInt8Transport
from lensemble.federation.signing import generate_site_keys
from lensemble.federation.transport import RoundContext

def best(f, n=5):
    out = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); out.append(time.perf_counter() - t0)
    return min(out)

torch.set_num_threads(1)
numel = 10_000_000
for C in (int(c) for c in sys.argv[1:] or ["3"]):
    sites = tuple(f"s{i}" for i in range(C))
    ctx = RoundContext("bench", 0, sites, (("w", (numel,)),))
    t = SecureInt8Transport(generate_site_keys(sites), block=4096)
    delta = lambda i: {"w": torch.randn(numel, generator=torch.Generator().manual_seed(i)) * 1e-3}
    t.begin_round(ctx)
    t.agree(ctx, {s: t.announce(ctx, s, delta(i)) for i, s in enumerate(sites)})
    payloads = {s: t.encode(ctx, s, delta(i)) for i, s in enumerate(sites)}
    accepted = t.verify(ctx, payloads)
    params, mom = {"w": torch.randn(numel)}, {"w": torch.randn(numel)}
    out = ({"w": torch.empty(numel)}, {"w": torch.empty(numel)})
    range_s = best(lambda: t.sum_out_of_range(ctx, accepted.bodies))
    verify_s = best(lambda: t.verify(ctx, payloads))  # signatures + bindings + replay + range check
    step_s = best(lambda: apply_outer_step(ctx, t, accepted, params, mom, 0.7, 0.9, out=out))
    print(f"C={C} N={numel} native={native.load() is not None}: range check {range_s*1e3:.1f} ms; "
          f"verify incl. range check {verify_s*1e3:.1f} ms; fused aggregation+outer step {step_s*1e3:.1f} ms; "
          f"range/aggregation = {range_s/step_s:.2f}; range/(verify+aggregation) = {range_s/(verify_s+step_s):.2f}")
