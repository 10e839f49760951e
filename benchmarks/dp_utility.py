"""Utility against ε on the grid-world example: the real federate stage at several DP noise multipliers.

Each point is one `lensemble run federate` in its own project root, on the episodes of one shared
`prepare` run (prepare reads only run.seed and data, which every point shares). The federation is
shortened (`--rounds`, `--inner-steps`; no local-only baseline, no head re-fit) so the sweep stays short
on a 2-core CPU. Points: DP off, clipping only (federate.update_clip_norm, no noise), then dp.enabled
at each noise multiplier z with clip norm S. Utility: the sites' mean loss/pred in the last round (a
training loss, lower is better), and the dynamics diagnostics of the global model entering the last
round (latent 1-step rollout error ÷ copying, < 1 is better than "nothing moves"; linear-probe R²).
ε is the RDP accountant's at dp.delta after all rounds, as reports/federate.json records it.

Run (about a minute per point on 2 cores at the defaults):
    python benchmarks/dp_utility.py --out /tmp/dp_utility
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "grid-four-sites.params.yaml"


def points(noise_multipliers: list[float], clip_norm: float) -> list[tuple[str, dict]]:
    """(name, overrides of the `dp` section and federate.update_clip_norm) of every point of the sweep."""
    out = [("dp off", {}), (f"clip {clip_norm:g} only", {"federate": {"update_clip_norm": clip_norm}})]
    out += [(f"z = {z:g}", {"dp": {"enabled": True, "clip_norm": clip_norm, "noise_multiplier": z}}) for z in noise_multipliers]
    return out


def point_params(base: dict, rounds: int, inner_steps: int, overrides: dict) -> dict:
    """The example's params, shortened, with a point's overrides merged in by section."""
    raw = copy.deepcopy(base)
    raw["federate"].update(rounds=rounds, inner_steps=inner_steps, local_only=False, head_adapt_steps=0)
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return raw


def lensemble(root: Path, *args: str) -> float:
    """Run the CLI in `root`; its wall seconds. Output goes to root/cli.log."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1"}
    t0 = time.perf_counter()
    with open(root / "cli.log", "a") as log:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), *args], cwd=REPO, env=env,
                              stdout=log, stderr=log)
    if proc.returncode:
        raise SystemExit(f"lensemble {' '.join(args)} failed in {root} (exit {proc.returncode}); see {root / 'cli.log'}")
    return time.perf_counter() - t0


def new_root(root: Path, raw: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    for name in ("budgets.yaml", "pricing.yaml"):
        shutil.copy(REPO / name, root / name)
    return root


def utility(report: dict) -> dict:
    """The point's figures from its reports/federate.json."""
    last = report["per_round"][-1]["sites"]
    mean = lambda name: sum(s[name] for s in last.values()) / len(last)  # noqa: E731
    dp = report.get("dp", {})
    clipped = "dp/update_norm" in next(iter(last.values()))
    return {"loss_pred_final": report["final_loss_pred"], "rollout_vs_copy_last_round": mean("eval/rollout_vs_copy"),
            "probe_r2_last_round": mean("eval/probe_r2"), "epsilon": dp.get("epsilon"), "delta": dp.get("delta"),
            "clip_fraction": dp.get("clip_fraction_mean"), "update_norm_mean": mean("dp/update_norm") if clipped else None,
            "global_params_sha256": report["global_params_sha256"][:16]}


def sweep(out: Path, rounds: int, inner_steps: int, noise_multipliers: list[float], clip_norm: float) -> list[dict]:
    """Prepare once, then one federate run per point; rows of the table."""
    base = yaml.safe_load(EXAMPLE.read_text())
    data_root = new_root(out / "prepared", point_params(base, rounds, inner_steps, {}))
    if not (data_root / "data" / "sites").is_dir():
        lensemble(data_root, "run", "prepare")
        lensemble(data_root, "run", "residency")
    rows = []
    for name, overrides in points(noise_multipliers, clip_norm):
        root = new_root(out / name.replace(" ", "_").replace("=", ""), point_params(base, rounds, inner_steps, overrides))
        for part in ("data", "reports"):
            shutil.rmtree(root / part, ignore_errors=True)
            shutil.copytree(data_root / part, root / part)
        seconds = lensemble(root, "run", "federate")
        rows.append({"point": name, "seconds": seconds, **utility(json.loads((root / "reports" / "federate.json").read_text()))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of the sweep."""
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = ["| point | ε (δ) | final loss/pred | rollout ÷ copy | probe R² | clipped | mean ‖Δ_c‖ | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eps = "—" if r["epsilon"] is None else f"{r['epsilon']:.3g} ({r['delta']:g})"
        lines.append(f"| {r['point']} | {eps} | {r['loss_pred_final']:.4f} | {r['rollout_vs_copy_last_round']:.3f} | "
                     f"{r['probe_r2_last_round']:.3f} | {fmt(r['clip_fraction'], '.0%')} | {fmt(r['update_norm_mean'], '.3g')} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/dp_utility"), help="folder for the points' project roots")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--noise-multipliers", default="0.01,0.1,1", help="comma-separated z values")
    parser.add_argument("--clip-norm", type=float, default=0.5, help="S, the per-site L2 bound")
    args = parser.parse_args(argv)
    rows = sweep(args.out, args.rounds, args.inner_steps, [float(z) for z in args.noise_multipliers.split(",")], args.clip_norm)
    (args.out / "dp_utility.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
