"""Stage `centralized` (Stage A): one model on pooled data, the upper bound."""
from __future__ import annotations

from prefect import flow

from flows.runs import STAGE_RUN
from orchestration.runner import stage_run
from tasks.preflight import preflight
from tasks.train import train_centralized


@flow(name="centralized", **STAGE_RUN)
def centralized_flow(root: str = ".") -> None:
    with stage_run("centralized", root) as ctx:
        pre = preflight(ctx.params, ctx.layout, "centralized", ctx.hw_class)
        ctx.extra_manifest.update(preflight=pre["estimate"], compute=pre["compute"], usd_per_hour=pre["usd_per_hour"])

        def losses(step: int, values) -> None:  # recorded as training goes: the stage's MLflow run streams them
            for name in ("loss/pred", "loss/proprio", "loss/sigreg"):
                ctx.metric(name, values[name], step=step)

        result = train_centralized(ctx.params, ctx.layout, ctx.out.path("models/centralized.pt"), on_losses=losses)
        for point in result["effective_dim_curve"]:
            ctx.metric("gauge/effective_dim", point["rankme"], step=point["step"])
        ctx.measured["perf/steps_per_second"] = result["steps"] / result["seconds"]
        ctx.measured.update(result["latency"])  # encoder / predictor latency, objective share, peak memory
        ctx.out.write_json("reports/centralized.json", {**result["mean"], "seconds": result["seconds"], "steps": result["steps"],
                                                        "steps_per_second": result["steps"] / result["seconds"], "latency": result["latency"],
                                                        "effective_dim_curve": result["effective_dim_curve"]})
        ctx.out.write_json("reports/plots/centralized_loss.json", [{"step": i, "pred": p, "sigreg": s} for i, (p, s) in enumerate(zip(result["losses"]["pred"], result["losses"]["sigreg"]))])
