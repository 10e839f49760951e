"""The federate stage around the round driver: the coordinator's setup and resume, one round, its
checkpoint commit, and the stage's summary. `flows/federate.py` wires these; the round itself is
`lensemble.federation.rounds.run_round` over this run's `SitePool` and aggregator codec.

A round: the global encoder embeds the public probe (the anchor target); every site trains H inner
steps from the global parameters; then the exchange and the outer step (`run_round`), redone with the
survivors when a site fails or sends an update that does not verify; then the gauge of the new
global model against the sites' probe embeddings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path

import torch
from prefect import unmapped

from lensemble.budgets import evaluate_budgets, load_budgets
from lensemble.errors import ParticipantDropped
from lensemble.federation.checkpoint import (
    FederationCheckpoint,
    capture_rng,
    commit_site_state,
    coordinator_key_path,
    load_checkpoint,
    prune_site_states,
    restore_rng,
    restore_sites,
    save_checkpoint,
)
from lensemble.federation.dp import round_privacy, run_privacy
from lensemble.federation.outer import state_hash
from lensemble.federation.rounds import RoundResult, run_round
from lensemble.federation.schedule import round_frozen_prefix
from lensemble.federation.transport import param_spec, spec_numel
from lensemble.federation.transports import aggregator_codec
from lensemble.gauge import pool_tokens
from lensemble.model.world_model import WorldModel, federated_state, load_federated
from lensemble.training import encode_frames
from lensemble.workflow import (
    action_dims,
    build_model,
    probe_frames_labelled,
    site_names,
    warm_start,
)
from orchestration.sites import (
    check_sovereign,
    make_sites,
    site_task_options,
    wait_seconds,
)
from orchestration.workers import background_pool, makespan, site_pool, site_slots

SITE_WORK_MODULES = ("orchestration.site_work",)  # what the site workers import as they start: no round waits for it


@dataclass
class Federation:
    """The coordinator's side of one federation run: what stays fixed across its rounds."""

    p: object
    layout: object
    model: WorldModel  # the aggregator's copy: only encoder + predictor matter
    sites: list[str]
    spec: tuple
    numel: int
    probe: torch.Tensor
    aggregator: object  # AggregatorCodec: public keys only
    pool: object  # SitePool
    run_id: str
    state_paths: dict[str, Path]
    ckpt_root: Path
    probe_labels: list[str] = field(default_factory=list)  # the embodiment of each probe row (per-embodiment gauge)
    probe_episodes: list[int] = field(default_factory=list)  # the probe episode of each row (within-episode share)

    @property
    def sovereign(self) -> bool:
        return self.p.federate.execution == "sovereign"

    @property
    def ckpt_path(self) -> Path:
        return self.ckpt_root / "federate" / f"{self.run_id}.ckpt"

    @property
    def ckpt_key(self) -> Path:
        """The coordinator's HMAC key its checkpoints are MACed under (created on the first commit)."""
        return coordinator_key_path(self.layout.root)


@dataclass
class FederationState:
    """What changes every round and is checkpointed after it."""

    global_state: dict
    momentum: dict | None = None
    history: list[dict] = field(default_factory=list)
    start: int = 0
    site_refs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RoundOutcome:
    """One committed round with what the coordinator measured around it."""

    round_idx: int
    result: RoundResult
    trained: dict
    dropped: dict
    gauge: dict
    work_seconds: float
    gauge_seconds: float
    started: float  # perf_counter at the round's start


def open_federation(ctx) -> Federation:
    """Model, warm start, parameter spec, probe, aggregator codec and site pool of the stage's params."""
    p = ctx.params
    exchange = check_sovereign(p, ctx.layout) if p.federate.execution == "sovereign" else None  # before any round
    model = build_model(p, "federated")
    ctx.extra_manifest["warm_start"] = warm_start(model, p, ctx.layout)
    spec = param_spec(federated_state(model))
    sites = site_names(p)
    run_id = p.hash()[:16]
    state_paths = {s: ctx.out.path(f"models/sites/{s}.pt") for s in sites}
    delta_paths = {s: ctx.out.path(f"models/sites/{s}.delta.pt") for s in sites}
    pool = make_sites(p, ctx.layout, spec, run_id, state_paths, delta_paths, exchange)
    site_pool(p, warm=SITE_WORK_MODULES).wait_ready()  # the sites' workers start now, not inside round 0 (or its timeouts)
    probe, labels, probe_episodes = probe_frames_labelled(ctx.layout, p)
    return Federation(p, ctx.layout, model, sites, spec, spec_numel(spec), probe,
                      aggregator_codec(p.federate.transport, p.federate.quant_block, pool.pins, p.federate.announce_outlier_factor),
                      pool, run_id, state_paths, ctx.layout.root / "checkpoints", labels, probe_episodes)


def resume(fed: Federation) -> FederationState:
    """The state after the last committed round of this run (crash-resume), or the warm-started start."""
    ckpt = load_checkpoint(fed.ckpt_path, fed.run_id, fed.ckpt_key)
    state = FederationState(federated_state(fed.model))
    if ckpt is not None:
        state = FederationState(ckpt.global_params, ckpt.momentum, list(ckpt.history), ckpt.round_idx, dict(ckpt.site_states))
        restore_rng(ckpt.rng)
    if not fed.sovereign:  # a sovereign site keeps (and snapshots) its own state
        restore_sites(ckpt, fed.state_paths)
    return state


def federation_round(fed: Federation, r: int, state: FederationState, outer) -> RoundOutcome:
    """Train at every site, run the exchange and the outer step (`outer`), gauge the new global model."""
    p = fed.p
    t_round = time.perf_counter()
    load_federated(fed.model, state.global_state)
    global_probe = encode_frames(fed.model, fed.probe)
    probe_seconds = time.perf_counter() - t_round
    trained, train_failed = fed.pool.train(r, fed.sites, state.global_state, fed.probe, global_probe)
    if train_failed and p.federate.drop_policy == "abort":
        raise ParticipantDropped(f"round {r}: sites failed {train_failed}; federate.drop_policy is abort")
    res = run_round(fed.run_id, r, sorted(trained), fed.spec, fed.pool, fed.aggregator, state.global_state, state.momentum,
                    outer, p.federate.drop_policy, round_frozen_prefix(p, fed.spec, r))
    exchange_work = fed.pool.work_seconds
    fed.pool.close(r, fed.sites)
    t_gauge = time.perf_counter()
    load_federated(fed.model, res.params)
    new_probe = pool_tokens(encode_frames(fed.model, fed.probe))
    encode_probe_seconds = time.perf_counter() - t_gauge
    from tasks.federation import gauge_round

    gauge = gauge_round(p.run.seed, r, {s: trained[s]["probe_embedding"] for s in res.members}, new_probe, p.gauge.pair_samples,
                         fed.probe_labels, fed.probe_episodes)
    # the sites' own work on the round's critical path: their training as the workers ran it (with fewer workers
    # than sites, some trainings run one after another: compute, not orchestration), the slowest announcement
    # and encoding, the outer step and the gauge
    training = makespan([trained[s]["task_seconds"] for s in fed.sites if s in trained], site_slots(p))
    work = probe_seconds + training + exchange_work + res.outer_seconds + encode_probe_seconds + gauge["seconds"]
    return RoundOutcome(r, res, trained, {**train_failed, **res.dropped}, gauge, work, time.perf_counter() - t_gauge, t_round)


def commit_round(fed: Federation, state: FederationState, outcome: RoundOutcome, record: dict) -> None:
    """Apply the round to the state and checkpoint it (site snapshots first, then the coordinator's file)."""
    r, members = outcome.round_idx, outcome.result.members
    state.global_state, state.momentum = outcome.result.params, outcome.result.momentum
    state.history.append(record)
    if not fed.sovereign:
        for s in members:
            state.site_refs[s] = commit_site_state(fed.state_paths[s], fed.ckpt_root / "sites" / s, r)
    save_checkpoint(fed.ckpt_path, FederationCheckpoint(fed.run_id, r + 1, state.global_state, state.momentum, state.site_refs,
                                                        capture_rng(), state.history), fed.ckpt_key)
    if not fed.sovereign:
        for s in members:
            prune_site_states(fed.ckpt_root / "sites" / s, state.site_refs[s])


def outer_step(p):
    """The outer step as the `aggregate` task (it retries once on a NonDeterministicAggregation)."""
    from tasks.federation import aggregate_round

    return partial(aggregate_round, lr=p.federate.outer_lr, beta=p.federate.outer_momentum)


def start_local_only(ctx, fed: Federation) -> dict | None:
    """The local-only baselines submitted now, to the background workers (`background_pool`), so they train on
    the cores the rounds leave free; their futures by site. None where they run after the rounds instead
    (sovereign sites, Dask, one worker, a GPU) or not at all. The models are the same bits either way."""
    from tasks.train import train_local_only

    p = fed.p
    if not p.federate.local_only or fed.sovereign or background_pool(p, warm=SITE_WORK_MODULES) is None:
        return None
    # no task timeout: a background baseline may wait out the whole federation for a free core; the
    # coordinator bounds its own wait after the rounds instead (`baselines`)
    options = {**site_task_options(p), "timeout_seconds": None}
    return {s: train_local_only.with_options(**options).submit(p, ctx.layout, s, ctx.out.path(f"models/local/{s}.pt"), background=True)
            for s in fed.sites}


def baselines(ctx, fed: Federation, global_state: dict, local_futures: dict | None = None) -> tuple[dict, dict]:
    """After the last round, at every site: the head re-fit to the final model, and the local-only baseline (its
    results, when `start_local_only` started it beside the rounds)."""
    from tasks.train import site_adapt_head, train_local_only

    p, sites = fed.p, fed.sites
    head_adapt, local_only = {}, {}
    if p.federate.head_adapt_steps and not fed.sovereign:
        head_adapt = dict(zip(sites, site_adapt_head.with_options(**site_task_options(p)).map(
            unmapped(p), unmapped(ctx.layout), sites, unmapped(global_state), [fed.state_paths[s] for s in sites]).result()))
    if local_futures is not None:
        deadline = time.monotonic() + wait_seconds(p)  # after the rounds, as long as the site steps would be waited for
        for s in sites:
            try:
                local_only[s] = local_futures[s].result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"{s}'s local-only baseline did not finish within {wait_seconds(p):.0f} s of the last round "
                                   "(federate.site_timeout_seconds and site_retries); raise them, or set federate.local_only: false") from None
    elif p.federate.local_only and not fed.sovereign:
        local_only = dict(zip(sites, train_local_only.with_options(**site_task_options(p)).map(
            unmapped(p), unmapped(ctx.layout), sites, [ctx.out.path(f"models/local/{s}.pt") for s in sites]).result()))
    return head_adapt, local_only


def pooling_bytes(p) -> int:
    """Bytes every site would ship to pool its raw episodes centrally: uint8 frames plus fp32 actions."""
    dims = action_dims(p)
    return sum(s.episodes * p.data.episode_length * (3 * p.data.image_size**2 + 4 * dims[s.embodiment]) for s in p.data.sites)


def summarize(ctx, fed: Federation, state: FederationState, head_adapt: dict, local_only: dict) -> dict:
    """reports/federate.json, and the stage's measured budget values."""
    p, rounds, numel = fed.p, state.history, fed.numel
    total_bytes = sum(v["comm_bytes"] for r in rounds for v in r["sites"].values())
    site_rounds = sum(len(r["sites"]) for r in rounds)
    inner_total = p.federate.rounds * p.federate.inner_steps
    summary = {
        "transport": p.federate.transport, "rounds": p.federate.rounds, "inner_steps": p.federate.inner_steps, "sites": fed.sites,
        "federated_params": numel, "comm_bytes_total": total_bytes, "bytes_per_param": total_bytes / (site_rounds * numel),
        "quant_ratio": sum(v["payload_bytes"] for r in rounds for v in r["sites"].values()) / (site_rounds * 4 * numel),
        "step_synchronous_bytes": 2 * 4 * numel * len(fed.sites) * inner_total, "pooling_bytes": pooling_bytes(p),
        "global_params_sha256": state_hash(state.global_state),
        "round_seconds_mean": sum(r["seconds"] for r in rounds) / len(rounds),
        "final_loss_pred": sum(v["loss/pred"] for v in rounds[-1]["sites"].values()) / len(rounds[-1]["sites"]),
        "per_round": rounds, "local_only": local_only, "head_adapt": head_adapt,
    }
    privacy = run_privacy(p, rounds)
    if privacy:  # only clipped or DP runs carry it: the default report stays byte-identical
        summary["dp"] = privacy
        ctx.measured["dp/clip_fraction"] = privacy["clip_fraction_mean"]
        if privacy["enabled"]:
            ctx.measured["dp/epsilon"] = privacy["epsilon"]
    m = ctx.measured
    m["fed/bytes_per_param"], m["fed/quant_ratio"] = summary["bytes_per_param"], summary["quant_ratio"]
    m["fed/round_seconds"] = summary["round_seconds_mean"]
    m["fed/outer_step_seconds"] = sum(r["outer_step_seconds"] for r in rounds) / len(rounds)
    m["gauge/effective_dim_fraction"] = rounds[-1]["gauge"]["effective_dim"]["rankme"] / fed.model.latent_dim
    # chapter §4-§5: run total and its reduction against step-synchronous training; gauge cost per round
    m["perf/comm_bytes_total"] = float(total_bytes)  # fed/comm_bytes is the per-(round, site) series
    m["perf/comm_reduction_vs_synchronous"] = summary["step_synchronous_bytes"] / total_bytes
    m["perf/gauge_seconds"] = sum(r.get("gauge_seconds", 0.0) for r in rounds) / len(rounds)
    m["perf/gauge_round_fraction"] = m["perf/gauge_seconds"] / summary["round_seconds_mean"]
    # what Prefect (task submission, state tracking, artifacts) added to the rounds, against their wall time
    m["perf/orchestration_fraction"] = sum(r.get("orchestration_seconds", 0.0) for r in rounds) / sum(r["seconds"] for r in rounds)
    return summary


def remove_checkpoint(fed: Federation) -> None:
    """The stage finished: its checkpoint and the sites' snapshots are spent."""
    fed.ckpt_path.unlink(missing_ok=True)
    for s in fed.sites:
        for snap in (fed.ckpt_root / "sites" / s).glob("round-*.pt"):
            snap.unlink()


def round_record(fed: Federation, outcome: RoundOutcome, total_seconds: float) -> tuple[dict, dict]:
    """The round's history entry (reports/federate.json `per_round`) and each member's figures."""
    res, trained = outcome.result, outcome.trained
    per_site = {s: {"comm_bytes": res.comm_bytes(s), "payload_bytes": res.payload_bytes[s], "encode_seconds": res.encode_seconds[s],
                    **trained[s]["metrics"]} for s in res.members}
    bytes_per_param = sum(v["comm_bytes"] for v in per_site.values()) / (len(res.members) * fed.numel)
    privacy = round_privacy(fed.p, res.ctx, {s: trained[s]["metrics"] for s in res.members})  # {} unless clipping or DP is on
    for s, figures in privacy.get("sites", {}).items():
        per_site[s].update(figures)
    record = {"round": outcome.round_idx, "seconds": total_seconds, "outer_step_seconds": res.outer_seconds,
              "gauge_seconds": outcome.gauge_seconds, "work_seconds": outcome.work_seconds,
              "orchestration_seconds": max(0.0, total_seconds - outcome.work_seconds), "sites": per_site,
              "gauge": {k: v for k, v in outcome.gauge.items() if k != "seconds"}, "dropped": outcome.dropped,
              "bytes_per_param": bytes_per_param, **({"dp": privacy["round"]} if privacy else {}),
              # INV-BOUNDED-INFLUENCE events, only when they happened (the default report stays byte-identical)
              **({"aborted_attempts": list(res.aborts)} if res.aborts else {}),
              **({"capped_blocks": dict(res.capped)} if res.capped else {})}
    return record, per_site


@lru_cache(maxsize=4)
def _budgets_as_of(path: Path, stamp: tuple[int, int]) -> list:
    return load_budgets(path)


def round_budgets(root: Path, hw_class: str, measured: dict[str, float]) -> list[dict]:
    """Budget rows of the federate stage that one round's figures already measure. budgets.yaml is parsed once a
    stage (~15 ms a reading, inside every round's wall time) and again only if it changes."""
    path = root / "budgets.yaml"
    if not path.is_file():
        load_budgets(path)  # its one-line error
    stat = path.stat()
    budgets = _budgets_as_of(path, (stat.st_mtime_ns, stat.st_size))
    rows = evaluate_budgets(budgets, "federate", hw_class, measured)
    return [r for r in rows if r["status"] not in ("not_measured", "no_band")]


def publish_round(r: int, per_site: dict, gauge: dict, dropped: dict, budget_rows: list[dict], round_seconds: float) -> None:
    """The round's Prefect artifacts: a table per site (drift, comm bytes, losses) and a markdown summary."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = [{"site": s, "drift_angle_deg": round(v["gauge/drift_angle_deg"], 3), "drift_angle_max_deg": round(v["gauge/drift_angle_max_deg"], 3),
             "procrustes_residual": round(v["gauge/procrustes_residual"], 4), "comm_bytes": v["comm_bytes"], "loss_pred": round(v["loss/pred"], 5)}
            for s, v in sorted(per_site.items())]
    rows += [{"site": s, "drift_angle_deg": None, "drift_angle_max_deg": None, "procrustes_residual": None, "comm_bytes": 0,
              "loss_pred": None, "dropped": reason} for s, reason in sorted(dropped.items())]
    off = [f"{b['name']} {b['status']}" for b in budget_rows if b["status"] != "within"]
    status = ("all within: " + ", ".join(b["name"] for b in budget_rows)) if not off else "; ".join(off)
    for row in rows:
        row["budget_status"] = status
    create_table_artifact(key="federation-round", table=rows, description=f"Round {r}: each site's drift against the global frame, bytes sent, and the round's budget status")
    budgets = "\n".join(f"| {b['name']} | {b['value']:.4g} | [{b['low']}, {b['high']}] {b['unit']} | {b['status']} |" for b in budget_rows)
    lines = [f"# Federation round {r}", "",
             f"- sites: {len(per_site)} aggregated" + (f", {len(dropped)} dropped ({', '.join(f'{s}: {why}' for s, why in sorted(dropped.items()))})" if dropped else ""),
             f"- wall time: {round_seconds:.2f} s; bytes on the wire: {sum(v['comm_bytes'] for v in per_site.values()):,}",
             f"- effective dimension (RankMe): {gauge['effective_dim']['rankme']:.2f}; participation ratio {gauge['effective_dim']['participation_ratio']:.2f}",
             "", "| budget | value | band | status |", "|---|---|---|---|", budgets]
    create_markdown_artifact(key="federation-round-summary", markdown="\n".join(lines), description=f"Round {r} summary")
