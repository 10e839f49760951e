"""Names, tags and start/end lines of the stages' Prefect flow runs, so the UI tells runs apart.

A stage's flow run is named `<stage>-<params hash, 8 hex>` (e.g. `federate-125f647a`) and tagged
`stage:<stage>`, `params:<hash, 12 hex>` and `hw:<hardware class>`; it logs a line when it starts
(with its UI address) and when it ends. Task runs are named in their decorators (`site_a-round-03-train`,
`evaluate-site_b`, `generate-site_c`). `told(flow)` applies the name and the lines; `stage_tags(...)`
wraps the call that creates the run.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def stage_tags(stage: str, root: str | Path) -> Iterator[None]:
    """Tag the flow runs created inside with `stage`'s tags, in place of an enclosing stage's (a pipeline's subflows)."""
    from prefect.context import TagsContext

    from lensemble.config import load_params

    kept = {t for t in TagsContext.get().current_tags if not t.startswith(TAG_PREFIXES)}
    with TagsContext(current_tags=kept | run_tags(stage, load_params(Path(root) / "params.yaml"))):
        yield


def _started(flow, flow_run, state) -> None:
    from prefect.settings import PREFECT_UI_URL

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
