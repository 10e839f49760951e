"""The leak scan of a project's shared outputs, timed beside the memory copy bandwidth measured in the same run.

    python benchmarks/leak_scan.py [ROOT] [--reference]

Scans what `tasks.residency.check_outputs` scans after the federation and in the residency stage (reports/,
the MLflow store and artifacts, the Prefect database: `output_targets`) for every site's private rows, as the
stage does: native (`lensemble/data/text_scan.c`) where it builds. `--reference` also times the regular-
expression path (what runs without a C compiler) and checks both find the same hits. The Prefect database and
the MLflow store grow with every run, so the figure depends on the workspace's history: the bytes scanned
are printed with it.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from lensemble.data import audit
from lensemble.paths import Layout
from tasks.residency import output_targets


def files_under(paths) -> list[Path]:
    files = []
    for root in map(Path, paths):
        files += [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    return files


def copy_gbps(nbytes: int) -> float:
    """Best of 5 numpy copies of a buffer of the scanned size (capped at 256 MiB): the memory floor."""
    src = np.ones(min(max(nbytes, 1 << 20), 256 << 20), np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=".")
    ap.add_argument("--reference", action="store_true", help="also time the regular-expression path and compare")
    args = ap.parse_args()
    layout = Layout(Path(args.root).resolve())
    indexes = {p.parent.name: audit.PrivateIndex.load(p) for p in sorted(layout.root.glob("data/sites/*/" + audit.INDEX_FILE))}
    if not indexes:
        raise SystemExit(f"no private index under {layout.root / 'data/sites'}: run `dvc repro` (or the prepare stage) first")
    targets = output_targets(layout)
    nbytes = sum(f.stat().st_size for f in files_under(targets))
    floor = copy_gbps(nbytes)
    native = audit._text_lib() is not None
    t0 = time.perf_counter()
    found = audit.scan_paths_many(targets, indexes)
    seconds = time.perf_counter() - t0
    print(f"leak_scan.seconds {seconds:.2f}  {nbytes / 1e6:.1f} MB against {len(indexes)} sites, "
          f"{'native' if native else 'regular expressions (no C compiler)'}, {nbytes / seconds / 1e9:.3f} GB/s; "
          f"memory copy {floor:.1f} GB/s ({nbytes / 1e9 / floor:.3f} s for these bytes); hits {len(found)}")
    if args.reference and native:
        lib = audit._text_lib
        audit._text_lib = lambda: None
        try:
            t0 = time.perf_counter()
            ref = audit.scan_paths_many(targets, indexes)
            ref_seconds = time.perf_counter() - t0
        finally:
            audit._text_lib = lib
        print(f"leak_scan.reference_seconds {ref_seconds:.2f}  regular expressions, one pre-filter for all sites; "
              f"same hits: {ref == found}")


if __name__ == "__main__":
    main()
