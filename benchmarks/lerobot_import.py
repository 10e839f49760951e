"""LeRobot import throughput beside its decode limit, measured in the same run.

A local LeRobot v3.0 dataset is written once (grid_point renders at 64x64, one MP4 per episode,
`lensemble.data.lerobot.write_lerobot`), then timed, best of `repeats`:

- decode limit: PyAV decoding every MP4 of the camera, frames left as decoded (YUV, no conversion),
  and decoding plus the rgb24 conversion the import needs, on the import's decode threads (--threads);
- import: `read_lerobot` end to end (info, episodes metadata, frame Parquet, every video decoded to
  rgb24 at data.image_size, cut into episodes), as frames/s and as 4-frame windows/s, a window
  counted once per 4 decoded frames (disjoint windows: each frame decoded once serves one window).
  A sliding-window sampler draws far more windows from the same frames; this is the conservative count.

    python -m benchmarks.lerobot_import            # 64 episodes x 128 frames, both video presets
    python -m benchmarks.lerobot_import --quick    # 8 x 64, seconds
"""
from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
from av.video.reformatter import VideoReformatter

from lensemble.data.episodes import generate_episodes
from lensemble.data.lerobot import VIDEO_PRESETS, read_lerobot, write_lerobot
from lensemble.perf import best_seconds
from lensemble.sim.registry import make_embodiment

CAMERA = "observation.images.top"
WINDOW = 4  # frames per window, as the loader benchmark (benchmarks/data.py)


def decode_file(path: Path, rgb: bool) -> int:
    """Decode one file as the import does; frames counted, optionally converted to rgb24 arrays."""
    n, reformatter = 0, VideoReformatter()
    with av.open(str(path)) as container:
        for frame in container.decode(container.streams.video[0]):
            if rgb:
                reformatter.reformat(frame, format="rgb24").to_ndarray()
            n += 1
    return n


def decode_all(videos: list[Path], rgb: bool, threads: int) -> int:
    """Every file decoded on `threads` threads, as `read_lerobot` spreads them."""
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda p: decode_file(p, rgb), videos))


def import_throughput(episodes: int = 64, length: int = 128, size: int = 64, video: str = "lossless", repeats: int = 3,
                      threads: int = 2) -> dict:
    """Import frames/s and windows/s beside PyAV's raw and rgb24 decode frames/s, on one dataset and `threads` threads."""
    eps = generate_episodes(make_embodiment("grid_point", size), 0, "bench/lerobot", episodes, length, 0.5, 0.3, 8)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        write_lerobot(eps, root, fps=30, camera=CAMERA, video=video)
        videos = sorted((root / "videos" / CAMERA).rglob("*.mp4"))
        frames = episodes * length
        raw_s = best_seconds(lambda: decode_all(videos, False, threads), repeats)
        rgb_s = best_seconds(lambda: decode_all(videos, True, threads), repeats)
        imp_s = best_seconds(lambda: read_lerobot(root, CAMERA, "grid_point", size, length, episodes, threads=threads), repeats)
        mp4_bytes = sum(p.stat().st_size for p in videos)
    return {"video": video, "frames": frames, "size": size, "mp4_bytes": mp4_bytes, "threads": threads,
            "decode_raw_fps": frames / raw_s, "decode_rgb_fps": frames / rgb_s,
            "import_fps": frames / imp_s, "import_windows_per_s": frames / WINDOW / imp_s,
            "import_share_of_raw_decode": raw_s / imp_s, "import_share_of_rgb_decode": rgb_s / imp_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 episodes x 64 frames, one repeat")
    ap.add_argument("--threads", type=int, default=2, help="decode threads, for the import and its limit alike")
    args = ap.parse_args(argv)
    kw = {"episodes": 8, "length": 64, "repeats": 1} if args.quick else {}
    kw["threads"] = args.threads
    for video in VIDEO_PRESETS:
        r = import_throughput(video=video, **kw)
        print(f"lerobot import [{r['video']}, {r['frames']} frames {r['size']}x{r['size']}, {r['mp4_bytes'] / 1e6:.2f} MB mp4, "
              f"{r['threads']} threads]: "
              f"{r['import_windows_per_s']:,.0f} windows/s ({WINDOW}-frame, target >= 2,000), {r['import_fps']:,.0f} frames/s; "
              f"decode limit {r['decode_raw_fps']:,.0f} frames/s raw, {r['decode_rgb_fps']:,.0f} with rgb24 "
              f"(import at {r['import_share_of_rgb_decode']:.0%} of decode+rgb24, "
              f"{r['import_share_of_raw_decode']:.0%} of raw decode)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
