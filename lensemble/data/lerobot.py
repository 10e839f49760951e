"""LeRobot datasets (on-disk format v3.0) as a site's episode source, and a site's store exported as one.

The format is LeRobot's own, read from its source at commit 7427f31 (2026-08-23): `src/lerobot/datasets/
utils.py` for the paths and `DatasetInfo`, `dataset_metadata.py` for CODEBASE_VERSION = "v3.0",
`utils/constants.py` for DEFAULT_FEATURES, `tests/fixtures/{dataset_factories,files,constants}.py` for how
its tests lay a dataset out. Only v3.0 is read; a v2.1 dataset is refused with lerobot's conversion command.

    meta/info.json                               codebase_version, fps, features {key: {dtype, shape, names[, info]}},
                                                 total_episodes/frames/tasks, chunks_size, *_files_size_in_mb,
                                                 data_path and video_path templates, robot_type, splits
    meta/tasks.parquet                           task (the pandas index) → task_index
    meta/episodes/chunk-XXX/file-XXX.parquet     one row per episode: episode_index, tasks, length,
                                                 data/{chunk,file}_index, dataset_{from,to}_index,
                                                 videos/<key>/{chunk_index, file_index, from_timestamp, to_timestamp}
    data/chunk-XXX/file-XXX.parquet              one row per frame: the features plus timestamp, frame_index,
                                                 episode_index, index, task_index
    videos/<key>/chunk-XXX/file-XXX.mp4          the frames of one or more episodes; an episode's span is
                                                 [from_timestamp, to_timestamp) of its file

Import (`read_lerobot`): the camera's frames (decoded from MP4 with PyAV, or from an image column),
scaled to `image_size`² (stretched, not cropped); `observation.state` as proprioception and `action`
as actions, both float32, with the embodiment's dims. `Episodes` is dense ([E, L, ...]), so each
LeRobot episode is cut at its own boundaries into consecutive `episode_length`-step episodes (a
remainder shorter than that is left out); the first `episodes` of them are taken.

Export (`write_lerobot`): data files of whole episodes up to DATA_FILE_MB each, one MP4 per episode
and camera (libx264; VIDEO_PRESETS: lossless yuv444p qp 0 by default, or browser-playable yuv420p crf
18), timestamps = frame_index / fps, one task. Actions and proprioception round-trip bit for bit,
frames within the codec's error (tests/test_lerobot.py pins the bound for each preset).
"""
from __future__ import annotations

import hashlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import VideoReformatter
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lensemble.data.episodes import Episodes
from lensemble.errors import DataError
from lensemble.sim.registry import embodiment_class

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
EPISODES_PATH = "meta/episodes/" + CHUNK_FILE + ".parquet"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
CHUNKS_SIZE = 1000  # files per chunk folder (lerobot DEFAULT_CHUNK_SIZE)
DATA_FILE_MB = 100  # lerobot DEFAULT_DATA_FILE_SIZE_IN_MB
VIDEO_FILE_MB = 200  # lerobot DEFAULT_VIDEO_FILE_SIZE_IN_MB
DEFAULT_FEATURES = {  # lerobot.utils.constants.DEFAULT_FEATURES: every frame row carries them
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
CODEC = "libx264"  # H.264 ("h264" in info.json), which lerobot's decoders (torchcodec, pyav) read
# name → (pixel format, libx264 options); GOP 2 as lerobot's writer sets `g`, for cheap random access.
# lossless: qp 0 in full-chroma YUV, max error 2 levels (the RGB↔YUV rounding); `ultrafast` (CAVLC, no
# B-frames) decodes 1.6x faster than the default preset for 1.4x the bytes. playable: 4:2:0, which
# browsers (the Hub's dataset viewer) play, at several times the error on small renders.
VIDEO_PRESETS = {"lossless": ("yuv444p", {"crf": "0", "g": "2", "preset": "ultrafast"}),
                 "playable": ("yuv420p", {"crf": "18", "g": "2"})}


@dataclass(frozen=True)
class LeRobotImport:
    """What `read_lerobot` made of a dataset: the episodes and the provenance the site records locally."""

    episodes: Episodes
    fps: int
    codebase_version: str
    source_episodes: int  # LeRobot episodes in the dataset
    info_sha256: str  # sha256 of meta/info.json as read


def chunk_file(i: int, chunks_size: int = CHUNKS_SIZE) -> dict[str, int]:
    """The i-th file of a folder series → its (chunk_index, file_index), as lerobot's update_chunk_file_indices steps."""
    return {"chunk_index": i // chunks_size, "file_index": i % chunks_size}


# ---- video ----

def decode_video(path: Path, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of an MP4 → ([N, H, W, 3] uint8 RGB, scaled to size² if given; [N] presentation times in s)."""
    frames, times = [], []
    # one reformatter keeps its swscale context across frames: `frame.to_ndarray(format=...)` builds one per
    # frame, 10x slower at 64x64 (benchmarks/lerobot_import.py)
    reformatter = VideoReformatter()
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            scale = size and (stream.width, stream.height) != (size, size)  # an unscaled conversion is 2x cheaper
            kw = {"width": size, "height": size, "interpolation": "AREA"} if scale else {}
            for frame in container.decode(stream):
                frames.append(reformatter.reformat(frame, format="rgb24", **kw).to_ndarray())
                times.append(frame.time)
    except (av.error.FFmpegError, OSError, IndexError) as exc:
        raise DataError(f"video {path} is unreadable: {exc}") from None
    if not frames:
        raise DataError(f"video {path} is unreadable: no frames")
    return np.stack(frames), np.asarray(times, dtype=np.float64)


def encode_video(frames_LHWC: np.ndarray, path: Path, fps: int, preset: str = "lossless") -> None:
    """[L, H, W, 3] uint8 → an MP4 (CODEC with a VIDEO_PRESETS entry) at `fps`, frame i at time i / fps."""
    L, H, W, _ = frames_LHWC.shape
    pix_fmt, options = VIDEO_PRESETS[preset]
    if H % 2 or W % 2:
        raise DataError(f"cannot encode {W}x{H} frames to {path}: libx264 needs even sides")
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(CODEC, rate=fps, options=dict(options))
        stream.width, stream.height, stream.pix_fmt = W, H, pix_fmt
        for i in range(L):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames_LHWC[i]), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


# ---- import ----

def _load_info(root: Path) -> tuple[dict, str]:
    path = root / INFO_PATH
    if not path.is_file():
        raise DataError(f"LeRobot dataset {root}: {INFO_PATH} is missing")
    raw = path.read_bytes()
    try:
        info = json.loads(raw)
    except ValueError as exc:
        raise DataError(f"LeRobot dataset {root}: {INFO_PATH} is not JSON: {exc}") from None
    version = info.get("codebase_version")
    if version != CODEBASE_VERSION:
        raise DataError(f"LeRobot dataset {root}: codebase_version {version!r} is not supported (only {CODEBASE_VERSION}; "
                        f"convert with `python -m lerobot.scripts.convert_dataset_v21_to_v30`)")
    for key in ("fps", "features", "data_path"):
        if key not in info:
            raise DataError(f"LeRobot dataset {root}: {INFO_PATH} has no {key!r}")
    if not isinstance(info["fps"], (int, float)) or info["fps"] <= 0:
        raise DataError(f"LeRobot dataset {root}: {INFO_PATH} 'fps' must be a positive number, got {info['fps']!r}")
    return info, hashlib.sha256(raw).hexdigest()


def _read_parquets(root: Path, pattern: str, what: str) -> pa.Table:
    files = sorted(root.glob(pattern))
    if not files:
        raise DataError(f"LeRobot dataset {root}: no {what} ({pattern})")
    try:
        return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"LeRobot dataset {root}: {what} unreadable: {exc}") from None


def _vector_column(table: pa.Table, key: str, root: Path) -> np.ndarray:
    """A list or fixed-size-list numeric column → [rows, K] float32; DataError naming the key if ragged or non-finite."""
    col = table.column(key).combine_chunks()
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    if col.null_count or lengths.min() != lengths.max():
        raise DataError(f"LeRobot dataset {root}: {key!r} has null or ragged rows")
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.float32)
    if not np.isfinite(values).all():
        raise DataError(f"LeRobot dataset {root}: {key!r} holds NaN or Inf")
    return values.reshape(len(col), int(lengths[0]))


def _decode_images(column: pa.ChunkedArray, root: Path, camera: str, size: int) -> np.ndarray:
    """An image column (struct {bytes, path}, PNG/JPEG) → [rows, size, size, 3] uint8."""
    from PIL import Image, UnidentifiedImageError  # pillow comes with matplotlib; only image-column datasets need it

    out = np.empty((len(column), size, size, 3), dtype=np.uint8)
    for i, cell in enumerate(column.to_pylist()):
        if not cell or not (cell.get("bytes") or cell.get("path")):
            raise DataError(f"LeRobot dataset {root}: {camera!r} image row {i} is empty")
        try:
            data = cell.get("bytes") or (root / cell["path"]).read_bytes()  # lerobot embeds the bytes; a path is the fallback
            img = Image.open(io.BytesIO(data)).convert("RGB")
        except (OSError, UnidentifiedImageError) as exc:
            raise DataError(f"LeRobot dataset {root}: {camera!r} image row {i} is unreadable: {exc}") from None
        out[i] = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR) if img.size != (size, size) else img)
    return out


def _check_features(root: Path, features: dict, camera: str, embodiment: str, dims: dict[str, tuple[int, str]]) -> bool:
    """info.json's features hold `camera` (video or image) and each key of `dims` with its width; True if a video."""
    for key, (dim, what) in dims.items():
        if key not in features:
            raise DataError(f"LeRobot dataset {root}: no feature {key!r} (features: {sorted(features)})")
        shape = list(features[key].get("shape", []))
        if shape != [dim]:
            raise DataError(f"LeRobot dataset {root}: {key!r} has shape {shape}, {embodiment}'s {what} has {dim} values")
    if camera not in features or features[camera].get("dtype") not in ("video", "image"):
        raise DataError(f"LeRobot dataset {root}: no video or image feature {camera!r} (features: {sorted(features)})")
    return features[camera]["dtype"] == "video"


def _video_path(root: Path, info: dict, ep_meta: dict, camera: str) -> Path:
    """The MP4 holding one episode's frames of video feature `camera` (v3.0: many episodes may share one)."""
    prefix = f"videos/{camera}/"
    missing = [k for k in ("chunk_index", "file_index", "from_timestamp", "to_timestamp") if prefix + k not in ep_meta]
    if missing or not info.get("video_path"):
        raise DataError(f"LeRobot dataset {root}: meta/episodes has no {prefix}{missing[0] if missing else ''} "
                        "(or info.json has no video_path)")
    return root / info["video_path"].format(video_key=camera, chunk_index=ep_meta[prefix + "chunk_index"],
                                            file_index=ep_meta[prefix + "file_index"])


def _plan(root: Path, meta: pa.Table, ep_idx: np.ndarray, episode_length: int,
          episodes: int) -> list[tuple[dict, np.ndarray, int]]:
    """(episode metadata, its frame rows, episodes of `episode_length` cut from it) until `episodes` are planned."""
    plan, planned = [], 0
    for ep_meta in meta.to_pylist():
        if planned >= episodes:
            break
        rows = np.flatnonzero(ep_idx == ep_meta["episode_index"])
        if len(rows) != ep_meta["length"]:
            raise DataError(f"LeRobot dataset {root}: episode {ep_meta['episode_index']} has {len(rows)} frame rows, "
                            f"meta/episodes says length {ep_meta['length']}")
        n_seg = min(len(rows) // episode_length, episodes - planned)
        if n_seg:
            plan.append((ep_meta, rows, n_seg))
            planned += n_seg
    if planned < episodes:
        raise DataError(f"LeRobot dataset {root}: {meta.num_rows} episodes give {planned} episodes of {episode_length} "
                        f"steps, the site asks for {episodes} (lower data.sites[].episodes or data.episode_length)")
    return plan


def _episode_frames(root: Path, decoded: tuple[np.ndarray, np.ndarray], ep_meta: dict, camera: str, fps: int,
                    n: int) -> np.ndarray:
    """The [from_timestamp, to_timestamp) span of a decoded file: one episode's `n` frames (DataError otherwise)."""
    frames, times = decoded
    tol, prefix = 0.5 / fps, f"videos/{camera}/"
    keep = (times >= ep_meta[prefix + "from_timestamp"] - tol) & (times < ep_meta[prefix + "to_timestamp"] - tol)
    if keep.sum() != n:
        raise DataError(f"LeRobot dataset {root}: video {camera!r} has {keep.sum()} frames for episode "
                        f"{ep_meta['episode_index']} of {n} rows")
    return frames[keep]


def read_lerobot(root: Path, camera: str, embodiment: str, image_size: int, episode_length: int, episodes: int,
                 state_key: str = "observation.state", action_key: str = "action", threads: int = 2) -> LeRobotImport:
    """A local LeRobot v3.0 dataset → `episodes` episodes of `episode_length` steps; DataError naming the dataset and key.

    The MP4s are decoded on `threads` threads (PyAV releases the GIL while it decodes and converts).
    """
    root = Path(root)
    info, info_sha = _load_info(root)
    fps = int(info["fps"])
    cls = embodiment_class(embodiment)
    dims = {action_key: (cls.action_dim, "action"), state_key: (cls.proprio_dim, "proprioception")}
    is_video = _check_features(root, info["features"], camera, embodiment, dims)

    meta = _read_parquets(root, "meta/episodes/chunk-*/file-*.parquet", "episodes metadata")
    if meta.num_rows == 0:
        raise DataError(f"LeRobot dataset {root}: meta/episodes lists no episodes")
    meta = meta.drop_columns([c for c in meta.column_names if c.startswith("stats/")]).sort_by("episode_index")
    columns = ["episode_index", "frame_index", state_key, action_key] + ([] if is_video else [camera])
    data = _read_parquets(root, "data/chunk-*/file-*.parquet", "frame data")
    absent = [c for c in columns if c not in data.column_names]
    if absent:
        raise DataError(f"LeRobot dataset {root}: frame data has no column {absent[0]!r}")
    data = data.select(columns).sort_by([("episode_index", "ascending"), ("frame_index", "ascending")])
    state, action = _vector_column(data, state_key, root), _vector_column(data, action_key, root)
    for key, values in ((action_key, action), (state_key, state)):
        if values.shape[1] != dims[key][0]:  # the rows themselves, not only info.json's declared shape
            raise DataError(f"LeRobot dataset {root}: {key!r} rows hold {values.shape[1]} values, "
                            f"{embodiment} takes {dims[key][0]}")
    plan = _plan(root, meta, data.column("episode_index").to_numpy(), episode_length, episodes)

    if is_video:
        paths = list(dict.fromkeys(_video_path(root, info, m, camera) for m, _, _ in plan))
        with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
            decoded = dict(zip(paths, pool.map(lambda p: decode_video(p, image_size), paths)))
    frames, acts, props = [], [], []
    for ep_meta, rows, n_seg in plan:
        if is_video:
            decoded_file = decoded[_video_path(root, info, ep_meta, camera)]
            ep_frames = _episode_frames(root, decoded_file, ep_meta, camera, fps, len(rows))
        else:
            ep_frames = _decode_images(data.column(camera).take(pa.array(rows[: n_seg * episode_length])), root, camera,
                                       image_size)
        for s in range(n_seg):
            sl = slice(s * episode_length, (s + 1) * episode_length)
            frames.append(ep_frames[sl])
            acts.append(action[rows[sl]])
            props.append(state[rows[sl]])
    eps = Episodes(embodiment, np.stack(frames), np.stack(acts), np.stack(props))
    return LeRobotImport(eps, fps, CODEBASE_VERSION, meta.num_rows, info_sha)


# ---- export ----

def _feature(dim: int, prefix: str) -> dict:
    return {"dtype": "float32", "shape": [dim], "names": [f"{prefix}_{i}" for i in range(dim)]}


def _stats(values_NK: np.ndarray) -> dict:
    return {"min": values_NK.min(0).tolist(), "max": values_NK.max(0).tolist(), "mean": values_NK.mean(0).tolist(),
            "std": values_NK.std(0).tolist(), "count": [int(values_NK.shape[0])]}


def _frame_table(eps: Episodes, e0: int, e1: int, fps: int) -> pa.Table:
    """Episodes [e0, e1) as lerobot frame rows (fixed-size float32 lists, int64 indices, float32 timestamps)."""
    E, L = e1 - e0, eps.frames_ELHWC.shape[1]
    K, P = eps.actions_ELK.shape[2], eps.proprio_ELP.shape[2]
    frame_index = np.tile(np.arange(L, dtype=np.int64), E)
    return pa.table({
        "action": pa.FixedSizeListArray.from_arrays(pa.array(eps.actions_ELK[e0:e1].reshape(-1)), K),
        "observation.state": pa.FixedSizeListArray.from_arrays(pa.array(eps.proprio_ELP[e0:e1].reshape(-1)), P),
        "timestamp": (frame_index / fps).astype(np.float32),
        "frame_index": frame_index,
        "episode_index": np.repeat(np.arange(e0, e1, dtype=np.int64), L),
        "index": np.arange(e0 * L, e1 * L, dtype=np.int64),
        "task_index": np.zeros(E * L, dtype=np.int64),
    })


def write_lerobot(eps: Episodes, out: Path, fps: int, camera: str = "observation.images.top", task: str | None = None,
                  video: str = "lossless") -> dict:
    """Write `eps` as a LeRobot v3.0 dataset under `out` (which must be empty or absent); returns its info.json.

    `video` names a VIDEO_PRESETS entry; `task` is the one task every frame carries (default: "<embodiment> exploration").
    """
    out = Path(out)
    if video not in VIDEO_PRESETS:
        raise ValueError(f"video preset {video!r} unknown; known: {sorted(VIDEO_PRESETS)}")
    if out.exists() and any(out.iterdir()):
        raise DataError(f"export target {out} is not empty")
    E, L, H, W, _ = eps.frames_ELHWC.shape
    K, P = eps.actions_ELK.shape[2], eps.proprio_ELP.shape[2]
    task = task or f"{eps.embodiment} exploration"
    row_bytes = 4 * (K + P) + 4 + 4 * 8
    per_file = max(1, DATA_FILE_MB * 2**20 // (row_bytes * L))  # whole episodes per data file
    episodes_meta = []
    for f, e0 in enumerate(range(0, E, per_file)):
        e1 = min(E, e0 + per_file)
        path = out / DATA_PATH.format(**chunk_file(f))
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_frame_table(eps, e0, e1, fps), path)
        for e in range(e0, e1):
            vid = chunk_file(e)  # one MP4 per episode: file e of the camera's series
            encode_video(eps.frames_ELHWC[e], out / VIDEO_PATH.format(video_key=camera, **vid), fps, video)
            episodes_meta.append({
                "episode_index": e, "tasks": [task], "length": L,
                "data/chunk_index": chunk_file(f)["chunk_index"], "data/file_index": chunk_file(f)["file_index"],
                "dataset_from_index": e * L, "dataset_to_index": (e + 1) * L,
                f"videos/{camera}/chunk_index": vid["chunk_index"], f"videos/{camera}/file_index": vid["file_index"],
                f"videos/{camera}/from_timestamp": 0.0, f"videos/{camera}/to_timestamp": L / fps,
                "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
            })
    meta_path = out / EPISODES_PATH.format(chunk_index=0, file_index=0)
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(episodes_meta), meta_path)
    pd.DataFrame({"task_index": [0]}, index=pd.Index([task], name="task")).to_parquet(out / TASKS_PATH)
    pix_fmt, options = VIDEO_PRESETS[video]
    video_info = {"video.height": H, "video.width": W, "video.codec": "h264", "video.pix_fmt": pix_fmt,
                  "video.fps": fps, "video.channels": 3, "video.g": int(options["g"]), "video.crf": int(options["crf"]),
                  "is_depth_map": False, "has_audio": False}
    info = {
        "codebase_version": CODEBASE_VERSION, "robot_type": eps.embodiment, "fps": fps,
        "total_episodes": E, "total_frames": E * L, "total_tasks": 1,
        "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": DATA_FILE_MB, "video_files_size_in_mb": VIDEO_FILE_MB,
        "data_path": DATA_PATH, "video_path": VIDEO_PATH, "splits": {"train": f"0:{E}"},
        "features": {
            "action": _feature(K, "action"), "observation.state": _feature(P, "state"),
            camera: {"dtype": "video", "shape": [H, W, 3], "names": ["height", "width", "channels"], "info": video_info},
            **DEFAULT_FEATURES,
        },
    }
    (out / INFO_PATH).write_text(json.dumps(info, indent=4) + "\n")
    stats = {"action": _stats(eps.actions_ELK.reshape(-1, K)), "observation.state": _stats(eps.proprio_ELP.reshape(-1, P))}
    (out / STATS_PATH).write_text(json.dumps(stats, indent=4) + "\n")
    return info
