"""Prefect tasks on the aggregator's side of a DiLoCo round: the outer step, the gauge, the round's record."""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NONE

from lensemble.federation.outer import aggregate_and_step
from lensemble.federation.rounds import AggregatorCodec
from lensemble.federation.transport import RoundContext
from lensemble.gauge import drift, effective_dim, embodiment_spread, sample_pairs
from lensemble.seeds import derive_seed


@task(name="aggregate", task_run_name="round-{ctx.round_idx:02d}-aggregate", cache_policy=NONE, retries=1)
def aggregate_round(ctx: RoundContext, aggregator: AggregatorCodec, payloads: Mapping[str, bytes], params: dict, momentum: dict | None,
                    lr: float, beta: float) -> tuple[dict, dict, float]:
    """Verify, average and take the outer Nesterov step (self-checked); returns (params, momentum, seconds).

    The round driver's `OuterStep` in a federate run. `retries=1`: a NonDeterministicAggregation aborts
    the attempt and the task recomputes once.
    """
    t0 = time.perf_counter()
    new_params, new_buf = aggregate_and_step(ctx, aggregator, payloads, params, momentum, lr, beta)
    return new_params, new_buf, time.perf_counter() - t0


@task(name="gauge-round", task_run_name="round-{round_idx:02d}-gauge", cache_policy=NONE)
def gauge_round(run_seed: int, round_idx: int, site_probes: Mapping[str, torch.Tensor], global_probe: torch.Tensor, num_pairs: int,
                probe_labels: Sequence[str] = (), probe_episodes: Sequence[int] = ()) -> dict:
    """Drift of sampled site pairs and the effective dimension of the new global model's probe embeddings (and, given
    each probe row's embodiment, per embodiment; given its probe episode too, each embodiment's within-episode share)."""
    t0 = time.perf_counter()
    sites = sorted(site_probes)
    rng = np.random.default_rng(derive_seed(run_seed, "gauge/pairs", round_idx))
    pairs = {f"{a}|{b}": drift(site_probes[a], site_probes[b]) for a, b in sample_pairs(sites, num_pairs, rng)}
    out = {"pairs": pairs, "effective_dim": effective_dim(global_probe)}
    if probe_labels:
        out["embodiments"] = embodiment_spread(global_probe, probe_labels, probe_episodes)
    return {**out, "seconds": time.perf_counter() - t0}


@task(name="publish-round", task_run_name="round-{r:02d}-publish", cache_policy=NONE)
def publish_round_artifacts(r: int, per_site: dict, gauge: dict, dropped: dict, budget_rows: list[dict], round_seconds: float) -> None:
    """The round's Prefect artifacts (`orchestration.federation.publish_round`), submitted by the flow beside the next
    round: two writes to the Prefect server (~50-90 ms) that the rounds no longer wait for."""
    from orchestration.federation import publish_round

    publish_round(r, per_site, gauge, dropped, budget_rows, round_seconds)


@task(name="record-round", task_run_name="round-{outcome.round_idx:02d}-record", cache_policy=NONE)
def record_round(ctx, fed, outcome) -> tuple[dict, dict]:
    """The round's metrics (MLflow, metrics.jsonl); returns its history entry and the arguments of its Prefect
    artifacts (`publish_round_artifacts`, which the flow submits and collects before the stage ends).

    `ctx`: the stage's StageContext; `fed`: the run's orchestration.federation.Federation; `outcome`: its RoundOutcome.
    """
    from orchestration.federation import round_budgets, round_record
    from lensemble.dynamics import ROUND_DYNAMICS

    r, res = outcome.round_idx, outcome.result
    for s in res.members:
        m = outcome.trained[s]["metrics"]
        ctx.metric("fed/comm_bytes", res.comm_bytes(s), step=r, round_idx=r, participant=s)
        ctx.metric("fed/quant_ratio", res.payload_bytes[s] / (4 * fed.numel), step=r, round_idx=r, participant=s)
        for name in ("loss/pred", "loss/proprio", "loss/sigreg", "loss/anchor", "gauge/drift_angle_deg", "gauge/drift_angle_max_deg",
                     "gauge/procrustes_residual", *ROUND_DYNAMICS):
            ctx.metric(name, m[name], step=r, round_idx=r, participant=s)
    for s in outcome.dropped:
        ctx.metric("perf/site_dropouts", 1.0, step=r, round_idx=r, participant=s)
    if res.aborts:  # attempts aborted by a range check or a copied key share, then redone (INV-BOUNDED-INFLUENCE)
        ctx.metric("perf/aborted_attempts", float(len(res.aborts)), step=r, round_idx=r)
    for s, n in sorted(res.capped.items()):  # blocks whose announced absmax the grid agreement capped
        ctx.metric("perf/capped_blocks", float(n), step=r, round_idx=r, participant=s)
    record, per_site = round_record(fed, outcome, time.perf_counter() - outcome.started)
    budget_rows = round_budgets(ctx.layout.root, ctx.hw_class, {
        "fed/bytes_per_param": record["bytes_per_param"], "fed/round_seconds": time.perf_counter() - outcome.started,
        "gauge/effective_dim_fraction": outcome.gauge["effective_dim"]["rankme"] / fed.model.latent_dim, **record.get("dp", {})})
    record, per_site = round_record(fed, outcome, time.perf_counter() - outcome.started)
    publication = {"r": r, "per_site": per_site, "gauge": outcome.gauge, "dropped": outcome.dropped, "budget_rows": budget_rows,
                   "round_seconds": record["seconds"]}
    for s in res.members:  # clipping and DP figures, present only when params turn them on
        for name in ("dp/update_norm", "dp/clipped", "dp/noise_std"):
            if name in per_site[s]:
                ctx.metric(name, per_site[s][name], step=r, round_idx=r, participant=s)
    for name, value in sorted(record.get("dp", {}).items()):  # dp/epsilon, dp/delta (ε of rounds 0..r), dp/clip_fraction
        ctx.metric(name, value, step=r, round_idx=r)
    effective = outcome.gauge["effective_dim"]
    ctx.metric("gauge/effective_dim", effective["rankme"], step=r, round_idx=r)
    ctx.metric("gauge/participation_ratio", effective["participation_ratio"], step=r, round_idx=r)
    ctx.metric("fed/round_seconds", record["seconds"], step=r, round_idx=r)
    ctx.metric("fed/outer_step_seconds", res.outer_seconds, step=r, round_idx=r)
    ctx.metric("perf/orchestration_seconds", record["orchestration_seconds"], step=r, round_idx=r)
    return record, publication
