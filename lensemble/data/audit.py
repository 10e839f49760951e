"""Leak scan: look for a site's private content in files that left (or could leave) the site.

Fingerprints are 8-byte windows that identify private rows: the raw float32 bytes of every action
row, and of every frame the 8 bytes starting at its first non-background pixel (the anti-aliased
edge of the agent, which varies with sub-pixel position). A file is scanned at every byte offset by
viewing it as little-endian uint64 at the 8 alignments and testing set membership with numpy.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from lensemble.data.episodes import Episodes


def fingerprints(eps: Episodes) -> np.ndarray:
    """Sorted unique uint64 fingerprints of a site's private rows."""
    keys = []
    actions = np.ascontiguousarray(eps.actions_ELK.reshape(-1, eps.actions_ELK.shape[-1]))
    if actions.shape[1] * 4 >= 8:
        keys.append(actions.view(np.uint8)[:, :8].copy().view("<u8").ravel())
    frames = eps.frames_ELHWC.reshape(-1, eps.frames_ELHWC[0, 0].size)  # [E*L, H*W*3]
    background = frames[:, :1]
    first = np.argmax(frames != background, axis=1)
    first = np.minimum(first, frames.shape[1] - 8)
    windows = np.stack([frames[np.arange(len(frames)), first + i] for i in range(8)], axis=1)
    has_edge = (frames != background).any(axis=1)
    keys.append(np.ascontiguousarray(windows[has_edge]).view("<u8").ravel())
    return np.unique(np.concatenate(keys))


def scan_bytes(blob: bytes, prints: np.ndarray) -> int:
    """Number of byte offsets of `blob` where a fingerprint starts."""
    arr = np.frombuffer(blob, dtype=np.uint8)
    hits = 0
    for shift in range(8):
        n = (len(arr) - shift) // 8
        if n <= 0:
            continue
        words = arr[shift : shift + 8 * n].view("<u8")
        hits += int(np.isin(words, prints, assume_unique=False).sum())
    return hits


def scan_paths(paths: Iterable[Path], prints: np.ndarray) -> dict[str, int]:
    """Files (recursively) in which any fingerprint occurs, with the hit count."""
    found = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        for f in files:
            hits = scan_bytes(f.read_bytes(), prints)
            if hits:
                found[str(f)] = hits
    return found
