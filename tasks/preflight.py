"""The pre-flight task every training stage runs before it launches anything."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from lensemble.compute import compute_summary, meta_model
from lensemble.config import Params
from lensemble.federation.secure_transport import expected_comm_bytes
from lensemble.federation.transport import param_spec
from lensemble.model.world_model import FEDERATED_PREFIXES
from lensemble.paths import Layout
from lensemble.preflight import enforce, estimate, load_pricing
from lensemble.federation.schedule import round_frozen_prefix
from lensemble.workflow import site_names


@task(name="preflight", task_run_name="preflight-{stage}", cache_policy=NONE)
def preflight(params: Params, layout: Layout, stage: str, hw_class: str) -> dict:
    """Counted FLOPs, memory and wire bytes → totals, cost; BudgetExceeded before any training if over a ceiling."""
    summary = compute_summary(params, anchor=stage == "federate")
    pricing = load_pricing(layout.root / "pricing.yaml")
    spec = param_spec({n: p for n, p in meta_model(params).named_parameters() if n.startswith(FEDERATED_PREFIXES)})
    sites = site_names(params)
    rounds = range(max(1, params.federate.rounds))  # a round whose encoder is frozen sends the rest only
    wire = sum(expected_comm_bytes(params.federate.transport, spec, len(sites), run_id=params.hash()[:16], round_idx=r, site=sites[0],
                                   block=params.federate.quant_block, frozen=round_frozen_prefix(params, spec, r))["total"]
               for r in rounds) / len(rounds)
    est = estimate(params, stage, flops_per_step=float(summary["flops_per_step"]["total"]), memory_bytes=float(summary["memory_bytes"]["total"]),
                   update_bytes=wire, hw_class=hw_class, pricing=pricing)
    enforce(est, params, stage)
    return {"estimate": est, "compute": summary, "usd_per_hour": pricing[hw_class]["usd_per_hour"]}
