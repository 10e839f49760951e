"""The run report: key figures of every stage, the budget bands of the run's hardware class, plots."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_losses(central: list[dict], federate: dict, path: Path) -> None:
    """Stage A per-step losses and Stage B per-round mean site losses."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    axes[0].plot([r["step"] for r in central], [r["pred"] for r in central], label="loss/pred")
    axes[0].plot([r["step"] for r in central], [r["sigreg"] for r in central], label="loss/sigreg")
    axes[0].set(title="Stage A (pooled)", xlabel="step", yscale="log")
    axes[0].legend()
    rounds = federate["per_round"]
    for name in ("loss/pred", "loss/sigreg", "loss/anchor"):
        vals = [sum(s[name] for s in r["sites"].values()) / len(r["sites"]) for r in rounds]
        axes[1].plot([r["round"] for r in rounds], vals, marker="o", label=name)
    axes[1].set(title="Stage B (site mean per round)", xlabel="round", yscale="log")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_series(xs: list, series: dict[str, list], title: str, ylabel: str, path: Path) -> None:
    """One line per named series against round."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set(title=title, xlabel="round", ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
             "(error with shuffled actions ÷ with the real ones; 1: actions ignored), linear-probe R² of the state from the embedding.", "",
             "| site | model | latent 1-step ÷ copy | latent H-step ÷ copy | proprio 1-step ÷ copy | action sens. latent | action sens. proprio | probe R² |",
             "|---|---|---|---|---|---|---|---|"]
    for site, r in e["sites"].items():
        for model, d in r.get("diagnostics", {}).items():
            lines.append(f"| {site} | {model} | {d['rollout_vs_copy'][0]:.3f} | {d['rollout_vs_copy'][-1]:.3f} | {d['rollout_vs_copy_proprio'][0]:.3f} | "
                         f"{d['action_sensitivity']:.2f} | {d['action_sensitivity_proprio']:.2f} | {d['probe_r2']:.3f} |")
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


def render_markdown(figures: dict, budgets: list[dict], hw_class: str, hardware: str) -> str:
    """The report text."""
    c, f, g, e = figures["centralized"], figures["federate"], figures["gauge"], figures["eval"]
    lines = [
        "# Lensemble run report", "",
        f"Hardware class `{hw_class}` — {hardware}", "",
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
        f"lowest over the run {g['effective_dim_fraction_min']:.0%} of the latent dimension; "
        f"federated ÷ pooled at the same point of training, lowest round: {g['effective_dim_vs_pooled_min']:.2f}; "
        f"collapse tripwire (against the pooled model) {'TRIPPED' if g['collapse_tripwire'] else 'quiet'}", "",
        "| round | federated RankMe | pooled RankMe | ratio | drift ° |", "|---|---|---|---|---|",
        *(f"| {r['round']} | {r['effective_dim']:.2f} | {r['pooled_effective_dim']:.2f} | {r['effective_dim_vs_pooled']:.2f} | "
          f"{r['drift_angle_deg_mean']:.2f} |" for r in g["per_round"]), "",
        *dynamics_lines(f, e), "",
        "## Closed-loop latent-MPC evaluation", "",
        "Every agent runs the same episodes (seeds, starts, goals). The oracle is the same CEM with the true simulator as its",
        "model and the success criterion's own distance as its energy: what the protocol allows a perfect model.", "",
        "| site | embodiment | centralized (pooled) | federated | local-only | oracle | random | plan s |", "|---|---|---|---|---|---|---|---|",
    ]
    for site, r in e["sites"].items():
        cell = lambda m: f"{r[m]['success_rate']:.2f} [{r[m]['ci_low']:.2f}, {r[m]['ci_high']:.2f}]" if m in r else "not trained"  # noqa: E731
        lines.append(f"| {site} | {r['embodiment']} | {cell('centralized')} | {cell('federated')} | {cell('local_only')} | {cell('oracle')} | "
                     f"{cell('random')} | {r['federated']['plan_seconds']:.3f} |")
    lines += ["", "| embodiment | episodes | step budget | success criterion | pooled ÷ oracle | federated ÷ pooled |", "|---|---|---|---|---|---|"]
    for emb, row in e.get("embodiments", {}).items():
        pooled_of_oracle = row["of_oracle"].get("centralized")
        fed_of_pooled = row["federated"] / row["centralized"] if row["centralized"] > 0 else None
        fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {emb} | {row['episodes']:.0f} | {row['max_steps']} | {row['success_criterion']} | {fmt(pooled_of_oracle)} | {fmt(fed_of_pooled)} |")
    lines += ["", "Communication each needed: federated "
              f"{f['comm_bytes_total']:,} bytes on the wire; pooling the raw data centrally {f['pooling_bytes']:,} bytes; "
              f"a step-synchronous data-parallel run {f['step_synchronous_bytes']:,} bytes; local-only 0 bytes."]
    lines += ["", f"## Budgets ({hw_class})", "", "| budget | stage | metric | band | value | status |", "|---|---|---|---|---|---|"]
    for b in budgets:
        band = "—" if b["low"] is None else f"[{b['low']:g}, {b['high']:g}] {b['unit']}" + (" (planning)" if b.get("planning") else "")
        value = "—" if b["value"] is None else f"{b['value']:.4g}"
        lines.append(f"| {b['name']} | {b['stage']} | `{b['metric']}` | {band} | {value} | {b['status']} |")
    lines += ["", "Plots: `plots/losses.png`, `plots/drift.png`, `plots/comm_bytes.png`.", ""]
    return "\n".join(lines)
