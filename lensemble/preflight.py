"""Pre-flight estimates and hard ceilings: a run that would exceed a ceiling never starts.

Before any training launches, `estimate` turns counted FLOPs per step, the memory estimate and the
wire size of one update into totals for the whole run - FLOPs, accelerator-hours, cost in USD from
`pricing.yaml`, peak memory, bytes moved - and `enforce` raises `BudgetExceeded` naming the ceiling
if any total is above the params' `preflight` section. Every path that can launch training
(Stage A, Stage B) calls both first.
"""
from __future__ import annotations

from pathlib import Path


from lensemble.config import Params, load_yaml
from lensemble.errors import BudgetExceeded, ConfigError


def load_pricing(path: Path) -> dict[str, dict[str, float]]:
    """hardware class → {usd_per_hour, sustained_tflops}; ConfigError on a malformed file."""
    if not Path(path).is_file():
        raise ConfigError(f"pricing file {path} does not exist")
    raw = load_yaml(path, "pricing file") or {}
    classes = raw.get("classes") if isinstance(raw, dict) else None
    if not isinstance(classes, dict):
        raise ConfigError(f"{path}: expected a top-level 'classes' mapping")
    for name, entry in classes.items():
        if not isinstance(entry, dict) or set(entry) != {"usd_per_hour", "sustained_tflops"}:
            raise ConfigError(f"{path}: class {name!r} needs exactly usd_per_hour and sustained_tflops")
        if entry["usd_per_hour"] < 0 or entry["sustained_tflops"] <= 0:
            raise ConfigError(f"{path}: class {name!r} has a negative price or non-positive throughput")
    return classes


def training_steps(params: Params, stage: str) -> int:
    """Optimizer steps a stage will take, summed over sites (the local-only baselines only when they are trained)."""
    if stage == "centralized":
        return params.centralized.steps
    if stage == "federate":
        sites = len(params.data.sites)
        federated = params.federate.rounds * params.federate.inner_steps * sites
        # the no-federation baselines: each site alone for as many steps as it trains in federation
        local_only = federated if params.federate.local_only else 0
        return federated + local_only + params.federate.head_adapt_steps * sites
    raise ValueError(f"stage {stage!r} does not train")


def estimate(params: Params, stage: str, *, flops_per_step: float, memory_bytes: float, update_bytes: float,
             hw_class: str, pricing: dict[str, dict[str, float]]) -> dict[str, float]:
    """Totals for one stage's run on `hw_class`; ConfigError if the class has no price. `update_bytes`: one site's
    bytes on the wire in a round, averaged over the rounds (a round with a frozen encoder sends less)."""
    if hw_class not in pricing:
        raise ConfigError(f"pricing.yaml has no entry for hardware class {hw_class!r}; add it to estimate cost")
    steps = training_steps(params, stage)
    flops = flops_per_step * steps
    hours = flops / (pricing[hw_class]["sustained_tflops"] * 1e12) / 3600
    rounds = params.federate.rounds if stage == "federate" else 0
    sites = len(params.data.sites)
    return {
        "steps": float(steps),
        "flops_per_step": float(flops_per_step),
        "flops_total": float(flops),
        "memory_gib": memory_bytes / 2**30,
        "bytes_per_round": float(update_bytes * sites) if rounds else 0.0,
        "bytes_total": float(update_bytes * sites * rounds),
        "accelerator_hours": hours,
        "cost_usd": hours * pricing[hw_class]["usd_per_hour"],
    }


def enforce(est: dict[str, float], params: Params, stage: str) -> None:
    """BudgetExceeded naming the first ceiling the estimate is over."""
    ceilings = params.preflight
    checks = (  # estimate key, its ceiling's key in the params' preflight section, unit
        ("cost_usd", "max_cost_usd", "USD"),
        ("accelerator_hours", "max_accelerator_hours", "h"),
        ("memory_gib", "max_memory_gib", "GiB"),
        ("bytes_total", "max_comm_bytes", "bytes"),
    )
    for key, ceiling, unit in checks:
        limit = getattr(ceilings, ceiling)
        if limit is not None and est[key] > limit:
            raise BudgetExceeded(f"{stage}: pre-flight {key} {est[key]:.4g} {unit} exceeds "
                                 f"preflight.{ceiling} = {limit:.4g}; nothing was launched")
