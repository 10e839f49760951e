"""Prefect tasks on a site's side of a round: its exchange steps, and a sovereign site's whole round."""
from __future__ import annotations

import time
from collections.abc import Mapping

from prefect import task
from prefect.cache_policies import NONE

from lensemble.federation.rounds import SiteEndpoint
from lensemble.federation.transport import RoundContext


@task(name="site-announce", task_run_name="{endpoint.site}-round-{ctx.round_idx:02d}-announce", cache_policy=NONE)
def site_announce(endpoint: SiteEndpoint, ctx: RoundContext, shares: Mapping[str, bytes]) -> tuple[bytes, float]:
    """The site takes the roster and sends its pre-encoding message (e.g. its block scales); and the task's seconds."""
    t0 = time.perf_counter()
    return endpoint.announce(ctx, shares), time.perf_counter() - t0


@task(name="site-encode", task_run_name="{endpoint.site}-round-{ctx.round_idx:02d}-encode", cache_policy=NONE)
def site_encode(endpoint: SiteEndpoint, ctx: RoundContext, grid: bytes) -> tuple[tuple[bytes, float], float]:
    """The site takes the grid and serialises (quantizes, masks, signs) its Δ_c: ((payload, encode seconds), task seconds)."""
    t0 = time.perf_counter()
    return endpoint.encode(ctx, grid), time.perf_counter() - t0


@task(name="site-round", task_run_name="{site}-round-{round_idx:02d}", cache_policy=NONE)
def site_round_task(root: str, site: str, run_id: str, round_idx: int) -> dict:
    """A sovereign site's round (orchestration.site_agent.site_round) as a task of the coordinator's runner
    (`federate.site_launch: task`, one machine)."""
    from orchestration.site_agent import site_round

    return site_round(root, site, run_id, round_idx)
