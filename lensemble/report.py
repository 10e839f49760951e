"""The run report: a verdict on whether federation worked, key figures of every stage, the budget bands of the
run's hardware class, plots and the small numeric plot files `dvc plots diff` compares across experiments.

Pure functions of the stages' report dicts (`reports/{centralized,federate,gauge,eval}.json`); `tasks/report.py`
reads them and writes what these return. The verdict's rule is `VERDICT_RULE`, stated in the report itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from scipy import stats

from lensemble.stats import wilson_interval

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODELS = ("centralized", "federated", "local_only", "oracle", "random")  # eval.json agent keys, in plot order
LABELS = {"centralized": "pooled", "federated": "federated", "local_only": "local-only", "oracle": "oracle",
          "random": "random"}
COLORS = {"centralized": "#1f77b4", "federated": "#ff7f0e", "local_only": "#2ca02c", "oracle": "#7f7f7f",
          "random": "#c7c7c7"}
WITHIN_POOLED = 0.10  # federated "matches" pooled when its success rate is at least (1 − this) × pooled's
ALPHA = 0.05  # significance level of every two-sample comparison
# A Haar-random rotation's principal angles are spread over [0°, 180°] with mean 90°: two unrelated frames
# (independent encoders, or Procrustes between independent Gaussian embeddings) read 90° (tested).
DRIFT_CHANCE_DEG = 90.0
# No budget or params key bands drift; half-way to unrelated frames is this report's warning line.
DRIFT_WARN_DEG = 45.0
# Issue 14 dropped "≥ 50% of the latent width" as a budget (ill-posed for worlds with 2-4 degrees of freedom);
# an embedding using under a tenth of its width is still worth a warning whatever the pooled model does.
EFFECTIVE_DIM_WARN_FRACTION = 0.10
VERDICT_RULE = (
    f"Federation **worked** on an embodiment when the federated model's success rate is within {WITHIN_POOLED:.0%} of "
    f"the pooled model's (≥ {1 - WITHIN_POOLED:.1f} × pooled), not significantly below it, and significantly above "
    "random actions. It **did not work** when the federated model is significantly below pooled or not "
    "significantly above random while pooled is. It is **not shown** when the federated model is below that "
    f"margin but not significantly (these episodes cannot tell; evaluate more), and **inconclusive** when the pooled "
    "model itself is not significantly above random (the task does not separate a trained model from none). "
    f"Significance: two-sided Fisher exact test (`scipy.stats.fisher_exact`) on the success counts, p < {ALPHA:g}. "
    "Intervals: 95% Wilson score.")


@dataclass(frozen=True)
class Count:
    """Closed-loop successes of one model over `episodes` episodes."""

    successes: int
    episodes: int

    @property
    def rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def ci(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.episodes)

    def cell(self) -> str:
        low, high = self.ci
        return f"{self.rate:.2f} [{low:.2f}, {high:.2f}]"


@dataclass(frozen=True)
class Verdict:
    """Whether federation worked on one embodiment, with the comparisons that decided it."""

    embodiment: str
    counts: dict[str, Count]  # model → its successes over the embodiment's sites; only models every site ran
    p_vs_pooled: float  # Fisher exact, federated vs pooled
    p_vs_local: float | None  # federated vs local-only; None when local-only was not trained
    p_vs_random: float  # federated vs random actions
    p_pooled_vs_random: float
    outcome: str  # "worked" | "did not work" | "not shown" | "inconclusive"
    readings: tuple[str, ...]  # plain-words comparisons, in the order of the rule


def fisher_p(a: Count, b: Count) -> float:
    """Two-sided Fisher exact p-value that `a` and `b` have the same success probability."""
    table = [[a.successes, a.episodes - a.successes], [b.successes, b.episodes - b.successes]]
    return float(stats.fisher_exact(table).pvalue)


def embodiment_counts(sites: dict, embodiment: str) -> dict[str, Count]:
    """Successes (rate × episodes, per site) summed over `embodiment`'s sites in eval.json `sites`; the rate equals
    eval.json `embodiments`' mean when every site runs the same episodes, as the evaluate stage does."""
    rows = [r for r in sites.values() if r["embodiment"] == embodiment]
    if not rows:
        raise ValueError(f"no site of eval.json evaluates embodiment {embodiment!r}")
    return {m: Count(sum(round(r[m]["success_rate"] * r[m]["episodes"]) for r in rows),
                     sum(int(r[m]["episodes"]) for r in rows))
            for m in MODELS if all(m in r for r in rows)}


def _versus(a: Count, b: Count, p: float) -> str:
    return f"{a.rate:.2f} vs {b.rate:.2f}, p = {p:.3g}"


def judge(embodiment: str, counts: dict[str, Count]) -> Verdict:
    """The verdict of `VERDICT_RULE` on one embodiment's success counts (needs centralized, federated, random)."""
    fed, pooled, rand = counts["federated"], counts["centralized"], counts["random"]
    local = counts.get("local_only")
    p_pooled, p_random, p_pooled_random = fisher_p(fed, pooled), fisher_p(fed, rand), fisher_p(pooled, rand)
    p_local = None if local is None else fisher_p(fed, local)
    within = fed.rate >= (1 - WITHIN_POOLED) * pooled.rate
    worse = fed.rate < pooled.rate and p_pooled < ALPHA
    above_random = fed.rate > rand.rate and p_random < ALPHA
    pooled_above_random = pooled.rate > rand.rate and p_pooled_random < ALPHA
    if fed.successes == pooled.successes == 0:
        readings = [f"federated and pooled both never succeeded ({_versus(fed, pooled, p_pooled)})"]
    elif fed.rate > (1 + WITHIN_POOLED) * pooled.rate:
        readings = [f"federated above pooled ({_versus(fed, pooled, p_pooled)})"]
    elif within:
        readings = [f"federated within {WITHIN_POOLED:.0%} of pooled ({_versus(fed, pooled, p_pooled)})"]
    else:
        how = "significantly" if worse else "not significantly"
        readings = [f"federated below pooled, {how} ({_versus(fed, pooled, p_pooled)})"]
    if local is None:
        readings.append("local-only not trained")
    elif p_local >= ALPHA:
        readings.append(f"not distinguishable from local-only ({_versus(fed, local, p_local)})")
    else:
        side = "better" if fed.rate > local.rate else "worse"
        readings.append(f"{side} than local-only ({_versus(fed, local, p_local)})")
    if above_random:
        readings.append(f"above random ({_versus(fed, rand, p_random)})")
    else:
        readings.append(f"not distinguishable from random ({_versus(fed, rand, p_random)})")
    if within and not worse and above_random:
        outcome = "worked"
    elif not pooled_above_random:
        outcome = "inconclusive"
        readings.append(f"pooled itself not above random ({_versus(pooled, rand, p_pooled_random)})")
    elif worse or not above_random:
        outcome = "did not work"
    else:
        outcome = "not shown"
    return Verdict(embodiment, counts, p_pooled, p_local, p_random, p_pooled_random, outcome, tuple(readings))


def push_reading(sites: dict, embodiment: str) -> str | None:
    """For a robot that pushes its world: the share of a push each world model's 1-step prediction carries (push capture,
    mean over the embodiment's sites), the first thing to read when its models plan far below the oracle; None otherwise."""
    rows = [r for r in sites.values() if r["embodiment"] == embodiment]
    shares = {m: [r["diagnostics"][m]["push_capture"] for r in rows if "push_capture" in r.get("diagnostics", {}).get(m, {})]
              for m in MODELS}
    means = {m: sum(v) / len(v) for m, v in shares.items() if v}
    if not means:
        return None
    return ("its models predict " + ", ".join(f"{LABELS[m]} {v:.2f}" for m, v in means.items())
            + " of a push (push capture: 0, the agent passes through the block as if it were not there; 1, the push as it happens)")


def verdicts(evaluation: dict) -> list[Verdict]:
    """One verdict per embodiment of eval.json, in its `embodiments` order; a pushing robot's verdict also reads its push capture."""
    out = []
    for emb in evaluation["embodiments"]:
        v = judge(emb, embodiment_counts(evaluation["sites"], emb))
        push = push_reading(evaluation["sites"], emb)
        out.append(v if push is None else dataclasses.replace(v, readings=(*v.readings, push)))
    return out


def verdict_lines(rows: list[Verdict]) -> list[str]:
    """The verdict table (success rate [95% Wilson] per model) and one plain-words line per embodiment."""
    lines = []
    for v in rows:  # the answers first: what a reader (or the MLflow run's description) sees without scrolling
        answer = {"worked": "federation worked", "did not work": "federation did not work",
                  "not shown": "federation not shown to work (below the margin, not significantly: more episodes would tell)",
                  "inconclusive": "inconclusive, federation cannot be judged"}[v.outcome]
        lines.append(f"- **{v.embodiment}: {answer}** — {'; '.join(v.readings)}.")
    lines += ["", "| embodiment | episodes | pooled | federated | local-only | oracle | random | federation |",
              "|---|---|---|---|---|---|---|---|"]
    for v in rows:
        cells = " | ".join(v.counts[m].cell() if m in v.counts else "—" for m in MODELS)
        lines.append(f"| {v.embodiment} | {v.counts['federated'].episodes} | {cells} | **{v.outcome}** |")
    return [*lines, "", VERDICT_RULE]


def out_of_band_lines(budgets: list[dict]) -> list[str]:
    """Every budget row whose status is not `within` (lensemble.budgets): its value and band."""
    lines = []
    for b in budgets:
        if b["status"] == "within":
            continue
        where = f"`{b['name']}` ({b['stage']}, `{b['metric']}`)"
        if b["status"] in ("below", "above"):
            lines.append(f"- {where}: {b['value']:.4g}, {b['status']} its band [{b['low']:g}, {b['high']:g}] "
                         f"{b['unit']} (response: {b['response']})")
        elif b["status"] == "not_measured":
            lines.append(f"- {where}: not measured (band [{b['low']:g}, {b['high']:g}] {b['unit']})")
        else:
            lines.append(f"- {where}: no band for this hardware class")
    return lines or [f"- none: all {len(budgets)} budgets within their bands"]


def _lowest_robot(gauge: dict, key: str) -> tuple[dict, str] | None:
    """The round and robot with the lowest per-embodiment ratio `key` (`within_vs_pooled`, `temporal_vs_pooled`)."""
    rows = [r for r in gauge["per_round"] if r.get(key)]
    if not rows:
        return None
    worst = min(rows, key=lambda r: min(r[key].values()))
    return worst, min(worst[key], key=worst[key].get)


def within_embodiment_lines(gauge: dict) -> list[str]:
    """The collapse check read per embodiment: a whole-probe RankMe can fall because the robots sit far apart (the
    variance between their centroids dominates) while no robot's own representation has collapsed."""
    low, lowest = gauge.get("effective_dim_within_vs_pooled_min"), _lowest_robot(gauge, "within_vs_pooled")
    if low is None or lowest is None:
        return []
    (worst, emb), lowest_whole = lowest, min(gauge["per_round"], key=lambda r: r["effective_dim_vs_pooled"])
    return [(
        f"  - per embodiment, lowest federated ÷ pooled RankMe {low:.2f} ({emb}, round {worst['round']}); in the round with the "
        f"lowest whole-probe ratio (round {lowest_whole['round']}) {lowest_whole.get('between_fraction', float('nan')):.0%} of the probe's variance lies between the "
        f"embodiments' centroids (pooled {lowest_whole.get('pooled_between_fraction', float('nan')):.0%})"), *temporal_lines(gauge)]


def temporal_lines(gauge: dict) -> list[str]:
    """The temporal-collapse reading: each robot's within-episode variance share (what moves over time) against the
    pooled model's at the same point of training."""
    low, lowest = gauge.get("temporal_share_vs_pooled_min"), _lowest_robot(gauge, "temporal_vs_pooled")
    if low is None or lowest is None:
        return []
    worst, emb = lowest
    return [f"  - per embodiment, lowest federated ÷ pooled within-episode variance share (what moves from frame to frame) "
            f"{low:.2f} ({emb}, round {worst['round']}: {worst['temporal_share'][emb]:.0%} of its variance against "
            f"{worst['pooled_temporal_share'][emb]:.0%})"]


def alone_lines(gauge: dict) -> list[str]:
    """Each robot's RankMe against its site's encoder trained alone (the local-only baseline): the lowest round
    (`gauge.rounds_against_alone`) and the three figures at the end (`gauge.dimension_against_alone`); nothing when
    the local-only baselines were not trained."""
    a = gauge.get("final", {}).get("dimension_against_alone")
    if not a or a.get("federated_vs_local_only_min") is None:
        return []
    cells = ", ".join(f"{site} ({emb}) {a['federated'][emb]:.1f} / {a['pooled'][emb]:.1f} / {a['local_only'][site]:.1f}"
                      for site, emb in a["embodiment_of"].items())
    lines = [f"  - at the end, each robot's RankMe federated / pooled / its site's encoder trained alone (local-only: no federation, "
             f"no other robot): {cells}"]
    rows = [(v, site, r["round"]) for r in gauge["per_round"] for site, v in r.get("vs_alone", {}).items()]
    if rows and gauge.get("effective_dim_vs_local_only_min") is not None:
        _, site, worst = min(rows)
        lines.append(f"  - per robot, lowest federated ÷ trained alone at the same point of training "
                     f"{gauge['effective_dim_vs_local_only_min']:.2f} ({site}, round {worst}); at the end {a['federated_vs_local_only_min']:.2f}")
    return lines


def gauge_warning_lines(gauge: dict, collapse_drop_fraction: float | None) -> list[str]:
    """Collapse and drift checks with their thresholds; a WARNING marker on each that fails."""
    mark = lambda bad: "**WARNING**" if bad else "ok"  # noqa: E731
    rounds, latent = gauge["per_round"], gauge["final"]["latent_dim"]
    lowest, last = min(rounds, key=lambda r: r["effective_dim"]), rounds[-1]
    frac, tripped = gauge["effective_dim_fraction_min"], gauge["collapse_tripwire"]
    if collapse_drop_fraction is None:
        threshold = "threshold not given"
    else:
        threshold = (f"trips below {1 - collapse_drop_fraction:.2f} × pooled, "
                     f"`gauge.collapse_drop_fraction` = {collapse_drop_fraction:g}")
    if any("within_vs_pooled" in r for r in rounds):
        reads = ("reads each robot's effective dimension (RankMe) and within-episode variance share against the pooled "
                 f"model's at the same point of training; whole-probe ratio {gauge['effective_dim_vs_pooled_min']:.2f}, not read")
    else:
        reads = f"lowest federated ÷ pooled effective dimension (RankMe, same point of training) {gauge['effective_dim_vs_pooled_min']:.2f}"
    reasons = list(gauge.get("collapse_reasons", ()))
    named = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
    return [
        f"- {mark(tripped)} collapse tripwire {'TRIPPED' if tripped else 'quiet'}: {reads} ({threshold})" + (f": {named}" if reasons else ""),
        *within_embodiment_lines(gauge),
        *alone_lines(gauge),
        f"- {mark(frac < EFFECTIVE_DIM_WARN_FRACTION)} effective dimension: lowest {frac:.1%} of the {latent}-d latent "
        f"(RankMe {lowest['effective_dim']:.1f}, round {lowest['round']}), final {last['effective_dim']:.1f} "
        f"({last['effective_dim'] / latent:.0%}); warning under {EFFECTIVE_DIM_WARN_FRACTION:.0%} of the latent width",
        f"- {mark(last['drift_angle_deg_mean'] > DRIFT_WARN_DEG)} frame drift at the last round: mean over sites "
        f"{last['drift_angle_deg_mean']:.1f}°, max {last['drift_angle_deg_max']:.1f}°; warning over "
        f"{DRIFT_WARN_DEG:g}° mean, half-way to unrelated frames at {DRIFT_CHANCE_DEG:g}° (no configured band)",
    ]


def verdict_section(figures: dict, budgets: list[dict], collapse_drop_fraction: float | None) -> list[str]:
    """The report's opening: did federation work, which budgets left their band, collapse and drift."""
    return ["## Verdict", "", *verdict_lines(verdicts(figures["eval"])), "",
            "### Budgets out of band", "", *out_of_band_lines(budgets), "",
            "### Collapse and drift", "", *gauge_warning_lines(figures["gauge"], collapse_drop_fraction)]


# ------------------------------------------------------------------ plot data (reports/plots/*.json, dvc plots)


def site_mean(record: dict, name: str) -> float:
    """Mean of metric `name` over the sites present in one federate.json round."""
    values = [s[name] for s in record["sites"].values()]
    return sum(values) / len(values)


def success_rows(rows: list[Verdict]) -> list[dict]:
    """reports/plots/success.json: per embodiment and model, success over its sites and the 95% Wilson interval."""
    out = []
    for v in rows:
        for model, c in v.counts.items():
            low, high = c.ci
            out.append({"label": f"{v.embodiment}/{model}", "embodiment": v.embodiment, "model": model,
                        "success_rate": c.rate, "ci_low": low, "ci_high": high})
    return out


def round_rows(federate: dict, gauge: dict) -> list[dict]:
    """reports/plots/rounds.json: per round drift, effective dimension, federated loss and cumulative wire bytes."""
    fed = {r["round"]: r for r in federate["per_round"]}
    out, total = [], 0
    for g in gauge["per_round"]:
        record = fed[g["round"]]
        total += sum(s["comm_bytes"] for s in record["sites"].values())
        out.append({"round": g["round"], "drift_angle_deg_mean": g["drift_angle_deg_mean"],
                    "drift_angle_deg_max": g["drift_angle_deg_max"], "effective_dim": g["effective_dim"],
                    "pooled_effective_dim": g["pooled_effective_dim"],
                    "loss_pred_federated": site_mean(record, "loss/pred"), "comm_bytes_cumulative": total})
    return out


def pooled_loss_rows(central: list[dict], max_rows: int = 200) -> list[dict]:
    """reports/plots/loss_curve.json: Stage A's loss/pred at ≤ `max_rows` evenly spaced steps, first and last kept."""
    n, rows = len(central), min(len(central), max_rows)
    picks = sorted({round(i * (n - 1) / max(rows - 1, 1)) for i in range(rows)})
    return [{"step": int(central[i]["step"]), "pooled": float(central[i]["pred"])} for i in picks]


def federated_loss_rows(federate: dict) -> list[dict]:
    """reports/plots/federated_loss.json: site-mean loss/pred of round r (the mean over its H inner steps) at inner
    step (r + 1) × H, the step count each site has taken when the round ends."""
    h = federate["inner_steps"]
    return [{"step": (r["round"] + 1) * h, "federated": site_mean(r, "loss/pred")} for r in federate["per_round"]]


# ------------------------------------------------------------------ plots


def _save(fig, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_success(rows: list[dict], path: Path) -> None:
    """Grouped bars: success rate per embodiment and model, 95% Wilson intervals as whiskers."""
    embodiments = list(dict.fromkeys(r["embodiment"] for r in rows))
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(embodiments)), 3.8))
    for j, model in enumerate(models):
        mine = {r["embodiment"]: r for r in rows if r["model"] == model}
        xs = [i + (j - (len(models) - 1) / 2) * width for i, e in enumerate(embodiments) if e in mine]
        ys = [mine[e]["success_rate"] for e in embodiments if e in mine]
        err = [[mine[e]["success_rate"] - mine[e]["ci_low"] for e in embodiments if e in mine],
               [mine[e]["ci_high"] - mine[e]["success_rate"] for e in embodiments if e in mine]]
        ax.bar(xs, ys, width * 0.92, yerr=err, capsize=3, color=COLORS[model], edgecolor="black", linewidth=0.5,
               error_kw={"elinewidth": 0.8}, label=LABELS[model])
        for x, y, top in zip(xs, ys, [mine[e]["ci_high"] for e in embodiments if e in mine]):
            ax.annotate(f"{y:.2f}", (x, top), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=6)
    ax.set_xticks(range(len(embodiments)), embodiments)
    ax.set(title="Closed-loop success per embodiment (whiskers: 95% Wilson interval)", xlabel="embodiment",
           ylabel="success rate (fraction of episodes)", ylim=(0, 1.15))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(models), fontsize=8, frameon=False)
    _save(fig, path)


def plot_losses(central: list[dict], federate: dict, path: Path) -> None:
    """Pooled and federated prediction loss on one axis against the optimizer steps each model has taken."""
    h = federate["inner_steps"]
    steps, pred = [r["step"] for r in central], [r["pred"] for r in central]
    windows = [(k + 1) * h for k in range(len(pred) // h)]
    window_means = [sum(pred[k * h:(k + 1) * h]) / h for k in range(len(windows))]
    fed = federated_loss_rows(federate)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(steps, pred, color=COLORS["centralized"], alpha=0.25, linewidth=0.6, label="pooled, every step")
    ax.plot(windows, window_means, color=COLORS["centralized"], marker=".",
            label=f"pooled, mean of each {h}-step window")
    ax.plot([r["step"] for r in fed], [r["federated"] for r in fed], color=COLORS["federated"], marker="o",
            label=f"federated, site mean of a round's H={h} inner steps")
    ax.set(title="Prediction loss: pooled (Stage A) vs federated (Stage B)\n(latent MSE: it rises early as SIGReg "
                 "spreads the near-collapsed initial embeddings)", yscale="log",
           xlabel="optimizer steps (pooled) / inner steps per site (federated)",
           ylabel="loss/pred (latent MSE, log scale)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    _save(fig, path)


def plot_drift(rounds: list[dict], path: Path) -> None:
    """Drift per round (mean and max over sites) against the warning line and the unrelated-frames level."""
    xs = [r["round"] for r in rounds]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.axhspan(DRIFT_WARN_DEG, 180, color="tab:red", alpha=0.08,
               label=f"warning when the MEAN angle is over {DRIFT_WARN_DEG:g}° (half-way to unrelated; report convention)")
    ax.axhline(DRIFT_CHANCE_DEG, color="black", linestyle="--", linewidth=0.8,
               label=f"{DRIFT_CHANCE_DEG:g}°: unrelated frames (mean angle of a random rotation)")
    ax.plot(xs, [r["drift_angle_deg_mean"] for r in rounds], marker="o", color="tab:blue",
            label="mean angle, mean over sites")
    ax.plot(xs, [r["drift_angle_deg_max"] for r in rounds], marker="^", color="tab:purple", linewidth=0.8,
            label="largest angle, max over sites")
    ax.set(title="Frame drift of each site from the round-start global model", xlabel="federation round",
           ylabel="Procrustes rotation angle (degrees)", ylim=(0, 180), yticks=range(0, 181, 30))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    _save(fig, path)


def plot_comm(rounds: list[dict], federate: dict, path: Path) -> None:
    """Cumulative bytes on a log axis: federated per round, a step-synchronous run over the same training, and
    pooling the raw data once before training."""
    xs = [r["round"] + 1 for r in rounds]
    n = len(xs)
    sync = federate["step_synchronous_bytes"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    federated = [r["comm_bytes_cumulative"] for r in rounds]
    series = (("step-synchronous data parallel", [sync * x / n for x in xs], "tab:red", "--"),
              ("pooling the raw data (one upload)", [federate["pooling_bytes"]] * n, "tab:gray", ":"),
              (f"federated ({federate['transport']})", federated, COLORS["federated"], "-"))
    for label, ys, color, style in series:
        ax.plot(xs, ys, color=color, linestyle=style, marker="o", markersize=3, label=f"{label}: {ys[-1]:.3g} B in all")
    ax.set(title="Bytes on the wire, cumulative (local-only moves 0 bytes)", yscale="log",
           xlabel="federation rounds completed (same training progress for every curve)", ylabel="bytes (log scale)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, fontsize=8, frameon=False)
    _save(fig, path)


def plot_ablation(points: list[dict], drift_path: Path, success_path: Path) -> None:
    """Frame drift and closed-loop success of each (H, λ_anc) point against the bytes its federation moved."""
    for path, key, ylabel, title in (
        (drift_path, "drift_angle_deg_final", "final-round drift angle (deg)", "Frame drift vs communication"),
        (success_path, "mean_success", "federated success rate (mean over sites)", "Closed-loop success vs communication"),
    ):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for anchor in sorted({p["anchor_weight"] for p in points}):
            mine = sorted((p for p in points if p["anchor_weight"] == anchor), key=lambda p: p["comm_bytes"])
            ax.plot([p["comm_bytes"] for p in mine], [p[key] for p in mine], marker="o", label=f"λ_anc = {anchor:g}")
            for p in mine:
                ax.annotate(f"H={p['inner_steps']}", (p["comm_bytes"], p[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(title=title, xlabel="bytes on the wire per run", ylabel=ylabel, xscale="log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def dynamics_lines(f: dict, e: dict) -> list[str]:
    """The dynamics diagnostics: final models (evaluate) and the global model entering each round (sites)."""
    lines = ["## Dynamics diagnostics (held-out probe episodes)", "",
             "Rollout error over copying the last context observation (< 1: better than 'nothing moves'), action sensitivity "
             "(error with shuffled actions ÷ with the real ones; 1: actions ignored), linear-probe R² of the robot's state from the "
             "embedding, and of the world state only the frame shows (PushT's block, the target) on simulator states drawn for it; "
             "for a robot that pushes its world, push capture: the median share of a push (a step that moves the block) the 1-step "
             "prediction carries, 0 when it predicts the agent passing as if the block were not there, 1 when it predicts the push "
             "(in brackets: the share of pushes predicted nearer the true frame than the pushed-nothing one).", "",
             "| site | model | latent 1-step ÷ copy | latent H-step ÷ copy | proprio 1-step ÷ copy | action sens. latent | action sens. proprio | probe R² | world probe R² | push capture |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for site, r in e["sites"].items():
        for model, d in r.get("diagnostics", {}).items():
            world = ", ".join(f"{k} {v:.3f}" for k, v in d.get("world_probe_r2", {}).items()) or "—"
            push = f"{d['push_capture']:.2f} ({d['push_closer']:.0%})" if "push_capture" in d else "—"
            lines.append(f"| {site} | {model} | {d['rollout_vs_copy'][0]:.3f} | {d['rollout_vs_copy'][-1]:.3f} | {d['rollout_vs_copy_proprio'][0]:.3f} | "
                         f"{d['action_sensitivity']:.2f} | {d['action_sensitivity_proprio']:.2f} | {d['probe_r2']:.3f} | {world} | {push} |")
    lines += ["", "Global model entering each round (computed at each site with its own head):", "",
              "| round | site | latent 1-step ÷ copy | action sens. latent | action sens. proprio | probe R² |", "|---|---|---|---|---|---|"]
    for r in f["per_round"]:
        for site, m in r["sites"].items():
            if "eval/rollout_vs_copy" in m:
                lines.append(f"| {r['round']} | {site} | {m['eval/rollout_vs_copy']:.3f} | {m['eval/action_sensitivity']:.2f} | "
                             f"{m['eval/action_sensitivity_proprio']:.2f} | {m['eval/probe_r2']:.3f} |")
    return lines


def privacy_lines(federate: dict) -> list[str]:
    """One line on the run's update clipping and differential privacy (none when the run used neither)."""
    d = federate.get("dp")
    if not d:
        return []
    clipped = "—" if d["clip_fraction_mean"] is None else f"{d['clip_fraction_mean']:.0%}"
    if not d["enabled"]:
        return [f"- update clipping at L2 {d['clip_norm']:g} without noise (no DP guarantee); {clipped} of site updates clipped"]
    return [f"- differential privacy: ε = {d['epsilon']:.3g} at δ = {d['delta']:g} after {d['rounds']} rounds (RDP accountant; "
            f"noise multiplier z = {d['noise_multiplier']:g}, clip norm S = {d['clip_norm']:g}); {clipped} of site updates clipped"]


def _lowest_cell(row: dict, key: str) -> str:
    """The lowest robot's ratio `key` of a round row, with its name ("n/a" for a row without per-robot figures)."""
    w = row.get(key)
    if not w:
        return "n/a"
    emb = min(w, key=w.get)
    return f"{w[emb]:.2f} ({emb})"


def _between_cell(row: dict) -> str:
    if "between_fraction" not in row or "pooled_between_fraction" not in row:
        return "n/a"
    return f"{row['between_fraction']:.0%} / {row['pooled_between_fraction']:.0%}"


def render_markdown(figures: dict, budgets: list[dict], hw_class: str, hardware: str,
                    collapse_drop_fraction: float | None = None) -> str:
    """The report text: the verdict first, then every stage's figures; `collapse_drop_fraction` is the run's
    `gauge.collapse_drop_fraction`, printed as the tripwire's threshold."""
    c, f, g, e = figures["centralized"], figures["federate"], figures["gauge"], figures["eval"]
    lines = [
        "# Lensemble run report", "",
        f"Hardware class `{hw_class}` — {hardware}", "",
        *verdict_section(figures, budgets, collapse_drop_fraction), "",
        "## Stage A — centralized (pooled)", "",
        f"- steps: {c['steps']}, {c['steps_per_second']:.1f} steps/s, {c['seconds']:.1f} s",
        f"- mean loss/pred {c['loss/pred']:.4f}, loss/proprio {c.get('loss/proprio', float('nan')):.4f}, loss/sigreg {c['loss/sigreg']:.4f}", "",
        "## Stage B — federated (DiLoCo)", "",
        f"- transport `{f['transport']}`, {len(f['sites'])} sites, {f['rounds']} rounds × H={f['inner_steps']}",
        f"- federated parameters {f['federated_params']:,}; on-wire {f['comm_bytes_total']:,} bytes ({f['bytes_per_param']:.3f} bytes/param/round/site)",
        f"- a step-synchronous data-parallel run would move {f['step_synchronous_bytes']:,} bytes "
        f"({f['step_synchronous_bytes'] / max(f['comm_bytes_total'], 1):.0f}× more)",
        f"- mean round {f['round_seconds_mean']:.2f} s; final global params sha256 `{f['global_params_sha256'][:16]}…`",
        *privacy_lines(f), "",
        "## Gauge", "",
        f"- final drift (mean over sites): {g['per_round'][-1]['drift_angle_deg_mean']:.2f}°; residual {g['per_round'][-1]['procrustes_residual_mean']:.3f}",
        f"- Stage B vs Stage A frame: {g['final']['federated_vs_centralized']['drift_angle_deg']:.1f}°, residual {g['final']['federated_vs_centralized']['procrustes_residual']:.3f}",
        f"- effective dim (RankMe) federated {g['final']['effective_dim']['federated']['rankme']:.1f} of {g['final']['latent_dim']}, "
        f"lowest over the run {g['effective_dim_fraction_min']:.1%} of the latent dimension; "
        f"federated ÷ pooled at the same point of training, lowest round: {g['effective_dim_vs_pooled_min']:.2f}; "
        f"collapse tripwire (against the pooled model) {'TRIPPED' if g['collapse_tripwire'] else 'quiet'}", "",
        "| round | federated RankMe | pooled RankMe | ratio | lowest ratio per embodiment | lowest within-episode share ratio | "
        "between-embodiment variance, federated / pooled | drift ° |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {r['round']} | {r['effective_dim']:.2f} | {r['pooled_effective_dim']:.2f} | {r['effective_dim_vs_pooled']:.2f} | "
          f"{_lowest_cell(r, 'within_vs_pooled')} | {_lowest_cell(r, 'temporal_vs_pooled')} | {_between_cell(r)} | {r['drift_angle_deg_mean']:.2f} |" for r in g["per_round"]), "",
        *dynamics_lines(f, e), "",
        "## Closed-loop latent-MPC evaluation", "",
        "Every agent runs the same episodes (seeds, starts, goals). The oracle is the same CEM with the true simulator as its",
        "model and the success criterion's own distance as its energy: what the protocol allows a perfect model. Every agent",
        "reads its energy over the plan's horizon the same way: at the last step, or the mean of every step (reaching tasks:",
        "a plan that reaches the goal early and stays there scores best).", "",
        "| site | embodiment | centralized (pooled) | federated | local-only | oracle | random | plan s |", "|---|---|---|---|---|---|---|---|",
    ]
    for site, r in e["sites"].items():
        cell = lambda m: f"{r[m]['success_rate']:.2f} [{r[m]['ci_low']:.2f}, {r[m]['ci_high']:.2f}]" if m in r else "not trained"  # noqa: E731
        lines.append(f"| {site} | {r['embodiment']} | {cell('centralized')} | {cell('federated')} | {cell('local_only')} | {cell('oracle')} | "
                     f"{cell('random')} | {r['federated']['plan_seconds']:.3f} |")
    lines += ["", "| embodiment | episodes | step budget | energy over the horizon | energy weighs | success criterion "
                  "| pooled ÷ oracle | federated ÷ pooled |", "|---|---|---|---|---|---|---|---|"]
    for emb, row in e.get("embodiments", {}).items():
        pooled_of_oracle = row["of_oracle"].get("centralized")
        fed_of_pooled = row["federated"] / row["centralized"] if row["centralized"] > 0 else None
        fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
        energy = {"final": "last step", "mean": "mean of every step"}.get(row.get("energy", "final"), row.get("energy"))
        lines.append(f"| {emb} | {row['episodes']:.0f} | {row['max_steps']} | {energy} | {row.get('energy_terms') or '—'} "
                     f"| {row['success_criterion']} | {fmt(pooled_of_oracle)} | {fmt(fed_of_pooled)} |")
    lines += ["", "Energy weighs: the goal energy's weight on each run of the embodiment's proprioception components (0-based, in "
              "the order it records them) and on the image latent's squared distance to the goal's."]
    lines += ["", "Communication each needed: federated "
              f"{f['comm_bytes_total']:,} bytes on the wire; pooling the raw data centrally {f['pooling_bytes']:,} bytes; "
              f"a step-synchronous data-parallel run {f['step_synchronous_bytes']:,} bytes; local-only 0 bytes."]
    lines += ["", f"## Budgets ({hw_class})", "", "| budget | stage | metric | band | value | status |", "|---|---|---|---|---|---|"]
    for b in budgets:
        band = "—" if b["low"] is None else f"[{b['low']:g}, {b['high']:g}] {b['unit']}" + (" (planning)" if b.get("planning") else "")
        value = "—" if b["value"] is None else f"{b['value']:.4g}"
        lines.append(f"| {b['name']} | {b['stage']} | `{b['metric']}` | {band} | {value} | {b['status']} |")
    lines += ["", "Plots: `plots/success.png`, `plots/losses.png`, `plots/drift.png`, `plots/comm_bytes.png`; their numbers, "
              "for `dvc plots diff`: `plots/success.json`, `plots/rounds.json`, `plots/loss_curve.json`, "
              "`plots/federated_loss.json`.", ""]
    return "\n".join(lines)
