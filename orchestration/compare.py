"""`lensemble budgets compare`: each budget's measured values by hardware class and stage, from MLflow.

One `search_runs` query over the stage runs; per (budget, stage, hardware class): run count, min,
median, max of the measured metric, the band and how many runs fell within it. Prints a table and
writes a plot: every value as its position within its band, per budget and hardware class, and the
same over the runs' start times (budgets over runs).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from lensemble.budgets import load_budgets
from orchestration.tracking import Tracker


def collect(root: Path, max_runs: int = 10000) -> list[dict]:
    """One row per (budget, stage, hardware class) with the values measured there."""
    budgets = load_budgets(Path(root) / "budgets.yaml")
    tracker = Tracker(Path(root))
    runs = tracker.client.search_runs([tracker.experiment_id], filter_string="tags.`lensemble.kind` = 'stage'", max_results=max_runs)
    values: dict[tuple[str, str, str], list[float]] = {}
    times: dict[tuple[str, str, str], list[float]] = {}
    measured = sorted({(b.name, b.stage, b.metric) for b in budgets})  # one per budget, whatever its classes
    for run in runs:
        stage = run.data.tags.get("lensemble.stage")
        hw = run.data.tags.get("lensemble.hardware_class", "unknown")
        for name, b_stage, metric in measured:
            # the value the run's budget table read (`budget/<name>`: a mean or a minimum over rounds); runs recorded
            # before that metric existed fall back to the raw metric's latest value
            value = run.data.metrics.get(f"budget/{name}", run.data.metrics.get(metric))
            if b_stage == stage and value is not None:
                values.setdefault((name, stage, hw), []).append(value)
                times.setdefault((name, stage, hw), []).append(run.info.start_time / 1000)
    rows = []
    for (name, stage, hw), vals in sorted(values.items()):
        band = next((b for b in budgets if b.name == name and b.stage == stage and b.hardware_class == hw), None)
        within = sum(band.low <= v <= band.high for v in vals) if band else None
        below = sum(v < band.low for v in vals) if band else None
        rows.append({"budget": name, "stage": stage, "hardware_class": hw, "runs": len(vals), "min": min(vals),
                     "median": statistics.median(vals), "max": max(vals), "values": vals, "times": times[(name, stage, hw)],
                     "band": (band.low, band.high) if band else None, "within": within, "below": below,
                     "above": None if band is None else len(vals) - within - below})
    return rows


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table."""
    head = (f"{'budget':<24} {'stage':<12} {'hardware':<14} {'runs':>5} {'min':>10} {'median':>10} {'max':>10} {'band':>18} "
            f"{'below':>6} {'within':>7} {'above':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        band = "no band" if r["band"] is None else f"[{r['band'][0]:g}, {r['band'][1]:g}]"
        counts = ["-"] * 3 if r["within"] is None else [str(r["below"]), f"{r['within']}/{r['runs']}", str(r["above"])]
        lines.append(f"{r['budget']:<24} {r['stage']:<12} {r['hardware_class']:<14} {r['runs']:>5} {r['min']:>10.4g} {r['median']:>10.4g} "
                     f"{r['max']:>10.4g} {band:>18} {counts[0]:>6} {counts[1]:>7} {counts[2]:>6}")
    return "\n".join(lines)


def _band_position(value: float, band: tuple[float, float]) -> float:
    """(value - low) / (high - low): 0..1 is within the band; a zero-width band maps to 0.5 or beyond."""
    low, high = band
    if high > low:
        return (value - low) / (high - low)
    return 0.5 if value == low else (float("inf") if value > low else float("-inf"))


def plot(rows: list[dict], path: Path) -> None:
    """Two panels, every measured value as its position within its band (shaded strip 0..1 = within).

    Top: one column per (budget, stage), a point per run, colored by hardware class. Bottom: the
    same positions over the runs' start times, one line per (budget, stage, hardware class).
    Values beyond the axis limits sit on its edge as triangles; budgets with no band for a class
    are grey crosses at the bottom. Two axes however many budgets: readable and fast.
    """
    import matplotlib  # imported here: the table is printed before matplotlib's start-up

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = sorted({(r["budget"], r["stage"]) for r in rows})
    classes = sorted({r["hardware_class"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lo_lim, hi_lim = -1.0, 3.0
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(max(7.0, 0.45 * len(columns)), 7.5), gridspec_kw={"height_ratios": [1, 1]})
    t0 = min((t for r in rows for t in r["times"]), default=0.0)
    for a in (ax, hist):
        a.axhspan(0.0, 1.0, color="green", alpha=0.12)
        a.set_ylim(lo_lim - 0.1, hi_lim + 0.1)
        a.set_ylabel("(value - low) / (high - low)", fontsize=8)
    for r in rows:
        x = columns.index((r["budget"], r["stage"])) + (classes.index(r["hardware_class"]) - (len(classes) - 1) / 2) * 0.2
        if r["band"] is None:
            ax.scatter([x] * r["runs"], [lo_lim] * r["runs"], s=12, color="grey", marker="x")
            continue
        y = [_band_position(v, r["band"]) for v in r["values"]]
        shown = [min(max(v, lo_lim), hi_lim) for v in y]
        clipped = [v != c for v, c in zip(y, shown)]
        color = colors[classes.index(r["hardware_class"]) % len(colors)]
        for flag, marker, size in ((False, "o", 12), (True, "^", 24)):
            pts = [c for c, f in zip(shown, clipped) if f == flag]
            ax.scatter([x] * len(pts), pts, s=size, color=color, marker=marker)
        order = sorted(range(len(y)), key=lambda i: r["times"][i])
        hist.plot([(r["times"][i] - t0) / 3600 for i in order], [shown[i] for i in order], marker=".", lw=0.8, alpha=0.7,
                  color=color)
    for i, hw in enumerate(classes):
        ax.scatter([], [], s=12, color=colors[i % len(colors)], label=hw)
    ax.set_xticks(range(len(columns)), [f"{name}\n({stage})" for name, stage in columns], rotation=60, ha="right", fontsize=6)
    ax.set_title("budgets by hardware class: measured values against their bands", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    hist.set_xlabel("hours since the first recorded run", fontsize=8)
    hist.set_title("the same budgets over runs (one line per budget, stage and hardware class)", fontsize=9)
    fig.subplots_adjust(bottom=0.08, top=0.95, hspace=0.75)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
