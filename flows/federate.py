"""Stage `federate` (Stage B): DiLoCo rounds over every site.

Each round: the global encoder embeds the public probe (anchor target); every site trains H inner
steps from the global parameters (one Prefect task run per site) and announces; the aggregator
agrees; every site encodes its update; the aggregator verifies, averages in sorted site order and
takes the outer Nesterov step; gauge diagnostics are computed on the public probe.
"""
from __future__ import annotations

import time

import torch
from prefect import flow, unmapped

from lensemble.federation.outer import state_hash
from lensemble.federation.transport import RoundContext, param_spec, spec_numel
from lensemble.federation.transports import make_transport
from lensemble.gauge import pool_tokens
from lensemble.model.world_model import federated_state, load_federated
from lensemble.training import encode_frames
from lensemble.workflow import build_model, probe_frames, site_names
from tasks.federation import aggregate_round, gauge_round
from tasks.runner import stage_run
from tasks.train import site_encode, site_train


@flow(name="federate")
def federate_flow(root: str = ".") -> None:
    with stage_run("federate", root) as ctx:
        p = ctx.params
        sites = site_names(p)
        model = build_model(p, "federated")  # the aggregator's copy: encoder + predictor only matter
        global_state = federated_state(model)
        spec = param_spec(global_state)
        numel = spec_numel(spec)
        probe = probe_frames(ctx.layout, p)
        transport = make_transport(p.federate.transport, p.run.seed)
        momentum = None
        rounds, total_bytes = [], 0
        state_paths = [ctx.out.path(f"models/sites/{s}.pt") for s in sites]
        delta_paths = [ctx.out.path(f"models/sites/{s}.delta.pt") for s in sites]
        run_id = f"{p.hash()[:16]}"
        for r in range(p.federate.rounds):
            t_round = time.perf_counter()
            rctx = RoundContext(run_id, r, tuple(sites), spec)
            setup_bytes = transport.begin_round(rctx)
            load_federated(model, global_state)
            global_probe = encode_frames(model, probe)
            trained = site_train.map(unmapped(p), unmapped(ctx.layout), sites, unmapped(r), unmapped(global_state), unmapped(probe), unmapped(global_probe),
                                     state_paths, delta_paths, unmapped(transport), unmapped(rctx)).result()
            transport.agree(rctx, {s: t["announcement"] for s, t in zip(sites, trained)})
            encoded = site_encode.map(unmapped(ctx.layout), sites, delta_paths, unmapped(transport), unmapped(rctx), unmapped(spec)).result()
            payloads = {s: e[0] for s, e in zip(sites, encoded)}
            global_state, momentum, outer_seconds = aggregate_round(rctx, transport, payloads, global_state, momentum, p.federate.outer_lr, p.federate.outer_momentum)
            load_federated(model, global_state)
            gauge = gauge_round(p.run.seed, r, {s: t["probe_embedding"] for s, t in zip(sites, trained)}, pool_tokens(encode_frames(model, probe)), p.gauge.pair_samples)
            round_seconds = time.perf_counter() - t_round
            per_site = {}
            for s, t, e in zip(sites, trained, encoded):
                nbytes = setup_bytes[s] + len(t["announcement"]) + len(payloads[s])
                total_bytes += nbytes
                m = t["metrics"]
                per_site[s] = {"comm_bytes": nbytes, "encode_seconds": e[1], **m}
                ctx.metric("fed/comm_bytes", nbytes, step=r, round_idx=r, participant=s)
                ctx.metric("fed/quant_ratio", len(payloads[s]) / (4 * numel), step=r, round_idx=r, participant=s)
                for name in ("loss/pred", "loss/sigreg", "loss/anchor", "gauge/drift_angle_deg", "gauge/drift_angle_max_deg", "gauge/procrustes_residual"):
                    ctx.metric(name, m[name], step=r, round_idx=r, participant=s)
            ctx.metric("gauge/effective_dim", gauge["effective_dim"]["rankme"], step=r, round_idx=r)
            ctx.metric("gauge/participation_ratio", gauge["effective_dim"]["participation_ratio"], step=r, round_idx=r)
            ctx.metric("fed/round_seconds", round_seconds, step=r, round_idx=r)
            ctx.metric("fed/outer_step_seconds", outer_seconds, step=r, round_idx=r)
            rounds.append({"round": r, "seconds": round_seconds, "outer_step_seconds": outer_seconds, "sites": per_site, "gauge": gauge,
                           "bytes_per_param": sum(v["comm_bytes"] for v in per_site.values()) / (len(sites) * numel)})
        torch.save(global_state, ctx.out.path("models/federated.pt"))
        inner_total = p.federate.rounds * p.federate.inner_steps
        summary = {
            "transport": p.federate.transport,
            "rounds": p.federate.rounds,
            "inner_steps": p.federate.inner_steps,
            "sites": sites,
            "federated_params": numel,
            "comm_bytes_total": total_bytes,
            "bytes_per_param": total_bytes / (len(sites) * numel * p.federate.rounds),
            "step_synchronous_bytes": 2 * 4 * numel * len(sites) * inner_total,
            "global_params_sha256": state_hash(global_state),
            "round_seconds_mean": sum(r["seconds"] for r in rounds) / len(rounds),
            "final_loss_pred": sum(rounds[-1]["sites"][s]["loss/pred"] for s in sites) / len(sites),
            "per_round": rounds,
        }
        ctx.measured["fed/bytes_per_param"] = summary["bytes_per_param"]
        ctx.measured["fed/round_seconds"] = summary["round_seconds_mean"]
        ctx.measured["gauge/effective_dim"] = rounds[-1]["gauge"]["effective_dim"]["rankme"] / model.latent_dim
        ctx.out.write_json("reports/federate.json", summary)
