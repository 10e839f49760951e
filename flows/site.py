"""The `site-round` flow: one sovereign site's side of one federation round, run on the site's work pool.

`lensemble site deploy SITE` (run at the site) enrols the site's signing key with the exchange and
registers this flow as deployment `site-round/<site>` on the site's work pool, with the site's
project root as a default parameter; a worker on that pool (`prefect worker start --pool POOL`)
runs it whenever the coordinator triggers a round. See orchestration/site_agent.py.
"""
from __future__ import annotations

from pathlib import Path
from uuid import UUID

from prefect import flow

from lensemble.errors import ConfigError
from lensemble.federation.exchange import Exchange, exchange_url
from lensemble.paths import Layout
from orchestration.site_agent import enrol, site_round


@flow(name="site-round", flow_run_name="{site}-round-{round_idx:02d}")
def site_round_flow(root: str, site: str, run_id: str, round_idx: int) -> dict:
    """Train H inner steps at the site and answer the round's exchange protocol (orchestration.site_agent.site_round)."""
    return site_round(root, site, run_id, round_idx)


def deploy_site(root: Path, site: str) -> UUID:
    """Enrol `site` and register its `site-round` deployment on its work pool; ConfigError if the pool is missing."""
    from prefect.client.orchestration import get_client

    from lensemble.config import load_params
    from orchestration.sites import deployment_name, require_work_pool

    root = Path(root).resolve()
    p = load_params(root / "params.yaml")
    entry = next((s for s in p.data.sites if s.name == site), None)
    if entry is None:
        raise ConfigError(f"site {site!r} is not in params.yaml (sites: {[s.name for s in p.data.sites]})")
    with get_client(sync_client=True) as client:
        require_work_pool(client, entry)
    ex = Exchange(exchange_url(p.federate.exchange, root))
    ex.check()
    enrol(Layout(root), ex, site)
    code = Path(__file__).resolve().parents[1]  # the checkout that holds flows/ (the site's installed Lensemble)
    deployment = site_round_flow.from_source(source=str(code), entrypoint="flows/site.py:site_round_flow")
    return deployment.deploy(name=deployment_name(site).split("/", 1)[1], work_pool_name=entry.pool,
                             parameters={"root": str(root), "site": site}, build=False, push=False, print_next_steps=False,
                             ignore_warnings=True)
