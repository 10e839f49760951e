"""`lensemble budgets compare`: each budget's measured values by hardware class and stage, from MLflow.

One `search_runs` query over the stage runs; per (budget, stage, hardware class): run count, min,
median, max of the measured metric, the band and how many runs fell within it. Prints a table and
writes a plot (one panel per budget, a column of points per hardware class, the band shaded).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lensemble.budgets import load_budgets  # noqa: E402
from tasks.tracking import Tracker  # noqa: E402


def collect(root: Path, max_runs: int = 10000) -> list[dict]:
    """One row per (budget, stage, hardware class) with the values measured there."""
    budgets = load_budgets(Path(root) / "budgets.yaml")
    tracker = Tracker(Path(root))
    runs = tracker.client.search_runs([tracker.experiment_id], filter_string="tags.`lensemble.kind` = 'stage'", max_results=max_runs)
    values: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        stage = run.data.tags.get("lensemble.stage")
        hw = run.data.tags.get("lensemble.hardware_class", "unknown")
        for b in budgets:
            if b.stage == stage and b.metric in run.data.metrics:
                values.setdefault((b.name, stage, hw), []).append(run.data.metrics[b.metric])
    rows = []
    for (name, stage, hw), vals in sorted(values.items()):
        band = next((b for b in budgets if b.name == name and b.stage == stage and b.hardware_class == hw), None)
        within = sum(band.low <= v <= band.high for v in vals) if band else None
        rows.append({"budget": name, "stage": stage, "hardware_class": hw, "runs": len(vals), "min": min(vals),
                     "median": statistics.median(vals), "max": max(vals), "values": vals,
                     "band": (band.low, band.high) if band else None, "within": within})
    return rows


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table."""
    head = f"{'budget':<24} {'stage':<12} {'hardware':<14} {'runs':>5} {'min':>10} {'median':>10} {'max':>10} {'band':>18} {'within':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        band = "no band" if r["band"] is None else f"[{r['band'][0]:g}, {r['band'][1]:g}]"
        within = "-" if r["within"] is None else f"{r['within']}/{r['runs']}"
        lines.append(f"{r['budget']:<24} {r['stage']:<12} {r['hardware_class']:<14} {r['runs']:>5} {r['min']:>10.4g} {r['median']:>10.4g} {r['max']:>10.4g} {band:>18} {within:>7}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """One panel per budget: measured values per hardware class, band shaded."""
    names = sorted({(r["budget"], r["stage"]) for r in rows})
    fig, axes = plt.subplots(len(names), 1, figsize=(6, 1.8 * max(len(names), 1)), squeeze=False)
    for ax, (name, stage) in zip(axes[:, 0], names):
        mine = [r for r in rows if r["budget"] == name and r["stage"] == stage]
        for i, r in enumerate(mine):
            ax.scatter([i] * r["runs"], r["values"], s=10)
            if r["band"]:
                ax.fill_between([i - 0.3, i + 0.3], *r["band"], alpha=0.15, color="green")
        ax.set_xticks(range(len(mine)), [r["hardware_class"] for r in mine])
        ax.set_title(f"{name} ({stage})", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
