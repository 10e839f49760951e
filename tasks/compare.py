"""`lensemble budgets compare`: each budget's measured values by hardware class and stage, from MLflow.

One `search_runs` query over the stage runs; per (budget, stage, hardware class): run count, min,
median, max of the measured metric, the band and how many runs fell within it. Prints a table and
writes a plot (every value as its position within its band, per budget and hardware class).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from lensemble.budgets import load_budgets
from tasks.tracking import Tracker


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
    """Every measured value as its position in its band, one column per (budget, stage), colored by hardware class.

    y = (value - low) / (high - low): the shaded strip 0..1 is "within"; values beyond the axis
    limits are drawn at the edge as triangles. Budgets with no band for a class are drawn at the
    bottom edge in grey. One axes: the plot stays readable and fast however many budgets there are.
    """
    import matplotlib  # imported here: the table is printed before matplotlib's start-up

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = sorted({(r["budget"], r["stage"]) for r in rows})
    classes = sorted({r["hardware_class"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lo_lim, hi_lim = -1.0, 3.0
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(columns)), 4.0))
    ax.axhspan(0.0, 1.0, color="green", alpha=0.12, label="within band")
    for r in rows:
        x = columns.index((r["budget"], r["stage"])) + (classes.index(r["hardware_class"]) - (len(classes) - 1) / 2) * 0.2
        if r["band"] is None:
            ax.scatter([x] * r["runs"], [lo_lim] * r["runs"], s=12, color="grey", marker="x")
            continue
        low, high = r["band"]
        y = [(v - low) / (high - low) if high > low else (0.5 if v == low else (hi_lim if v > low else lo_lim)) for v in r["values"]]
        inside = [min(max(v, lo_lim), hi_lim) for v in y]
        clipped = [v != c for v, c in zip(y, inside)]
        color = colors[classes.index(r["hardware_class"]) % len(colors)]
        ax.scatter([x for x, c in zip([x] * len(y), clipped) if not c], [v for v, c in zip(inside, clipped) if not c], s=12, color=color)
        ax.scatter([x for x, c in zip([x] * len(y), clipped) if c], [v for v, c in zip(inside, clipped) if c], s=24, color=color, marker="^")
    for i, hw in enumerate(classes):
        ax.scatter([], [], s=12, color=colors[i % len(colors)], label=hw)
    ax.set_xticks(range(len(columns)), [f"{name}\n({stage})" for name, stage in columns], rotation=60, ha="right", fontsize=7)
    ax.set_ylim(lo_lim - 0.1, hi_lim + 0.1)
    ax.set_ylabel("(value - low) / (high - low)")
    ax.set_title("budgets by hardware class: measured values against their bands", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.subplots_adjust(bottom=0.35)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
