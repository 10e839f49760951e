"""Episode generation and the per-site Parquet episode store.

An episode is `episode_length` consecutive (frame, action, proprio) triples from one embodiment,
driven by an exploration policy that alternates segments of a noisy scripted expert and of uniform
random actions, so the data covers both purposeful and off-policy motion. Everything is derived from
(run seed, site) and is bit-for-bit reproducible.

Store layout (one row per step):
    episode_id int32 | step int32 | frame binary (raw uint8 H*W*3) | action list<float32>
    | proprio list<float32> | embodiment string
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lensemble.errors import DataError
from lensemble.seeds import derive_seed
from lensemble.sim.base import Embodiment

SCHEMA = pa.schema(
    [
        ("episode_id", pa.int32()),
        ("step", pa.int32()),
        ("frame", pa.binary()),
        ("action", pa.list_(pa.float32())),
        ("proprio", pa.list_(pa.float32())),
        ("embodiment", pa.string()),
    ]
)
SCHEMA_HASH = hashlib.sha256(SCHEMA.to_string().encode()).hexdigest()


@dataclass(frozen=True)
class Episodes:
    """Episodes of one embodiment as dense arrays."""

    embodiment: str
    frames_ELHWC: np.ndarray  # [E, L, H, W, 3] uint8
    actions_ELK: np.ndarray  # [E, L, K] float32; action L-1 is the last one taken
    proprio_ELP: np.ndarray  # [E, L, P] float32

    @property
    def num_episodes(self) -> int:
        return int(self.frames_ELHWC.shape[0])

    def content_hash(self) -> str:
        """sha256 over the raw bytes of frames, actions and proprio."""
        h = hashlib.sha256(self.embodiment.encode())
        for arr in (self.frames_ELHWC, self.actions_ELK, self.proprio_ELP):
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()


def exploration_episode(
    env: Embodiment, seed: int, length: int, noise: float, random_fraction: float, segment: int,
    snapshots: list[object] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One episode: frames [L, H, W, 3], actions [L, K], proprio [L, P].

    `snapshots`: a list that receives the simulator state at each step, before its action (L of them),
    for replaying a step under other actions (`lensemble.counterfactual`); the episode is the same either way."""
    rng = np.random.default_rng(seed)
    env.reset(seed)
    frames, actions, proprio = [], [], []
    use_random = False
    for t in range(length):
        if t % segment == 0:
            use_random = bool(rng.random() < random_fraction)
        action = env.random_action(rng) if use_random else env.expert_action(rng, noise)
        if snapshots is not None:
            snapshots.append(env.snapshot())
        frames.append(env.render())
        proprio.append(env.proprio())
        actions.append(np.clip(action, -1.0, 1.0).astype(np.float32))
        env.step(action)
    return np.stack(frames), np.stack(actions), np.stack(proprio)


def generate_episodes(
    env: Embodiment,
    run_seed: int,
    namespace: str,
    num_episodes: int,
    length: int,
    noise: float,
    random_fraction: float,
    segment: int,
    progress=None,
) -> Episodes:
    """`num_episodes` exploration episodes, each seeded by (run seed, namespace, episode index)."""
    frames, actions, proprio = [], [], []
    for e in range(num_episodes):
        seed = derive_seed(run_seed, f"episodes/{namespace}", participant=str(e)) % (2**32)
        f, a, p = exploration_episode(env, seed, length, noise, random_fraction, segment)
        frames.append(f)
        actions.append(a)
        proprio.append(p)
        if progress is not None:
            progress(1)
    return Episodes(env.name, np.stack(frames), np.stack(actions), np.stack(proprio))


def to_table(eps: Episodes) -> pa.Table:
    """Episodes → an Arrow table with `SCHEMA`."""
    E, L = eps.frames_ELHWC.shape[:2]
    flat_frames = eps.frames_ELHWC.reshape(E * L, -1)
    return pa.table(
        {
            "episode_id": np.repeat(np.arange(E, dtype=np.int32), L),
            "step": np.tile(np.arange(L, dtype=np.int32), E),
            "frame": [row.tobytes() for row in flat_frames],
            "action": list(eps.actions_ELK.reshape(E * L, -1)),
            "proprio": list(eps.proprio_ELP.reshape(E * L, -1)),
            "embodiment": [eps.embodiment] * (E * L),
        },
        schema=SCHEMA,
    )


def write_episodes(eps: Episodes, path: Path) -> None:
    """Write atomically: a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(to_table(eps), tmp)
    tmp.replace(path)


def _numeric_lists(table: pa.Table, name: str, path: Path) -> np.ndarray:
    """A list<float32> column as [rows, K] float32; DataError if ragged, null or non-finite."""
    col = table.column(name).combine_chunks()
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    if col.null_count or len(lengths) == 0 or lengths.min() != lengths.max() or lengths[0] < 1:
        raise DataError(f"episode store {path}: column {name!r} has null or ragged rows")
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if not np.isfinite(values).all():
        raise DataError(f"episode store {path}: column {name!r} holds NaN or Inf")
    return values.reshape(len(lengths), int(lengths[0]))


def read_episodes(path: Path, image_size: int) -> Episodes:
    """Read a store written by `write_episodes`; DataError naming the file on any defect."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"episode store {path} is missing; run the prepare stage")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"episode store {path} is corrupt or truncated: {exc}") from None
    if not table.schema.equals(SCHEMA):
        found = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
        raise DataError(f"episode store {path} has schema ({found}), expected ({', '.join(f'{f.name}: {f.type}' for f in SCHEMA)})")
    if table.num_rows == 0:
        raise DataError(f"episode store {path} is empty")
    if any(table.column(n).null_count for n in ("episode_id", "step", "frame", "embodiment")):
        raise DataError(f"episode store {path} has null values")
    ep = table.column("episode_id").to_numpy()
    step = table.column("step").to_numpy()
    E, L = int(ep.max()) + 1, int(step.max()) + 1
    if table.num_rows != E * L or not (ep == np.repeat(np.arange(E), L)).all() or not (step == np.tile(np.arange(L), E)).all():
        raise DataError(f"episode store {path} has missing or unordered rows ({table.num_rows} rows for {E}x{L})")
    frame_col = table.column("frame")
    frame_bytes = image_size * image_size * 3
    if not pc.all(pc.equal(pc.binary_length(frame_col), frame_bytes)).as_py():
        raise DataError(f"episode store {path} holds frames that are not {image_size}x{image_size}x3")
    frames = np.frombuffer(b"".join(frame_col.to_pylist()), dtype=np.uint8).reshape(E, L, image_size, image_size, 3)
    actions = _numeric_lists(table, "action", path).reshape(E, L, -1)
    proprio = _numeric_lists(table, "proprio", path).reshape(E, L, -1)
    names = pc.unique(table.column("embodiment")).to_pylist()
    if len(names) != 1:
        raise DataError(f"episode store {path} mixes embodiments {sorted(names)}")
    return Episodes(names[0], frames, actions, proprio)


def data_manifest(eps: Episodes, path: Path) -> dict:
    """Counts and hashes only: safe to leave the site."""
    return {
        "embodiment": eps.embodiment,
        "episodes": eps.num_episodes,
        "steps": int(eps.frames_ELHWC.shape[0] * eps.frames_ELHWC.shape[1]),
        "schema_hash": SCHEMA_HASH,
        "content_hash": eps.content_hash(),
        "file_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
    }


def write_json(obj: dict, path: Path) -> None:
    """Atomic JSON write (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
