"""Stage `federate` (Stage B): DiLoCo rounds over every site.

Each round: the global encoder embeds the public probe (the anchor target); every site trains H
inner steps from the global parameters (one Prefect task run per site); then the exchange: the
transport's key setup, every site's announcement, the aggregator's agreement, every site's encoded
update, and the aggregator's verified, order-fixed average and outer Nesterov step. A site that
fails, drops or sends an update that does not verify is left out and the exchange is redone with the
survivors (`federate.drop_policy: continue`), or the stage aborts (`abort`); nothing of a dropped
site is ever half-applied. Site steps follow the retry and timeout policy of `federate.site_*`, and
run as local tasks or, with `federate.execution: sovereign`, at the sites (tasks/sites.py).

Each round publishes Prefect artifacts (a per-site table of drift and bytes, a markdown summary with
the budgets the round already measures) and records its orchestration overhead: the round's wall
time minus the sites' and the aggregator's own work on its critical path.
"""
from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import torch
from prefect import flow, unmapped
from prefect.task_runners import ThreadPoolTaskRunner
from tqdm import tqdm

from lensemble.budgets import evaluate_budgets, load_budgets
from lensemble.errors import IntegrityError, ParticipantDropped
from lensemble.federation.checkpoint import (
    FederationCheckpoint, capture_rng, commit_site_state, load_checkpoint, prune_site_states, restore_rng, restore_sites, save_checkpoint,
)
from lensemble.federation.outer import state_hash
from lensemble.latency import peak_memory_gib
from lensemble.federation.transport import RoundContext, Transport, param_spec, spec_numel
from lensemble.federation.transports import make_transport
from lensemble.gauge import pool_tokens
from lensemble.model.world_model import federated_state, load_federated
from lensemble.training import encode_frames
from lensemble.workflow import action_dims, build_model, probe_frames, site_names, warm_start
from tasks.federation import aggregate_round, gauge_round
from tasks.preflight import preflight
from tasks.runner import stage_run
from tasks.sites import check_sovereign, make_sites, site_task_options
from tasks.train import ROUND_DYNAMICS, site_adapt_head, train_local_only


def remove_checkpoint(ckpt_path: Path, sites_root: Path, sites: list[str]) -> None:
    """The stage finished: its checkpoint and the sites' snapshots are spent."""
    ckpt_path.unlink(missing_ok=True)
    for s in sites:
        for snap in (sites_root / s).glob("round-*.pt"):
            snap.unlink()


def pooling_bytes(p) -> int:
    """Bytes every site would ship to pool its raw episodes centrally: uint8 frames plus fp32 actions."""
    dims = action_dims(p)
    return sum(s.episodes * p.data.episode_length * (3 * p.data.image_size**2 + 4 * dims[s.embodiment]) for s in p.data.sites)


def culprit(exc: IntegrityError) -> str | None:
    """The site an IntegrityError names (every one reads "... from 'site' ...")."""
    m = re.search(r"from '([^']+)'", str(exc))
    return m.group(1) if m else None


def federated_round(run_id: str, round_idx: int, survivors: list[str], spec, transport: Transport, sites,
                    params: dict, momentum: dict | None, lr: float, beta: float, drop_policy: str) -> dict:
    """The exchange and the outer step of one round, redone with the survivors until it holds."""
    dropped: dict[str, str] = {}
    while True:
        if not survivors:
            raise ParticipantDropped(f"round {round_idx}: every site dropped: {dropped}")
        ctx = RoundContext(run_id, round_idx, tuple(sorted(survivors)), spec)
        setup, failed = sites.begin(ctx)
        ann: dict = {}
        enc: dict = {}
        if not failed:
            ann, failed = sites.announce(ctx)
        if not failed:
            transport.agree(ctx, ann)
            enc, failed = sites.encode(ctx)
        if not failed:
            payloads = {s: e[0] for s, e in enc.items()}
            try:
                new_params, new_buf, outer_seconds = aggregate_round(ctx, transport, payloads, params, momentum, lr, beta)
                return {"ctx": ctx, "setup": setup, "announcements": ann, "payloads": payloads, "encode_seconds": {s: e[1] for s, e in enc.items()},
                        "params": new_params, "momentum": new_buf, "outer_seconds": outer_seconds, "dropped": dropped}
            except IntegrityError as exc:
                site = culprit(exc)
                if site is None or site not in survivors:
                    raise
                failed = {site: f"IntegrityError: {exc}"}
        if drop_policy == "abort":
            raise ParticipantDropped(f"round {round_idx}: sites failed {failed}; federate.drop_policy is abort")
        dropped.update(failed)
        survivors = [s for s in survivors if s not in failed]
        sites.next_attempt()


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


def round_budgets(root: Path, hw_class: str, measured: dict[str, float]) -> list[dict]:
    """Budget rows of the federate stage that one round's figures already measure."""
    rows = evaluate_budgets(load_budgets(root / "budgets.yaml"), "federate", hw_class, measured)
    return [r for r in rows if r["status"] not in ("not_measured", "no_band")]


def task_runner_for(p):
    """The task runner params ask for: threads (one per site, so sovereign site tasks never queue) or Dask."""
    if p.federate.task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        if p.federate.dask_address:
            return DaskTaskRunner(address=p.federate.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": p.federate.dask_workers, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None, "silence_logs": logging.WARNING})
    return ThreadPoolTaskRunner(max_workers=len(p.data.sites) + 4)


def configured_flow(root: str | Path = "."):
    """`federate_flow` with the task runner of the project's params."""
    from lensemble.config import load_params

    return federate_flow.with_options(task_runner=task_runner_for(load_params(Path(root) / "params.yaml")))


@flow(name="federate")
def federate_flow(root: str = ".") -> None:
    with stage_run("federate", root) as ctx:
        p = ctx.params
        pre = preflight(p, ctx.layout, "federate", ctx.hw_class)
        ctx.extra_manifest.update(preflight=pre["estimate"], compute=pre["compute"], usd_per_hour=pre["usd_per_hour"])
        sites = site_names(p)
        sovereign = p.federate.execution == "sovereign"
        exchange = check_sovereign(p, ctx.layout) if sovereign else None  # pools, deployments, exchange: before any round
        model = build_model(p, "federated")  # the aggregator's copy: only encoder + predictor matter
        ctx.extra_manifest["warm_start"] = warm_start(model, p, ctx.layout)
        global_state = federated_state(model)
        spec = param_spec(global_state)
        numel = spec_numel(spec)
        probe = probe_frames(ctx.layout, p)
        # the aggregator holds no site's signing key when sites are sovereign: they enrol through the exchange
        transport = make_transport(p.federate.transport, p.federate.quant_block, site_keys={} if sovereign else None)
        momentum = None
        rounds, total_bytes = [], 0
        state_paths = {s: ctx.out.path(f"models/sites/{s}.pt") for s in sites}
        delta_paths = {s: ctx.out.path(f"models/sites/{s}.delta.pt") for s in sites}
        run_id = p.hash()[:16]
        site_runs = make_sites(p, ctx.layout, transport, run_id, state_paths, delta_paths, exchange)
        # crash-resume: a checkpoint per run id, committed after every round, removed when the stage succeeds
        ckpt_root = ctx.layout.root / "checkpoints"
        ckpt_path = ckpt_root / "federate" / f"{run_id}.ckpt"
        ckpt = load_checkpoint(ckpt_path, run_id)
        start = 0
        site_refs: dict = {}
        if ckpt is not None:
            global_state, momentum, rounds, start, site_refs = ckpt.global_params, ckpt.momentum, list(ckpt.history), ckpt.round_idx, dict(ckpt.site_states)
            total_bytes = sum(v["comm_bytes"] for r in rounds for v in r["sites"].values())
            restore_rng(ckpt.rng)
        if not sovereign:  # a sovereign site keeps (and snapshots) its own state
            restore_sites(ckpt, state_paths)
        ctx.extra_manifest["resumed_from_round"] = start
        for r in tqdm(range(start, p.federate.rounds), desc="federate rounds", unit="round", disable=not sys.stderr.isatty()):
            t_round = time.perf_counter()
            load_federated(model, global_state)
            global_probe = encode_frames(model, probe)
            probe_seconds = time.perf_counter() - t_round
            trained, train_failed = site_runs.train(r, sites, global_state, probe, global_probe)
            if train_failed and p.federate.drop_policy == "abort":
                raise ParticipantDropped(f"round {r}: sites failed {train_failed}; federate.drop_policy is abort")
            res = federated_round(run_id, r, sorted(trained), spec, transport, site_runs, global_state, momentum,
                                  p.federate.outer_lr, p.federate.outer_momentum, p.federate.drop_policy)
            global_state, momentum = res["params"], res["momentum"]
            exchange_work = site_runs.work_seconds
            site_runs.close(r, sites)
            t_gauge = time.perf_counter()
            load_federated(model, global_state)
            members = list(res["ctx"].site_ids)
            new_probe = pool_tokens(encode_frames(model, probe))
            encode_probe_seconds = time.perf_counter() - t_gauge
            gauge = gauge_round(p.run.seed, r, {s: trained[s]["probe_embedding"] for s in members}, new_probe, p.gauge.pair_samples)
            gauge_seconds = time.perf_counter() - t_gauge
            dropped = {**train_failed, **res["dropped"]}
            per_site = {}
            for s in members:
                nbytes = res["setup"][s] + len(res["announcements"][s]) + len(res["payloads"][s])
                total_bytes += nbytes
                m = trained[s]["metrics"]
                per_site[s] = {"comm_bytes": nbytes, "payload_bytes": len(res["payloads"][s]), "encode_seconds": res["encode_seconds"][s], **m}
                ctx.metric("fed/comm_bytes", nbytes, step=r, round_idx=r, participant=s)
                ctx.metric("fed/quant_ratio", len(res["payloads"][s]) / (4 * numel), step=r, round_idx=r, participant=s)
                for name in ("loss/pred", "loss/proprio", "loss/sigreg", "loss/anchor", "gauge/drift_angle_deg", "gauge/drift_angle_max_deg",
                             "gauge/procrustes_residual", *ROUND_DYNAMICS):
                    ctx.metric(name, m[name], step=r, round_idx=r, participant=s)
            for s in dropped:
                ctx.metric("perf/site_dropouts", 1.0, step=r, round_idx=r, participant=s)
            bytes_per_param = sum(v["comm_bytes"] for v in per_site.values()) / (len(members) * numel)
            # the sites' own work on the round's critical path: the slowest training, announcement and encoding
            work_seconds = (probe_seconds + max(trained[s]["task_seconds"] for s in members) + exchange_work + res["outer_seconds"]
                            + encode_probe_seconds + gauge["seconds"])
            publish_round(r, per_site, gauge, dropped, round_budgets(ctx.layout.root, ctx.hw_class, {
                "fed/bytes_per_param": bytes_per_param, "fed/round_seconds": time.perf_counter() - t_round,
                "gauge/effective_dim_fraction": gauge["effective_dim"]["rankme"] / model.latent_dim}), time.perf_counter() - t_round)
            round_seconds = time.perf_counter() - t_round
            orchestration = max(0.0, round_seconds - work_seconds)
            ctx.metric("gauge/effective_dim", gauge["effective_dim"]["rankme"], step=r, round_idx=r)
            ctx.metric("gauge/participation_ratio", gauge["effective_dim"]["participation_ratio"], step=r, round_idx=r)
            ctx.metric("fed/round_seconds", round_seconds, step=r, round_idx=r)
            ctx.metric("fed/outer_step_seconds", res["outer_seconds"], step=r, round_idx=r)
            ctx.metric("perf/orchestration_seconds", orchestration, step=r, round_idx=r)
            rounds.append({"round": r, "seconds": round_seconds, "outer_step_seconds": res["outer_seconds"], "gauge_seconds": gauge_seconds,
                           "work_seconds": work_seconds, "orchestration_seconds": orchestration,
                           "sites": per_site, "gauge": {k: v for k, v in gauge.items() if k != "seconds"},
                           "dropped": dropped, "bytes_per_param": bytes_per_param})
            if not sovereign:
                for s in members:
                    site_refs[s] = commit_site_state(state_paths[s], ckpt_root / "sites" / s, r)
            save_checkpoint(ckpt_path, FederationCheckpoint(run_id, r + 1, global_state, momentum, site_refs, capture_rng(), rounds))
            if not sovereign:
                for s in members:
                    prune_site_states(ckpt_root / "sites" / s, site_refs[s])
        torch.save(global_state, ctx.out.path("models/federated.pt"))
        head_adapt = {}
        if p.federate.head_adapt_steps and not sovereign:
            head_adapt = dict(zip(sites, site_adapt_head.with_options(**site_task_options(p)).map(unmapped(p), unmapped(ctx.layout), sites, unmapped(global_state), [state_paths[s] for s in sites]).result()))
        local_only = {}
        if p.federate.local_only and not sovereign:
            local_only = dict(zip(sites, train_local_only.with_options(**site_task_options(p)).map(unmapped(p), unmapped(ctx.layout), sites, [ctx.out.path(f"models/local/{s}.pt") for s in sites]).result()))
        inner_total = p.federate.rounds * p.federate.inner_steps
        site_rounds = sum(len(r["sites"]) for r in rounds)
        summary = {
            "transport": p.federate.transport,
            "rounds": p.federate.rounds,
            "inner_steps": p.federate.inner_steps,
            "sites": sites,
            "federated_params": numel,
            "comm_bytes_total": total_bytes,
            "bytes_per_param": total_bytes / (site_rounds * numel),
            "quant_ratio": sum(v["payload_bytes"] for r in rounds for v in r["sites"].values()) / (site_rounds * 4 * numel),
            "step_synchronous_bytes": 2 * 4 * numel * len(sites) * inner_total,
            "pooling_bytes": pooling_bytes(p),
            "global_params_sha256": state_hash(global_state),
            "round_seconds_mean": sum(r["seconds"] for r in rounds) / len(rounds),
            "final_loss_pred": sum(v["loss/pred"] for v in rounds[-1]["sites"].values()) / len(rounds[-1]["sites"]),
            "per_round": rounds,
            "local_only": local_only,
            "head_adapt": head_adapt,
        }
        ctx.measured["fed/bytes_per_param"] = summary["bytes_per_param"]
        ctx.measured["fed/quant_ratio"] = summary["quant_ratio"]
        ctx.measured["fed/round_seconds"] = summary["round_seconds_mean"]
        ctx.measured["fed/outer_step_seconds"] = sum(r["outer_step_seconds"] for r in rounds) / len(rounds)
        ctx.measured["gauge/effective_dim_fraction"] = rounds[-1]["gauge"]["effective_dim"]["rankme"] / model.latent_dim
        # chapter §4-§5: run total and its reduction against step-synchronous training; gauge cost per round
        ctx.measured["perf/comm_bytes_total"] = float(total_bytes)  # fed/comm_bytes is the per-(round, site) series
        ctx.measured["perf/comm_reduction_vs_synchronous"] = summary["step_synchronous_bytes"] / total_bytes
        ctx.measured["perf/gauge_seconds"] = sum(r.get("gauge_seconds", 0.0) for r in rounds) / len(rounds)
        ctx.measured["perf/gauge_round_fraction"] = ctx.measured["perf/gauge_seconds"] / summary["round_seconds_mean"]
        ctx.measured["perf/peak_memory_gib"] = peak_memory_gib()
        # what Prefect (task submission, state tracking, artifacts) added to the rounds, against their wall time
        ctx.measured["perf/orchestration_fraction"] = sum(r.get("orchestration_seconds", 0.0) for r in rounds) / sum(r["seconds"] for r in rounds)
        site_runs.finish()
        ctx.out.write_json("reports/federate.json", summary)
        remove_checkpoint(ckpt_path, ckpt_root / "sites", sites)
