"""The coordinator's view of the sites in one federation run: where their work runs and how it returns.

Two ways, one interface (`train`, then per attempt `begin`, `announce`, `encode`; `close` each round):

- `LocalSites` (`federate.execution: local`): every site step is a Prefect task in the coordinator's
  task runner (threads, or Dask with `federate.task_runner: dask`, where training is spread over the
  cluster's processes and the millisecond exchange steps run in the coordinator).
- `SovereignSites` (`federate.execution: sovereign`): each site's round runs at the site
  (`tasks.site_agent.site_round`): as a deployment run on the site's own work pool
  (`federate.site_launch: deployment`), or as a task here for a one-machine trial (`task`). Messages
  go through the exchange (`lensemble.federation.exchange`); only what a site's guard released
  comes back.

Site failure policy: a site task that raises or runs past `federate.site_timeout_seconds` is retried
`federate.site_retries` times (Prefect task retries); the coordinator waits at most
`wait_seconds(params)` for any site step and then counts the site as dropped for the round, so a
federation never waits forever. Each result carries the seconds its body took, so the round's
orchestration overhead (wall time minus the critical path of the sites' own work) is measurable.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from prefect import unmapped

from lensemble.config import Params, SiteParams
from lensemble.errors import ConfigError
from lensemble.federation.exchange import (
    Exchange, attempt_prefix, exchange_url, pack_json, pack_tensors, round_prefix, unpack_tensors,
)
from lensemble.federation.transport import RoundContext, Transport
from lensemble.paths import Layout


class _ThreadTimeoutNotice(logging.Filter):
    """Prefect warns on every timed task in a worker thread; the timeout still interrupts our Python-level loops."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "running in a worker thread" not in record.getMessage()


logging.getLogger("prefect.task_runs").addFilter(_ThreadTimeoutNotice())


def site_task_options(p: Params) -> dict:
    """Prefect task options of every site step: the retry and timeout policy of params."""
    return {"retries": p.federate.site_retries, "retry_delay_seconds": p.federate.retry_delay_seconds,
            "timeout_seconds": p.federate.site_timeout_seconds}


def wait_seconds(p: Params) -> float:
    """The longest the coordinator waits for one site step: every attempt at its timeout, the delays, and a margin."""
    f = p.federate
    return (f.site_retries + 1) * f.site_timeout_seconds + f.site_retries * f.retry_delay_seconds + 10.0


def completed(sites: list[str], futures, wait: float) -> tuple[dict, dict]:
    """Results of the site task runs that finished within `wait` seconds, and the reason of each that did not."""
    deadline = time.monotonic() + wait
    ok, failed = {}, {}
    for site, fut in zip(sites, futures):
        try:
            ok[site] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # a site task failure or timeout is a dropout, recorded with its reason
            failed[site] = f"{type(exc).__name__}: {exc}"
    return ok, failed


def inline(sites: list[str], step) -> tuple[dict, dict]:
    """`step(site)` for each site in this process; a raise is that site's dropout, like a failed task."""
    ok, failed = {}, {}
    for site in sites:
        try:
            ok[site] = step(site)
        except Exception as exc:
            failed[site] = f"{type(exc).__name__}: {exc}"
    return ok, failed


class LocalSites:
    """Site steps as tasks of the coordinator's task runner; Δ_c stays in the site's state folder."""

    def __init__(self, p: Params, layout: Layout, transport: Transport, state_paths: dict[str, Path], delta_paths: dict[str, Path]) -> None:
        from tasks.train import site_announce, site_encode, site_train

        opts = site_task_options(p)
        self.p, self.layout, self.transport = p, layout, transport
        self.state_paths, self.delta_paths = state_paths, delta_paths
        self._train, self._announce, self._encode = (t.with_options(**opts) for t in (site_train, site_announce, site_encode))
        self.wait = wait_seconds(p)
        self.work_seconds = 0.0  # this round's critical path of site work in announce/encode (task bodies)
        # On Dask, site tasks run in other processes: training goes there, but the exchange steps use the
        # transport's in-memory key state (one object plays every party), so they run here, in order.
        self.inline_exchange = p.federate.task_runner == "dask"

    def train(self, r: int, sites: list[str], global_state: dict, probe: torch.Tensor, global_probe: torch.Tensor) -> tuple[dict, dict]:
        futures = self._train.map(unmapped(self.p), unmapped(self.layout), sites, unmapped(r), unmapped(global_state), unmapped(probe),
                                  unmapped(global_probe), [self.state_paths[s] for s in sites], [self.delta_paths[s] for s in sites])
        return completed(sites, futures, self.wait)

    def begin(self, ctx: RoundContext) -> tuple[dict, dict]:
        return self.transport.begin_round(ctx), {}

    def announce(self, ctx: RoundContext) -> tuple[dict, dict]:
        sites = list(ctx.site_ids)
        if self.inline_exchange:
            ok, failed = inline(sites, lambda s: self._announce.fn(self.layout, s, self.delta_paths[s], self.transport, ctx))
        else:
            ok, failed = completed(sites, self._announce.map(unmapped(self.layout), sites, [self.delta_paths[s] for s in sites],
                                                             unmapped(self.transport), unmapped(ctx)), self.wait)
        self.work_seconds += max((v[1] for v in ok.values()), default=0.0)
        return {s: v[0] for s, v in ok.items()}, failed

    def encode(self, ctx: RoundContext) -> tuple[dict, dict]:
        """{site: (payload, encode seconds, task body seconds)} and the failures."""
        sites = list(ctx.site_ids)
        if self.inline_exchange:
            ok, failed = inline(sites, lambda s: self._encode.fn(self.layout, s, self.delta_paths[s], self.transport, ctx, ctx.spec))
        else:
            ok, failed = completed(sites, self._encode.map(unmapped(self.layout), sites, [self.delta_paths[s] for s in sites],
                                                           unmapped(self.transport), unmapped(ctx), unmapped(ctx.spec)), self.wait)
        self.work_seconds += max((v[2] for v in ok.values()), default=0.0)
        return ok, failed

    def next_attempt(self) -> None:
        pass

    def close(self, r: int, sites: list[str]) -> None:
        for s in sites:
            self.delta_paths[s].unlink(missing_ok=True)
        self.work_seconds = 0.0

    def finish(self) -> None:
        pass


def deployment_name(site: str) -> str:
    """The site's deployment of the `site-round` flow."""
    return f"site-round/{site.replace('_', '-')}"


def require_work_pool(client, site: SiteParams) -> None:
    """ConfigError naming the site's work pool if the Prefect server does not have it."""
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_work_pool(site.pool)
    except ObjectNotFound:
        raise ConfigError(f"work pool {site.pool!r} of site {site.name} does not exist; create it with"
                          f" `prefect work-pool create {site.pool} --type process` and start a worker on it") from None


def check_sovereign(p: Params, layout: Layout) -> Exchange:
    """Before any round: the exchange answers, and (deployment launch) every site's work pool and deployment exist.

    ConfigError naming the first thing that is missing.
    """
    ex = Exchange(exchange_url(p.federate.exchange, layout.root))
    ex.check()
    if p.federate.site_launch == "deployment":
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            for s in p.data.sites:
                require_work_pool(client, s)
                try:
                    client.read_deployment_by_name(deployment_name(s.name))
                except ObjectNotFound:
                    raise ConfigError(f"site {s.name} has no deployment {deployment_name(s.name)!r}; run"
                                      f" `lensemble site deploy {s.name}` at the site") from None
    return ex


class SovereignSites:
    """Each site's round runs at the site; the coordinator talks to it only through the exchange."""

    def __init__(self, p: Params, layout: Layout, transport: Transport, run_id: str, ex: Exchange) -> None:
        self.p, self.layout, self.transport, self.run_id, self.ex = p, layout, transport, run_id, ex
        self.timeout = p.federate.site_timeout_seconds
        self.attempt = 0
        self._launched: list = []  # (site, task future or deployment flow run)
        self._shares: dict[str, bytes] = {}
        self.work_seconds = 0.0  # the sites' exchange steps run remotely: their time counts as the protocol's

    def _launch(self, r: int, sites: list[str]) -> None:
        if self.p.federate.site_launch == "deployment":
            from prefect.deployments import run_deployment

            for s in sites:
                self._launched.append((s, run_deployment(deployment_name(s), parameters={"run_id": self.run_id, "round_idx": r},
                                                         timeout=0, as_subflow=True)))
        else:
            from tasks.site_agent import site_round_task

            # a site round waits at most one timeout for each of its messages (global, open, roster, grid, done)
            task = site_round_task.with_options(timeout_seconds=5 * self.timeout + 60)
            self._launched = [(s, task.submit(str(self.layout.root), s, self.run_id, r)) for s in sites]

    def _gather(self, names: dict[str, str], what: str) -> tuple[dict, dict]:
        got = self.ex.gather(names, time.monotonic() + self.timeout)
        missing = {s: f"ParticipantDropped: no {what} in {self.ex.url} within {self.timeout:.0f} s" for s in names if s not in got}
        return got, missing

    def train(self, r: int, sites: list[str], global_state: dict, probe: torch.Tensor, global_probe: torch.Tensor) -> tuple[dict, dict]:
        prefix = round_prefix(self.run_id, r)
        self.ex.remove_tree(prefix)  # a round redone after a crash starts from a clean slate
        self.attempt = 0
        self.ex.put(f"{prefix}/global.pt", pack_tensors({"state": global_state, "global_probe": global_probe}))
        self._launch(r, sites)
        got = self.ex.gather({s: f"{prefix}/{s}/train.pt" for s in sites}, time.monotonic() + wait_seconds(self.p))
        trained = {s: unpack_tensors(b) for s, b in got.items()}
        return trained, {s: f"ParticipantDropped: no training result in {self.ex.url}" for s in sites if s not in got}

    def _registry(self, sites) -> dict:
        from tasks.site_agent import read_public_key

        failed = {}
        for s in sites:
            pub = read_public_key(self.ex, s)
            if pub is None:
                failed[s] = f"ConfigError: site {s} has no enrolled signing key in {self.ex.url}"
            elif hasattr(self.transport, "register"):
                self.transport.register(s, pub)
        return failed

    def begin(self, ctx: RoundContext) -> tuple[dict, dict]:
        a = attempt_prefix(self.run_id, ctx.round_idx, self.attempt)
        failed = self._registry(ctx.site_ids)
        if failed:
            return {}, failed
        self.ex.put(f"{a}/open.json", pack_json({"sites": list(ctx.site_ids)}))
        shares, failed = self._gather({s: f"{a}/{s}.key" for s in ctx.site_ids}, "key share")
        if failed:
            return {}, failed
        self._shares = shares
        return self.transport.accept_shares(ctx, shares), {}

    def announce(self, ctx: RoundContext) -> tuple[dict, dict]:
        a = attempt_prefix(self.run_id, ctx.round_idx, self.attempt)
        self.ex.put(f"{a}/roster.pt", pack_tensors(self._shares))
        return self._gather({s: f"{a}/{s}.ann" for s in ctx.site_ids}, "announcement")

    def encode(self, ctx: RoundContext) -> tuple[dict, dict]:
        a = attempt_prefix(self.run_id, ctx.round_idx, self.attempt)
        self.ex.put(f"{a}/grid.bin", self.transport.grid_message(ctx))
        got, failed = self._gather({s: f"{a}/{s}.upd" for s in ctx.site_ids}, "update")
        enc = {}
        for s, payload in got.items():
            seconds = self.ex.get(f"{a}/{s}.enc_seconds")
            enc[s] = (payload, float(seconds) if seconds else None, None)
        return enc, failed

    def next_attempt(self) -> None:
        self.attempt += 1

    def close(self, r: int, sites: list[str]) -> None:
        """Mark the round done (sites stop waiting), then wait for the site runs to end."""
        self.ex.put(f"{round_prefix(self.run_id, r)}/done.json", pack_json({"round": r}))
        for site, handle in self._launched:
            if hasattr(handle, "wait"):  # a task future; deployment runs end on their own
                handle.wait(timeout=self.timeout + 30)
                state = handle.state
                if not state.is_completed():  # its missing messages already made it a dropout; say why it ended
                    logging.getLogger("lensemble.sites").warning("site %s round %d: its site run ended %s: %s", site, r, state.name, state.message)
        self._launched = []
        self.work_seconds = 0.0

    def finish(self) -> None:
        """The run is complete: its messages are spent (enrolled keys stay)."""
        self.ex.remove_tree(self.run_id)


def make_sites(p: Params, layout: Layout, transport: Transport, run_id: str, state_paths: dict, delta_paths: dict, exchange: Exchange | None):
    """The sites of params: local tasks, or sovereign sites behind the (already checked) exchange."""
    if p.federate.execution == "local":
        return LocalSites(p, layout, transport, state_paths, delta_paths)
    return SovereignSites(p, layout, transport, run_id, exchange)

