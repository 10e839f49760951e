"""Names, tags and start/end lines of the stages' Prefect flow runs, so the UI tells runs apart.

A stage's flow run is named `<stage>-<params hash, 8 hex>` (e.g. `federate-125f647a`) and tagged
`stage:<stage>`, `params:<hash, 12 hex>` and `hw:<hardware class>`; it logs a line when it starts
(with its UI address) and when it ends. Task runs are named in their decorators (`site_a-round-03-train`,
`evaluate-site_b`, `generate-site_c`). `told(flow)` applies the name, the tags and the lines.

The tags are set on the flow run when it starts (its `on_running` hook), not through Prefect's `tags()`
context: task runs inherit that context's tags, and a tagged task run acquires a tag concurrency slot
through the API before it starts, which added ~2 s to most federation rounds (a round's 15 task runs).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("lensemble.stage")
TAG_PREFIXES = ("stage:", "params:", "hw:")


def _params_hash(root: str | Path) -> str | None:
    from lensemble.config import load_params
    from lensemble.errors import ConfigError

    try:
        return load_params(Path(root) / "params.yaml").hash()
    except ConfigError:  # the stage itself reports it, with its own message
        return None


def stage_run_name() -> str:
    """The flow run's name (Prefect calls this inside the run's context): `<flow name>-<params hash8>`."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    digest = _params_hash(ctx.parameters.get("root", "."))
    return f"{ctx.flow.name}-{digest[:8]}" if digest else ctx.flow.name


def run_tags(stage: str, params) -> set[str]:
    """`stage:`, `params:` and `hw:` tags of a stage's flow run."""
    from lensemble.observability.hardware import hardware_class

    return {f"stage:{stage}", f"params:{params.hash()[:12]}", f"hw:{hardware_class(params.run.hardware_class)}"}


def stage_of(flow_name: str) -> str:
    return "pipeline" if flow_name == "lensemble-pipeline" else flow_name


def tag_flow_run(flow, flow_run) -> None:
    """Put the stage's tags on its flow run (replacing any stage tags it carried); its task runs stay untagged."""
    from prefect.client.orchestration import get_client

    from lensemble.config import load_params
    from lensemble.errors import ConfigError

    try:
        params = load_params(Path(flow_run.parameters.get("root", ".")) / "params.yaml")
    except ConfigError:  # the stage itself reports it, with its own message
        return
    kept = {t for t in flow_run.tags if not t.startswith(TAG_PREFIXES)}
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, tags=sorted(kept | run_tags(stage_of(flow.name), params)))


def _started(flow, flow_run, state) -> None:
    from prefect.settings import PREFECT_UI_URL

    tag_flow_run(flow, flow_run)
    ui = PREFECT_UI_URL.value()
    where = f" ({ui}/runs/flow-run/{flow_run.id})" if ui else ""
    log.info(f"{flow.name}: started flow run {flow_run.name!r}{where}", extra={"flow_run_id": flow_run.id})


def _seconds(flow_run) -> str:
    start = flow_run.start_time
    return f"{time.time() - start.timestamp():.1f} s" if start is not None else "?"


def _finished(flow, flow_run, state) -> None:
    log.info(f"{flow.name}: finished in {_seconds(flow_run)}", extra={"flow_run_id": flow_run.id})


def _failed(flow, flow_run, state) -> None:
    log.info(f"{flow.name}: failed after {_seconds(flow_run)}: {state.message}", extra={"flow_run_id": flow_run.id})


# the stage flows' decorator options (`@flow(name=..., **STAGE_RUN)`), so a deployment's runs, which load the
# flow from its module, are named and told too
STAGE_RUN = {"flow_run_name": stage_run_name, "on_running": [_started], "on_completion": [_finished],
             "on_failure": [_failed]}


def told(flow):
    """`flow` with the stage's run name and its start and end lines (for a flow decorated without them)."""
    return flow.with_options(**STAGE_RUN)
