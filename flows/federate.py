"""Stage `federate` (Stage B): DiLoCo rounds over every site.

Each round: the global encoder embeds the public probe (the anchor target); every site trains H
inner steps from the global parameters (one Prefect task run per site); then the exchange: the
transport's key setup, every site's announcement, the aggregator's agreement, every site's encoded
update, and the aggregator's verified, order-fixed average and outer Nesterov step. A site that
fails, drops or sends an update that does not verify is left out and the exchange is redone with the
survivors (`federate.drop_policy: continue`), or the stage aborts (`abort`); nothing of a dropped
site is ever half-applied.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch
from prefect import flow, unmapped
from tqdm import tqdm

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
from tasks.train import site_adapt_head, site_announce, site_encode, site_train, train_local_only


def _completed(sites: list[str], futures) -> tuple[dict, dict]:
    """Results of the site task runs that finished, and the error of each that did not."""
    ok, failed = {}, {}
    for site, fut in zip(sites, futures):
        try:
            ok[site] = fut.result()
        except Exception as exc:  # a site task failure is a dropout, recorded with its reason
            failed[site] = f"{type(exc).__name__}: {exc}"
    return ok, failed


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


def federated_round(run_id: str, round_idx: int, survivors: list[str], spec, transport: Transport, layout, delta_paths: dict[str, Path],
                    params: dict, momentum: dict | None, lr: float, beta: float, drop_policy: str) -> dict:
    """The exchange and the outer step of one round, redone with the survivors until it holds."""
    dropped: dict[str, str] = {}
    while True:
        if not survivors:
            raise ParticipantDropped(f"round {round_idx}: every site dropped: {dropped}")
        ctx = RoundContext(run_id, round_idx, tuple(sorted(survivors)), spec)
        setup = transport.begin_round(ctx)
        ann, failed = _completed(survivors, site_announce.map(unmapped(layout), survivors, [delta_paths[s] for s in survivors], unmapped(transport), unmapped(ctx)))
        enc: dict = {}
        if not failed:
            transport.agree(ctx, ann)
            enc, failed = _completed(survivors, site_encode.map(unmapped(layout), survivors, [delta_paths[s] for s in survivors], unmapped(transport), unmapped(ctx), unmapped(spec)))
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


@flow(name="federate")
def federate_flow(root: str = ".") -> None:
    with stage_run("federate", root) as ctx:
        p = ctx.params
        pre = preflight(p, ctx.layout, "federate", ctx.hw_class)
        ctx.extra_manifest.update(preflight=pre["estimate"], compute=pre["compute"], usd_per_hour=pre["usd_per_hour"])
        sites = site_names(p)
        model = build_model(p, "federated")  # the aggregator's copy: only encoder + predictor matter
        ctx.extra_manifest["warm_start"] = warm_start(model, p, ctx.layout)
        global_state = federated_state(model)
        spec = param_spec(global_state)
        numel = spec_numel(spec)
        probe = probe_frames(ctx.layout, p)
        transport = make_transport(p.federate.transport, p.federate.quant_block)
        momentum = None
        rounds, total_bytes = [], 0
        state_paths = {s: ctx.out.path(f"models/sites/{s}.pt") for s in sites}
        delta_paths = {s: ctx.out.path(f"models/sites/{s}.delta.pt") for s in sites}
        run_id = p.hash()[:16]
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
        restore_sites(ckpt, state_paths)
        ctx.extra_manifest["resumed_from_round"] = start
        for r in tqdm(range(start, p.federate.rounds), desc="federate rounds", unit="round", disable=not sys.stderr.isatty()):
            t_round = time.perf_counter()
            load_federated(model, global_state)
            global_probe = encode_frames(model, probe)
            futures = site_train.map(unmapped(p), unmapped(ctx.layout), sites, unmapped(r), unmapped(global_state), unmapped(probe),
                                     unmapped(global_probe), [state_paths[s] for s in sites], [delta_paths[s] for s in sites])
            trained, train_failed = _completed(sites, futures)
            if train_failed and p.federate.drop_policy == "abort":
                raise ParticipantDropped(f"round {r}: sites failed {train_failed}; federate.drop_policy is abort")
            res = federated_round(run_id, r, sorted(trained), spec, transport, ctx.layout, delta_paths, global_state, momentum,
                                  p.federate.outer_lr, p.federate.outer_momentum, p.federate.drop_policy)
            global_state, momentum = res["params"], res["momentum"]
            for s in sites:
                delta_paths[s].unlink(missing_ok=True)
            t_gauge = time.perf_counter()
            load_federated(model, global_state)
            members = list(res["ctx"].site_ids)
            gauge = gauge_round(p.run.seed, r, {s: trained[s]["probe_embedding"] for s in members}, pool_tokens(encode_frames(model, probe)), p.gauge.pair_samples)
            gauge_seconds = time.perf_counter() - t_gauge
            round_seconds = time.perf_counter() - t_round
            per_site = {}
            for s in members:
                nbytes = res["setup"][s] + len(res["announcements"][s]) + len(res["payloads"][s])
                total_bytes += nbytes
                m = trained[s]["metrics"]
                per_site[s] = {"comm_bytes": nbytes, "payload_bytes": len(res["payloads"][s]), "encode_seconds": res["encode_seconds"][s], **m}
                ctx.metric("fed/comm_bytes", nbytes, step=r, round_idx=r, participant=s)
                ctx.metric("fed/quant_ratio", len(res["payloads"][s]) / (4 * numel), step=r, round_idx=r, participant=s)
                for name in ("loss/pred", "loss/sigreg", "loss/anchor", "gauge/drift_angle_deg", "gauge/drift_angle_max_deg", "gauge/procrustes_residual"):
                    ctx.metric(name, m[name], step=r, round_idx=r, participant=s)
            ctx.metric("gauge/effective_dim", gauge["effective_dim"]["rankme"], step=r, round_idx=r)
            ctx.metric("gauge/participation_ratio", gauge["effective_dim"]["participation_ratio"], step=r, round_idx=r)
            ctx.metric("fed/round_seconds", round_seconds, step=r, round_idx=r)
            ctx.metric("fed/outer_step_seconds", res["outer_seconds"], step=r, round_idx=r)
            rounds.append({"round": r, "seconds": round_seconds, "outer_step_seconds": res["outer_seconds"], "gauge_seconds": gauge_seconds,
                           "sites": per_site, "gauge": gauge,
                           "dropped": {**train_failed, **res["dropped"]},
                           "bytes_per_param": sum(v["comm_bytes"] for v in per_site.values()) / (len(members) * numel)})
            for s in members:
                site_refs[s] = commit_site_state(state_paths[s], ckpt_root / "sites" / s, r)
            save_checkpoint(ckpt_path, FederationCheckpoint(run_id, r + 1, global_state, momentum, site_refs, capture_rng(), rounds))
            for s in members:
                prune_site_states(ckpt_root / "sites" / s, site_refs[s])
        torch.save(global_state, ctx.out.path("models/federated.pt"))
        head_adapt = {}
        if p.federate.head_adapt_steps:
            head_adapt = dict(zip(sites, site_adapt_head.map(unmapped(p), unmapped(ctx.layout), sites, unmapped(global_state), [state_paths[s] for s in sites]).result()))
        local_only = {}
        if p.federate.local_only:
            local_only = dict(zip(sites, train_local_only.map(unmapped(p), unmapped(ctx.layout), sites, [ctx.out.path(f"models/local/{s}.pt") for s in sites]).result()))
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
        ctx.out.write_json("reports/federate.json", summary)
        remove_checkpoint(ckpt_path, ckpt_root / "sites", sites)
