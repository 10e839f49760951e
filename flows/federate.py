"""Stage `federate` (Stage B): DiLoCo rounds over every site, wired.

Per round: the round (`orchestration.federation.federation_round`: every site trains H inner steps,
then `lensemble.federation.rounds.run_round` runs the exchange and the outer step, redone with the
survivors when a site fails or sends an update that does not verify, then the gauge), the record
task (metrics) and the checkpoint commit, so a crash loses at most the round in flight; the round's
Prefect artifacts are written by a task submitted beside the next round (collected before the stage
ends). Sites run as local tasks (threads or Dask) or, with `federate.execution: sovereign`, at the
sites behind the exchange (orchestration/sites.py). The local-only baselines start with the rounds, in
background workers that train on the cores the rounds leave free (`orchestration.workers.background_pool`, `CoreShare`).
After the last round: the sites' head re-fit and the baselines' results, then reports/federate.json; once the stage is committed, a leak scan of
reports/, the MLflow store and the exchange area against every site's private index
(`tasks.residency.check_outputs`).
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from tqdm import tqdm

from flows.runs import STAGE_RUN
from lensemble.perf import peak_memory_gib
from orchestration.federation import (
    baselines,
    commit_round,
    federation_round,
    open_federation,
    outer_step,
    remove_checkpoint,
    resume,
    start_local_only,
    summarize,
)
from orchestration.runner import stage_run
from orchestration.workers import coordinator_round, terminate_background_pools
from tasks.federation import publish_round_artifacts, record_round
from tasks.preflight import preflight
from tasks.residency import check_outputs

log = logging.getLogger("lensemble.stage")


def task_runner_for(p):
    """The task runner params ask for: threads (one per site, so sovereign site tasks never queue) or Dask."""
    if p.federate.task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        if p.federate.dask_address:
            return DaskTaskRunner(address=p.federate.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": p.federate.dask_workers, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None, "silence_logs": logging.WARNING})
    return ThreadPoolTaskRunner(max_workers=2 * len(p.data.sites) + 4)  # the sites' round steps and their local-only baselines


def round_line(record: dict, rounds: int, eta_seconds: float) -> str:
    """The line a committed round logs: its index, wall time, bytes on the wire, mean site loss, who dropped."""
    sites = record["sites"]
    comm = sum(v["comm_bytes"] for v in sites.values())
    loss = sum(v["loss/pred"] for v in sites.values()) / len(sites)
    dropped = f", dropped {sorted(record['dropped'])}" if record["dropped"] else ""
    return (f"federate: round {record['round']:02d} ({record['round'] + 1} of {rounds}) done in {record['seconds']:.1f} s, "
            f"{comm:,} bytes on the wire, mean site loss/pred {loss:.4f}, {len(sites)} sites{dropped}, "
            f"ETA {eta_seconds:.0f} s")


def configured_flow(root: str | Path = "."):
    """`federate_flow` with the task runner of the project's params."""
    from lensemble.config import load_params

    return federate_flow.with_options(task_runner=task_runner_for(load_params(Path(root) / "params.yaml")))


@flow(name="federate", **STAGE_RUN)
def federate_flow(root: str = ".") -> None:
    with stage_run("federate", root) as ctx:
        p = ctx.params
        pre = preflight(p, ctx.layout, "federate", ctx.hw_class)
        ctx.extra_manifest.update(preflight=pre["estimate"], compute=pre["compute"], usd_per_hour=pre["usd_per_hour"])
        fed = open_federation(ctx)
        state = resume(fed)
        ctx.extra_manifest["resumed_from_round"] = state.start
        outer = outer_step(p)
        local_futures = start_local_only(ctx, fed)  # beside the rounds, on the CPU time they leave idle
        t0 = time.monotonic()
        published = []  # each round's artifacts, written beside the next round
        try:
            for r in tqdm(range(state.start, p.federate.rounds), desc="federate rounds", unit="round", disable=not sys.stderr.isatty()):
                with coordinator_round():  # its serial work keeps a core the local-only baselines do not take
                    outcome = federation_round(fed, r, state, outer)
                    record, publication = record_round(ctx, fed, outcome)
                    # after the previous round's (wait_for): the artifacts' newest version is the newest round's
                    published.append(publish_round_artifacts.submit(**publication, wait_for=published[-1:]))
                    commit_round(fed, state, outcome, record)
                per_round = (time.monotonic() - t0) / (r + 1 - state.start)
                log.info(round_line(record, p.federate.rounds, per_round * (p.federate.rounds - r - 1)))
            for future in published:
                future.result()  # every round's artifacts are in before the stage goes on; a failed write fails it
            torch.save(state.global_state, ctx.out.path("models/federated.pt"))
            head_adapt, local_only = baselines(ctx, fed, state.global_state, local_futures)
        except BaseException:
            terminate_background_pools()  # a failed stage does not wait for its baselines
            raise
        summary = summarize(ctx, fed, state, head_adapt, local_only)
        ctx.measured["perf/peak_memory_gib"] = peak_memory_gib()
        fed.pool.finish()
        ctx.out.write_json("reports/federate.json", summary)
        remove_checkpoint(fed)
    check_outputs(ctx.params, ctx.layout)  # INV-RESIDENCY: what the stage committed (reports/, MLflow) holds no private rows
