"""The coordinator's view of the sites in one federation run: the `SitePool`s of the round driver
(`lensemble.federation.rounds`).

- `LocalSites` (`federate.execution: local`): every site's training is a Prefect task in the
  coordinator's task runner (threads, or Dask with `federate.task_runner: dask`); the exchange steps
  are tasks on threads, or run in the coordinator on Dask. Each site's codec holds its own key only.
- `SovereignSites` (`federate.execution: sovereign`): each site's round runs at the site
  (`orchestration.site_agent.site_round`): as a deployment run on the site's own work pool
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
from functools import partial
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prefect import unmapped

from lensemble.config import Params, SiteParams
from lensemble.data.audit import PrivateIndex, index_path
from lensemble.data.residency import ResidencyGuard
from lensemble.errors import ConfigError, IntegrityError
from lensemble.federation.exchange import (
    Exchange, attempt_prefix, exchange_url, pack_json, pack_tensors, round_prefix, unpack_tensors,
)
from lensemble.federation.dp import private_codec
from lensemble.federation.rounds import InlineSites, SiteEndpoint
from lensemble.federation.signing import key_fingerprint
from lensemble.federation.transport import ParamSpec, RoundContext
from lensemble.federation.transports import site_codec
from lensemble.paths import Layout
from tasks.residency import check_exchange_tree


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


class LocalSites(InlineSites):
    """Site steps in the coordinator's task runner. Each site's endpoint holds its own signing key only
    (drawn here, per run); Δ_c stays in the site's state folder and every message leaves through the
    site's residency guard.

    Training is a Prefect task per site (threads, or Dask processes). The exchange steps are tasks on
    threads; on Dask they run here, in order (`InlineSites`): a site's codec holds the attempt's
    ephemeral X25519 key, which is never serialised to another process, and the steps take milliseconds.
    """

    def __init__(self, p: Params, layout: Layout, spec: ParamSpec, state_paths: dict[str, Path], delta_paths: dict[str, Path]) -> None:
        from tasks.sites import site_announce, site_encode
        from tasks.train import site_train

        keys = {s.name: Ed25519PrivateKey.generate() for s in p.data.sites}
        public = {s: k.public_key() for s, k in keys.items()}
        self.pins = {s: key_fingerprint(k) for s, k in public.items()}  # drawn here and pinned here: no key from outside
        super().__init__({s: SiteEndpoint(s, private_codec(site_codec(p.federate.transport, p.federate.quant_block, s, keys[s], public,
                                                                      self.pins), p),
                                          partial(load_delta, delta_paths[s]), partial(release_payload, layout, s, spec), public[s])
                          for s in sorted(keys)})
        opts = site_task_options(p)
        self.p, self.layout, self.state_paths, self.delta_paths = p, layout, state_paths, delta_paths
        self._train_task, self._announce, self._encode = (t.with_options(**opts) for t in (site_train, site_announce, site_encode))
        self.wait = wait_seconds(p)
        self.exchange_tasks = p.federate.task_runner != "dask"

    def train(self, r: int, sites, global_state: dict, probe: torch.Tensor, global_probe: torch.Tensor) -> tuple[dict, dict]:
        futures = self._train_task.map(unmapped(self.p), unmapped(self.layout), sites, unmapped(r), unmapped(global_state), unmapped(probe),
                                       unmapped(global_probe), [self.state_paths[s] for s in sites], [self.delta_paths[s] for s in sites])
        return completed(list(sites), futures, self.wait)

    def _tasks(self, task, sites: list[str], *args) -> tuple[dict, dict]:
        """A site task at every site; results without the task seconds, the slowest of which joins the critical path."""
        ok, failed = completed(sites, task.map([self.endpoints[s] for s in sites], *(unmapped(a) for a in args)), self.wait)
        self.work_seconds += max((v[1] for v in ok.values()), default=0.0)
        return {s: v[0] for s, v in ok.items()}, failed

    def announce(self, ctx: RoundContext, shares) -> tuple[dict, dict]:
        if not self.exchange_tasks:
            return super().announce(ctx, shares)
        return self._tasks(self._announce, list(ctx.site_ids), ctx, shares)

    def encode(self, ctx: RoundContext, grid: bytes) -> tuple[dict, dict]:
        if not self.exchange_tasks:
            return super().encode(ctx, grid)
        return self._tasks(self._encode, list(ctx.site_ids), ctx, grid)

    def close(self, r: int, sites) -> None:
        for s in sites:
            self.delta_paths[s].unlink(missing_ok=True)
        self.work_seconds = 0.0


def load_delta(path: Path) -> dict[str, torch.Tensor]:
    """A site's Δ_c from its state folder."""
    return torch.load(path, weights_only=True)


def release_payload(layout: Layout, site: str, spec: ParamSpec, blob: bytes) -> bytes:
    """`blob` through the site's residency guard (it refuses anything that carries private data)."""
    guard = ResidencyGuard(site, spec, layout.site_audit(site), private=PrivateIndex.load(index_path(layout.site_episodes(site))))
    return guard.release("payload", blob)


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

    def __init__(self, p: Params, layout: Layout, run_id: str, ex: Exchange) -> None:
        from orchestration.site_agent import site_pins

        self.p, self.layout, self.run_id, self.ex = p, layout, run_id, ex
        self.pins = site_pins(p)  # INV-PINNED-KEYS: the only keys the coordinator accepts
        self.timeout = p.federate.site_timeout_seconds
        self.attempt = 0
        self._launched: list = []  # (site, task future or deployment flow run)
        self.work_seconds = 0.0  # the sites' exchange steps run remotely: their time counts as the protocol's

    def _launch(self, r: int, sites: list[str]) -> None:
        if self.p.federate.site_launch == "deployment":
            from prefect.deployments import run_deployment

            for s in sites:
                self._launched.append((s, run_deployment(deployment_name(s), parameters={"run_id": self.run_id, "round_idx": r},
                                                         timeout=0, as_subflow=True)))
        else:
            from tasks.sites import site_round_task

            # a site round waits at most one timeout for each of its messages (global, open, roster, grid, done)
            task = site_round_task.with_options(timeout_seconds=5 * self.timeout + 60)
            self._launched = [(s, task.submit(str(self.layout.root), s, self.run_id, r)) for s in sites]

    def _gather(self, names: dict[str, str], what: str) -> tuple[dict, dict]:
        got = self.ex.gather(names, time.monotonic() + self.timeout)
        missing = {s: f"ParticipantDropped: no {what} in {self.ex.url} within {self.timeout:.0f} s" for s in names if s not in got}
        return got, missing

    def _attempt_prefix(self, ctx: RoundContext) -> str:
        return attempt_prefix(self.run_id, ctx.round_idx, self.attempt)

    def train(self, r: int, sites, global_state: dict, probe: torch.Tensor, global_probe: torch.Tensor) -> tuple[dict, dict]:
        prefix = round_prefix(self.run_id, r)
        check_exchange_tree(self.p, self.layout, self.ex, prefix)  # what a crashed attempt left is scanned before it goes
        self.ex.remove_tree(prefix)  # a round redone after a crash starts from a clean slate
        self.attempt = 0
        self.ex.put(f"{prefix}/global.pt", pack_tensors({"state": global_state, "global_probe": global_probe}))
        self._launch(r, list(sites))
        got = self.ex.gather({s: f"{prefix}/{s}/train.pt" for s in sites}, time.monotonic() + wait_seconds(self.p))
        trained = {s: unpack_tensors(b) for s, b in got.items()}
        return trained, {s: f"ParticipantDropped: no training result in {self.ex.url}" for s in sites if s not in got}

    def public_keys(self, sites) -> tuple[dict, dict]:
        """Each site's Ed25519 public key with its pinned fingerprint, read from the exchange.

        A site that has not published it yet, or whose published blob is not the pinned key, fails this
        step (a dropout with its reason); any other key under the site's name is never read.
        """
        from orchestration.site_agent import public_key_name, read_public_key

        keys, failed = {}, {}
        for s in sites:
            try:
                keys[s] = read_public_key(self.ex, s, self.pins[s])
            except IntegrityError as exc:
                failed[s] = f"IntegrityError: {exc}"
                continue
            if keys[s] is None:
                del keys[s]
                failed[s] = f"ConfigError: site {s} has no enrolled signing key at {public_key_name(s, self.pins[s])} in {self.ex.url}"
        return keys, failed

    def key_shares(self, ctx: RoundContext) -> tuple[dict, dict]:
        self.ex.put(f"{self._attempt_prefix(ctx)}/open.json", pack_json({"sites": list(ctx.site_ids)}))
        return self._gather({s: f"{self._attempt_prefix(ctx)}/{s}.key" for s in ctx.site_ids}, "key share")

    def announce(self, ctx: RoundContext, shares) -> tuple[dict, dict]:
        self.ex.put(f"{self._attempt_prefix(ctx)}/roster.pt", pack_tensors(dict(shares)))
        return self._gather({s: f"{self._attempt_prefix(ctx)}/{s}.ann" for s in ctx.site_ids}, "announcement")

    def encode(self, ctx: RoundContext, grid: bytes) -> tuple[dict, dict]:
        a = self._attempt_prefix(ctx)
        self.ex.put(f"{a}/grid.bin", grid)
        got, failed = self._gather({s: f"{a}/{s}.upd" for s in ctx.site_ids}, "update")
        enc = {}
        for s, payload in got.items():
            seconds = self.ex.get(f"{a}/{s}.enc_seconds")
            enc[s] = (payload, float(seconds) if seconds else None)
        return enc, failed

    def next_attempt(self) -> None:
        self.attempt += 1

    def close(self, r: int, sites) -> None:
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
        """The run is complete: its messages are spent (enrolled keys stay) once a leak scan of them finds nothing."""
        check_exchange_tree(self.p, self.layout, self.ex, self.run_id)  # ResidencyViolation keeps the tree
        self.ex.remove_tree(self.run_id)


def make_sites(p: Params, layout: Layout, spec: ParamSpec, run_id: str, state_paths: dict, delta_paths: dict, exchange: Exchange | None):
    """The sites of params: local tasks, or sovereign sites behind the (already checked) exchange."""
    if p.federate.execution == "local":
        return LocalSites(p, layout, spec, state_paths, delta_paths)
    return SovereignSites(p, layout, run_id, exchange)
