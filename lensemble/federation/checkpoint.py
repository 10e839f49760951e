"""Crash-safe checkpoints of a federation: commit after every round, resume at the last committed one.

A coordinator checkpoint holds what the aggregator owns: the round index to run next, the global
parameters, the outer momentum, its RNG states, the run id and the per-round history the report
needs. Each site's local state (model + AdamW moments, as `tasks.train.site_train` saves it) stays at
the site: the site snapshots it into its own folder (`commit_site_state`) and the coordinator keeps
only the snapshot's path and sha256 (`SiteStateRef`).

Commit order of one round (what makes "a crash loses at most the round in flight" hold):
    1. every site: `commit_site_state(working state, site folder, r)` → ref (a new, immutable file)
    2. coordinator: `save_checkpoint(path, FederationCheckpoint(round_idx=r + 1, ..., site refs))`
    3. every site: `prune_site_states(site folder, keep=ref)` drops the snapshots of earlier rounds
A crash before 2 leaves the previous checkpoint and the snapshots it references intact; a crash
after 2 only leaves files for 3 to delete next time. On resume, `restore_site_state` puts each
site's committed snapshot back over its working file, which the crashed round may have overwritten.

File format (one file, written atomically: temporary file in the same folder, flush, fsync,
os.replace, fsync of the folder):
    line 1   JSON header {"format", "version", "sha256", "hmac_sha256", "key_id", "meta_bytes", "tensor_bytes"}
    then     `meta_bytes` of UTF-8 JSON: run id, round, site refs, numpy/python RNG states, history
    then     `tensor_bytes` of torch.save({"global", "momentum", "torch_rng"}), read back with
             torch.load(weights_only=True): tensors and plain containers only, never arbitrary pickles
"sha256" covers meta and tensor bytes together and detects corruption; anyone can recompute it.
"hmac_sha256" = HMAC-SHA256(K, "<format>|<version>|<meta_bytes>|<tensor_bytes>\n" + meta + tensors)
under the coordinator's key K (`keys/coordinator.hmac`: 32 random bytes, created mode 0600 on the
first save, never in git or a DVC output) detects tampering: a file edited and re-hashed, or written
under another coordinator's key. "key_id" (the first 16 hex digits of sha256(K)) only names the key
in messages; it proves nothing. `load_checkpoint` refuses a file whose hash, MAC, sizes, run id or
any referenced site snapshot do not verify, or whose key is missing, with `IntegrityError` naming
the file.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lensemble.errors import IntegrityError

FORMAT = "lensemble-federation-checkpoint"
VERSION = 2  # 2: keyed (HMAC-SHA256); version-1 files are refused
KEY_BYTES = 32
SITE_SNAPSHOT = "round-{:06d}.pt"
_SITE_SNAPSHOT_RE = re.compile(r"^round-(\d{6})\.pt$")

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SiteStateRef:
    """Where a site keeps its committed local state, and the sha256 of that file's bytes."""

    path: Path
    sha256: str
    round_idx: int


@dataclass
class RngState:
    """The coordinator's global RNG states: torch (CPU), numpy's legacy global, python's `random`."""

    torch_state: torch.Tensor  # torch.get_rng_state(), uint8
    numpy_state: dict  # np.random.get_state(legacy=False), key array as a list
    python_state: list  # random.getstate() as lists


@dataclass
class FederationCheckpoint:
    """Everything the coordinator needs to continue a federation at round `round_idx`."""

    run_id: str
    round_idx: int  # the next round to run; rounds < round_idx are committed
    global_params: State
    momentum: State | None
    site_states: dict[str, SiteStateRef]  # sites with a committed local state; the others start fresh
    rng: RngState
    history: list = field(default_factory=list)  # JSON-able per-round records, in round order


# ---------------------------------------------------------------- atomic files


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (the directory entry itself is fsynced)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never a mix.

    One writer per path (the coordinator for its checkpoint, a site for its snapshots): temporary
    files of this path left by an earlier, crashed writer are deleted first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left behind by a crash
        stale.unlink(missing_ok=True)
    tmp = _temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ---------------------------------------------------------------- RNG


def capture_rng() -> RngState:
    """The current global RNG states of torch (CPU), numpy and python `random`."""
    np_state = np.random.get_state(legacy=False)
    np_json = {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])}}
    version, internal, gauss = random.getstate()
    return RngState(torch.get_rng_state(), np_json, [version, list(internal), gauss])


def restore_rng(rng: RngState) -> None:
    """Set the global RNGs to `rng` (the inverse of `capture_rng`)."""
    torch.set_rng_state(rng.torch_state)
    np_state = {**rng.numpy_state, "state": {"key": np.asarray(rng.numpy_state["state"]["key"], dtype=np.uint32), "pos": rng.numpy_state["state"]["pos"]}}
    np.random.set_state(np_state)
    version, internal, gauss = rng.python_state
    random.setstate((version, tuple(internal), gauss))


# ---------------------------------------------------------------- site-local state


def commit_site_state(state_path: Path, site_dir: Path, round_idx: int) -> SiteStateRef:
    """Snapshot a site's working state file as `site_dir/round-NNNNNN.pt`; runs at the site.

    A copy, not a rename: the working file stays where `site_train` expects it, while the snapshot
    is never written again, so the hash the coordinator records stays valid until it is pruned.
    """
    data = Path(state_path).read_bytes()
    dest = Path(site_dir) / SITE_SNAPSHOT.format(round_idx)
    atomic_write(dest, data)
    return SiteStateRef(dest, hashlib.sha256(data).hexdigest(), round_idx)


def read_site_state(site: str, ref: SiteStateRef, context: str) -> bytes:
    """The snapshot's bytes; IntegrityError naming it unless it exists and matches the recorded sha256."""
    if not ref.path.is_file():
        raise IntegrityError(f"{context}: local state of site '{site}' ({ref.path}) is missing")
    data = ref.path.read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if found != ref.sha256:
        raise IntegrityError(f"{context}: local state of site '{site}' ({ref.path}) has sha256 {found[:12]}, expected {ref.sha256[:12]}")
    return data


def restore_site_state(site: str, ref: SiteStateRef | None, state_path: Path) -> None:
    """Put the committed snapshot back over the site's working state file (none: delete it).

    The round in flight at a crash may have overwritten the working file; an uninterrupted run would
    start the next round from the committed state, so the resumed one must too. Verified again here
    because the site, not the coordinator, owns the file.
    """
    state_path = Path(state_path)
    if ref is None:
        state_path.unlink(missing_ok=True)
    else:
        atomic_write(state_path, read_site_state(site, ref, f"restoring {state_path}"))


def prune_site_states(site_dir: Path, keep: SiteStateRef) -> list[Path]:
    """Delete this site's snapshots of rounds before `keep`'s; returns the deleted paths."""
    removed = []
    for p in sorted(Path(site_dir).glob("round-*.pt")):
        m = _SITE_SNAPSHOT_RE.match(p.name)
        if m and int(m.group(1)) < keep.round_idx:
            p.unlink()
            removed.append(p)
    return removed


# ---------------------------------------------------------------- coordinator key


def coordinator_key_path(root: Path) -> Path:
    """The coordinator's checkpoint key: `keys/` is git-ignored and no DVC stage writes it."""
    return Path(root) / "keys" / "coordinator.hmac"


def _read_key(key_path: Path) -> bytes:
    key = Path(key_path).read_bytes()
    if len(key) != KEY_BYTES:
        raise IntegrityError(f"coordinator key {key_path} holds {len(key)} bytes, expected {KEY_BYTES}")
    return key


def coordinator_key(key_path: Path) -> bytes:
    """The coordinator's HMAC key, created (32 random bytes, mode 0600, exclusively) if there is none."""
    key_path = Path(key_path)
    if not key_path.is_file():
        key_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another writer created it first: use theirs
            return _read_key(key_path)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(key_path.parent)
    return _read_key(key_path)


def key_id(key: bytes) -> str:
    """A short public name of a key, for messages only."""
    return hashlib.sha256(key).hexdigest()[:16]


def _mac(key: bytes, n_meta: int, n_tensor: int, *payload) -> str:
    """HMAC-SHA256 over the format, version and sizes, then the payload (meta + tensors, in parts)."""
    m = hmac.new(key, f"{FORMAT}|{VERSION}|{n_meta}|{n_tensor}\n".encode(), hashlib.sha256)
    for part in payload:
        m.update(part)
    return m.hexdigest()


# ---------------------------------------------------------------- coordinator checkpoint


def _tensor_blob(ckpt: FederationCheckpoint) -> bytes:
    buf = io.BytesIO()
    torch.save({"global": dict(ckpt.global_params), "momentum": None if ckpt.momentum is None else dict(ckpt.momentum), "torch_rng": ckpt.rng.torch_state}, buf)
    return buf.getvalue()


def _meta(ckpt: FederationCheckpoint, folder: Path) -> dict:
    refs = {s: {"path": os.path.relpath(r.path.resolve(), folder.resolve()), "sha256": r.sha256, "round": r.round_idx} for s, r in sorted(ckpt.site_states.items())}
    return {"run_id": ckpt.run_id, "round_idx": ckpt.round_idx, "site_states": refs,
            "rng": {"numpy": ckpt.rng.numpy_state, "python": ckpt.rng.python_state}, "history": ckpt.history}


def save_checkpoint(path: Path, ckpt: FederationCheckpoint, key_path: Path) -> str:
    """Commit `ckpt` to `path` atomically, MACed under the key at `key_path` (created if missing);
    returns the payload's sha256."""
    path = Path(path)
    key = coordinator_key(key_path)
    if ckpt.momentum is not None and set(ckpt.momentum) != set(ckpt.global_params):
        raise ValueError("momentum names differ from global parameter names")
    try:
        meta = json.dumps(_meta(ckpt, path.parent), sort_keys=True).encode()
    except TypeError as exc:
        raise TypeError(f"checkpoint history and metadata must be JSON-serialisable: {exc}") from None
    tensors = _tensor_blob(ckpt)
    h = hashlib.sha256(meta)
    h.update(tensors)
    digest = h.hexdigest()
    mac = _mac(key, len(meta), len(tensors), meta, tensors)
    header = json.dumps({"format": FORMAT, "version": VERSION, "sha256": digest, "hmac_sha256": mac, "key_id": key_id(key),
                         "meta_bytes": len(meta), "tensor_bytes": len(tensors)}).encode()
    atomic_write(path, header + b"\n" + meta + tensors)
    return digest


def _parse(path: Path, data: memoryview, key: bytes) -> tuple[dict, memoryview]:
    """Header checks, the hash and the MAC; (meta, tensor bytes) or IntegrityError. Views, not copies:
    the tensor part is most of a large model's checkpoint."""
    newline = bytes(data[:4096]).find(b"\n")  # the header is one short JSON line
    head, body = (data[:newline], data[newline + 1 :]) if newline >= 0 else (data, None)
    try:
        header = json.loads(bytes(head)) if body is not None else None
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise IntegrityError(f"checkpoint {path} has no valid header (not a Lensemble federation checkpoint, or corrupted)")
    if header.get("version") != VERSION:
        raise IntegrityError(f"checkpoint {path} has format version {header.get('version')!r}, this code reads {VERSION}")
    n_meta, n_tensor = header.get("meta_bytes"), header.get("tensor_bytes")
    if not isinstance(n_meta, int) or not isinstance(n_tensor, int) or len(body) != n_meta + n_tensor:
        raise IntegrityError(f"checkpoint {path} is truncated or padded: {len(body)} payload bytes, header says {n_meta} + {n_tensor}")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise IntegrityError(f"checkpoint {path} fails its sha256 check (corrupted)")
    mac = header.get("hmac_sha256")
    if not isinstance(mac, str) or not hmac.compare_digest(_mac(key, n_meta, n_tensor, body), mac):
        if header.get("key_id") != key_id(key):
            raise IntegrityError(f"checkpoint {path} fails its HMAC check: written under another coordinator key "
                                 f"(key id {str(header.get('key_id'))[:16]!r}, ours {key_id(key)!r}) or tampered with")
        raise IntegrityError(f"checkpoint {path} fails its HMAC check: tampered with (its sha256 was recomputed)")
    try:
        return json.loads(bytes(body[:n_meta])), body[n_meta:]
    except ValueError:  # the hash matched, so the writer produced this: still never load it
        raise IntegrityError(f"checkpoint {path} has unreadable metadata") from None


def load_checkpoint(path: Path, expected_run: str, key_path: Path) -> FederationCheckpoint | None:
    """The committed checkpoint at `path`, None if there is none; IntegrityError if it does not verify.

    Verified before anything is used: the coordinator key at `key_path` exists, header, sizes,
    sha256, HMAC, run id, then every referenced site snapshot's sha256. A temporary file left by a
    crash is never read.
    """
    path = Path(path)
    if not path.is_file():
        return None
    if not Path(key_path).is_file():
        raise IntegrityError(f"checkpoint {path} exists but the coordinator key {key_path} that signed it is missing; "
                             f"restore the key, or move the checkpoint away to start this run fresh")
    meta, tensor_bytes = _parse(path, memoryview(path.read_bytes()), _read_key(key_path))
    if meta.get("run_id") != expected_run:
        raise IntegrityError(f"checkpoint {path} belongs to run {meta.get('run_id')!r}, not {expected_run!r}; move it away to start this run fresh")
    refs = {s: SiteStateRef((path.parent / r["path"]).resolve(), r["sha256"], int(r["round"])) for s, r in meta["site_states"].items()}
    for site, ref in refs.items():
        read_site_state(site, ref, f"checkpoint {path}")
    try:
        tensors = torch.load(io.BytesIO(tensor_bytes), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:  # hash verified: only a writer bug gets here
        raise IntegrityError(f"checkpoint {path}: tensor payload does not load: {exc}") from None
    rng = RngState(tensors["torch_rng"], meta["rng"]["numpy"], meta["rng"]["python"])
    return FederationCheckpoint(meta["run_id"], int(meta["round_idx"]), tensors["global"], tensors["momentum"], refs, rng, meta["history"])


def restore_sites(ckpt: FederationCheckpoint | None, state_paths: Mapping[str, Path]) -> None:
    """Before the first resumed round: every site's working state back to the committed one."""
    for site, state_path in state_paths.items():
        restore_site_state(site, None if ckpt is None else ckpt.site_states.get(site), state_path)
