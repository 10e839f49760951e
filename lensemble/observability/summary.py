"""The numeric summary of a stage: what `dvc metrics`, `dvc exp show` and the MLflow parent run compare.

Each stage's full report (`reports/<name>.json`) keeps hashes, names and per-round lists; its summary
(`reports/metrics/<stage>.json`, a DVC metrics file kept in git) holds only the few numbers a person
compares between experiments, nested one or two levels, rounded to 6 significant digits so a diff
shows a change rather than float noise. Hashes and names stay in the reports and the manifests.
"""
from __future__ import annotations

import math

# stage -> the name of the full report it summarizes (reports/<name>.json)
REPORTS = {"prepare": "prepare", "residency": "residency", "centralized": "centralized", "federate": "federate",
           "gauge": "gauge", "evaluate": "eval"}
MODELS = ("centralized", "federated", "local_only", "oracle", "random")
DIAGNOSED = ("centralized", "federated", "local_only")


def _num(x: float) -> float | int:
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    return float(f"{x:.6g}") if math.isfinite(x) else x


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def prepare(r: dict) -> dict:
    sites = [v for k, v in r["sites"].items() if k != "public_probe"]
    return {"site_episodes": sum(v["episodes"] for v in sites), "site_steps": sum(v["steps"] for v in sites)}


def residency(r: dict) -> dict:
    return {"sites_checked": len(r["sites"]), "leaks": sum(s["leaks"] for s in r["sites"]), "clean": int(r["status"] == "clean")}


def centralized(r: dict) -> dict:
    lat = r.get("latency", {})
    return {"loss": {k.removeprefix("loss/"): r[k] for k in ("loss/pred", "loss/proprio", "loss/sigreg") if k in r},
            "steps": r["steps"], "steps_per_second": r["steps_per_second"], "seconds": r["seconds"],
            **({"peak_memory_gib": lat["perf/peak_memory_gib"]} if "perf/peak_memory_gib" in lat else {})}


def federate(r: dict) -> dict:
    out = {"final_loss_pred": r["final_loss_pred"], "rounds": r["rounds"], "inner_steps": r["inner_steps"],
           "comm_bytes_total": r["comm_bytes_total"], "bytes_per_param": r["bytes_per_param"], "quant_ratio": r["quant_ratio"],
           "comm_reduction_vs_synchronous": r["step_synchronous_bytes"] / max(r["comm_bytes_total"], 1),
           "round_seconds_mean": r["round_seconds_mean"]}
    dp = r.get("dp")
    if dp and dp.get("enabled"):
        out["dp_epsilon"] = dp["epsilon"]
    return out


def gauge(r: dict) -> dict:
    last, final = r["per_round"][-1], r["final"]
    return {"drift_angle_deg_final": last["drift_angle_deg_mean"], "procrustes_residual_final": last["procrustes_residual_mean"],
            "effective_dim_fraction_min": r["effective_dim_fraction_min"], "effective_dim_vs_pooled_min": r["effective_dim_vs_pooled_min"],
            **({"effective_dim_within_vs_pooled_min": r["effective_dim_within_vs_pooled_min"]} if r.get("effective_dim_within_vs_pooled_min") is not None else {}),
            **({"temporal_share_vs_pooled_min": r["temporal_share_vs_pooled_min"]} if r.get("temporal_share_vs_pooled_min") is not None else {}),
            **({"effective_dim_vs_local_only_min": r["effective_dim_vs_local_only_min"]}
               if r.get("effective_dim_vs_local_only_min") is not None else {}),
            "rankme": {m: v["rankme"] for m, v in final["effective_dim"].items()},
            "drift_vs_pooled_deg": final["federated_vs_centralized"]["drift_angle_deg"], "collapse_tripwire": int(r["collapse_tripwire"])}


def _push_capture(diagnostics: list[dict]) -> dict:
    """{"push_capture": mean over the sites whose robot pushes its world}, or {} when none does."""
    shares = [d["push_capture"] for d in diagnostics if "push_capture" in d]
    return {"push_capture": _mean(shares)} if shares else {}


def evaluate(r: dict) -> dict:
    success = {m: {emb: row[m] for emb, row in r["embodiments"].items() if m in row} for m in MODELS}
    success = {m: {**v, "mean": r["mean_success_rate"][m]} for m, v in success.items() if v and m in r["mean_success_rate"]}
    diag = {m: [s["diagnostics"][m] for s in r["sites"].values() if m in s.get("diagnostics", {})] for m in DIAGNOSED}
    dynamics = {m: {"latent_1step_vs_copy": _mean([d["rollout_vs_copy"][0] for d in ds]),
                    "action_sensitivity": _mean([d["action_sensitivity"] for d in ds]),
                    "probe_r2": _mean([d["probe_r2"] for d in ds]),
                    **_push_capture(ds)} for m, ds in diag.items() if ds}
    return {"success_rate": success, **({"dynamics": dynamics} if dynamics else {})}


SUMMARIES = {"prepare": prepare, "residency": residency, "centralized": centralized, "federate": federate,
             "gauge": gauge, "evaluate": evaluate}


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return _num(x)


def summarize(stage: str, report: dict) -> dict:
    """The numeric summary of `stage`'s full report: nested dicts of numbers only."""
    return _rounded(SUMMARIES[stage](report))


def flat(summary: dict, prefix: str = "") -> dict[str, float]:
    """`{"a": {"b": 1}}` -> `{"a/b": 1.0}`: the summary as MLflow metric keys."""
    out = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = float(v)
    return out
