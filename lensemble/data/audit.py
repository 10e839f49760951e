"""Private-content index of one site, and the leak scan built on it.

A `PrivateIndex` recognises copies of a site's private rows inside arbitrary bytes:

- value streams (actions, proprioception and, optionally, site-local tensors such as the action
  head): every 8-byte window at float32 stride over each episode's contiguous stream, i.e. every
  pair of consecutive values. A pair identifies a row when one of its values is distinctive:
  unique in the site's stream and off coarse dyadic grids. Repeated values (saturated actions,
  clamped positions, zero velocities) and grid values (start states on a pixel grid) recur in
  anyone's data of the same world, so pairs made only of them are left out.
- frames: whole frames, in the stored layout ([H, W, 3] uint8) and in the model's
  (`frames_to_tensor`: float32 in [-1, 1], as [3, H, W] and in its channels-last storage).
  Short pixel windows are useless as fingerprints (an object drawn at the same pixel position
  renders to the same bytes in every episode, public ones included), so a frame is keyed by an
  8-byte *anchor* word among its moving bytes (where it differs from the site's median frame; the
  rarest such word across the site's frames), checked by a second rare word at its own offset and
  confirmed by a 64-bit BLAKE2b of the whole frame.

Scanning views a blob as little-endian uint64 at its 8 byte alignments (every byte offset is
tested), pre-filters every word with one lookup in a 4 MiB bitmap and resolves the rare candidates
with binary search; its cost is a few passes over the blob. `scan_file` (and `scan_data`, and
`scan_blobs` for objects that are not local files, such as the exchange's run tree) also looks
inside what a file may encode: images (decoded pixels), zip and gzip members, base64 and hex runs,
and numbers written as text (consecutive numbers as float32 pairs, counted when their decimal forms
carry `TEXT_PAIR_DIGITS` significant digits together; runs of integers 0..255 as bytes).
Several sites' indexes are scanned in one pass (`scan_many`: one pre-filter on the union of their
bitmaps, then each index resolves the candidates).

The text pass (numbers, base64 and hex runs) and the pre-filter run in `text_scan.c` where a C
compiler is available: the regular expressions below are its reference, and give the same numbers
bit for bit and the same decoded bytes (tests/test_text_scan.py). A project's Prefect database and
MLflow store grow with every run and are scanned after the federation and by the residency stage: in
a workspace holding 171 MB of Prefect database, the scan of the shared outputs took 37.9 s with the
regular expressions and a pass per site, 5.7 s now (LENSEMBLE_NATIVE=0: 32.7 s).

The index is derived from private rows: it stays at its site, beside the episodes.
"""
from __future__ import annotations

import base64
import binascii
import ctypes
import functools
import gzip
import hashlib
import io
import re
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from lensemble.data.episodes import Episodes
from lensemble.data.windows import frames_to_tensor
from lensemble.native_build import compiled

_BITS = 22  # bitmap slots 2^22 (4 MiB): ~25k keys leave > 99% of words rejected by one lookup
_MUL = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(64 - _BITS)
_ANCHOR_SAMPLES = 64  # candidate anchor words per frame, spread over its moving bytes
_CHUNK = 256  # frames per block when building frame keys (bounds the float32 copy to ~50 MB at 64x64)
_FRAME_COLS = ("word", "at", "check_at", "check_word", "length", "digest")
INDEX_FILE = "private_index.npz"  # beside a site's episodes.parquet; never leaves the site


def _slot(words: np.ndarray) -> np.ndarray:
    return ((words * _MUL) >> _SHIFT).astype(np.intp)


def _digest(buf) -> np.uint64:
    return np.frombuffer(hashlib.blake2b(buf, digest_size=8).digest(), "<u8")[0]


def _distinctive(v: np.ndarray) -> np.ndarray:
    """Values that identify a row: unique within `v` and with >= 11 significant bits.

    Values that repeat (clamped positions, zero velocities, saturated actions) or lie on a coarse
    dyadic grid (start states on a pixel grid) recur in anyone's data of the same world.
    """
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    significand = (v.view(np.uint32) & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    return (counts[inverse.reshape(v.shape)] == 1) & ((significand & np.uint32(0x1FFF)) != 0)


def value_keys(values: np.ndarray) -> np.ndarray:
    """Keys of every pair of consecutive float32 values along the last axis of `values` [..., N].

    A pair is kept when at least one of its values is distinctive (see `_distinctive`).
    """
    v = np.ascontiguousarray(values, dtype=np.float32)
    v = v.reshape(-1, v.shape[-1]) if v.ndim > 1 else v[None]
    if v.shape[1] < 2:
        return np.zeros(0, np.uint64)
    rare = _distinctive(v)
    keep = (rare[:, :-1] | rare[:, 1:]).ravel()
    pairs = np.lib.stride_tricks.sliding_window_view(v, 2, axis=1).reshape(-1, 2)  # [R * (N - 1), 2]
    return np.ascontiguousarray(pairs[keep]).view("<u8").ravel()


def _frame_forms(frames_FHWC: np.ndarray) -> list[np.ndarray]:
    """The byte layouts a frame takes in Lensemble: stored uint8 [H, W, 3]; `frames_to_tensor`'s
    float32 as [3, H, W] (contiguous, `.numpy()`) and as its channels-last storage (`torch.save`)."""
    t = frames_to_tensor(frames_FHWC)
    return [frames_FHWC.view(np.uint8), t.contiguous().numpy().view(np.uint8), t.movedim(-3, -1).numpy().view(np.uint8)]


def frame_keys(frames_FHWC: np.ndarray) -> np.ndarray:
    """Anchored whole-frame keys [M, 6] uint64 (see `_FRAME_COLS`) for every layout of `_frame_forms`.

    Anchor and check are the two rarest of `_ANCHOR_SAMPLES` words sampled across the frame's moving
    bytes (rarest across the site's frames): an object drawn the same way in many frames would make
    a first-moving-byte anchor match hundreds of frames, each then needing a whole-frame digest.
    """
    F = len(frames_FHWC)
    if F == 0:
        return np.zeros((0, len(_FRAME_COLS)), np.uint64)
    sample = frames_FHWC[np.linspace(0, F - 1, min(F, 64)).astype(int)]
    ref_HWC = np.median(sample, axis=0).astype(np.uint8)  # the static scene: floor, walls, fixed goal
    refs = [form.reshape(-1) for form in _frame_forms(ref_HWC[None])]
    found = []  # per (form, frame): offsets [S], words [S], length, digest
    for c in range(0, F, _CHUNK):
        block = frames_FHWC[c : c + _CHUNK]
        for form, ref in zip(_frame_forms(block), refs):
            form_FB = form.reshape(len(block), -1)
            B = form_FB.shape[1]
            for f in form_FB:
                moving = np.flatnonzero(f != ref)
                if not moving.size:
                    continue  # the static scene itself: nothing private
                offs = np.unique(np.minimum(moving[np.linspace(0, moving.size - 1, min(moving.size, _ANCHOR_SAMPLES)).astype(int)], B - 8))
                words = f[offs[:, None] + np.arange(8)].copy().view("<u8").ravel()
                found.append((offs, words, B, _digest(f)))
    if not found:
        return np.zeros((0, len(_FRAME_COLS)), np.uint64)
    uniq, counts = np.unique(np.concatenate([w for _, w, _, _ in found]), return_counts=True)
    rows = []
    for offs, words, B, digest in found:
        order = np.lexsort((offs, counts[np.searchsorted(uniq, words)]))  # rarest first, then earliest
        a = order[0]
        far = order[np.abs(offs[order].astype(np.int64) - int(offs[a])) >= 8]
        b = far[0] if far.size else a
        rows.append((words[a], offs[a], offs[b], words[b], B, digest))
    table = np.unique(np.array(rows, dtype=np.uint64), axis=0)
    return table[np.argsort(table[:, 0], kind="stable")]


class PrivateIndex:
    """Keys of a site's private rows; `scan(blob)` counts them in any bytes. See the module docstring."""

    def __init__(self, values: np.ndarray, frames: np.ndarray) -> None:
        self.values = np.unique(np.asarray(values, np.uint64))  # sorted
        frames = np.asarray(frames, np.uint64).reshape(-1, len(_FRAME_COLS))
        self.frames = frames[np.argsort(frames[:, 0], kind="stable")]
        self._bitmap = np.zeros(1 << _BITS, dtype=bool)
        self._bitmap[_slot(self.values)] = True
        self._bitmap[_slot(self.frames[:, 0])] = True
        self._digest: str | None = None

    def __len__(self) -> int:
        return len(self.values) + len(self.frames)

    def digest(self) -> str:
        """sha256 of the keys: identifies the index in audit records without revealing it."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.values.tobytes() + self.frames.tobytes()).hexdigest()
        return self._digest

    def with_tensors(self, tensors: Mapping[str, torch.Tensor]) -> PrivateIndex:
        """This index plus the value pairs of site-local tensors (e.g. `local_state(model)`)."""
        extra = [value_keys(t.detach().to(torch.float32).cpu().reshape(-1).numpy()) for t in tensors.values()]
        return PrivateIndex(np.concatenate([self.values, *extra]), self.frames)

    def save(self, path: Path) -> None:
        """Write atomically as .npz (the file is private: keep it at the site)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            np.savez(f, values=self.values, frames=self.frames)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> PrivateIndex:
        with np.load(Path(path)) as z:
            return cls(z["values"], z["frames"])

    def scan(self, blob) -> dict[str, int]:
        """Hits per class ("values", "frames") in `blob` (bytes-like), at every byte offset."""
        arr = np.frombuffer(blob, dtype=np.uint8)
        return self._resolve(arr, _candidates(arr, self._bitmap))

    def _resolve(self, arr: np.ndarray, candidates: tuple[np.ndarray, np.ndarray]) -> dict[str, int]:
        """Hits among `_candidates`' (byte offsets, words): any superset of this index's own candidates
        gives the same counts (the bitmap only pre-filters; keys are matched exactly)."""
        offsets, words = candidates
        if not len(words):
            return {"values": 0, "frames": 0}
        values = 0
        if len(self.values):
            pos = np.minimum(np.searchsorted(self.values, words), len(self.values) - 1)
            values = int((self.values[pos] == words).sum())
        frames = len(self._frame_hits(arr, offsets, words)) if len(self.frames) else 0
        return {"values": values, "frames": frames}

    def _frame_hits(self, arr: np.ndarray, offsets: np.ndarray, words: np.ndarray) -> set[tuple[int, int]]:
        """(start, row) of whole private frames whose anchor word sits at one of `offsets`."""
        keys = self.frames[:, 0]
        lo, hi = np.searchsorted(keys, words, "left"), np.searchsorted(keys, words, "right")
        counts = hi - lo
        if not counts.any():
            return set()
        off = np.repeat(offsets, counts).astype(np.int64)
        row = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())  # lo..hi-1 per offset
        t = self.frames[row].astype(np.int64)  # word, at, check_at, check_word, length, digest (last two as int64 views)
        start = off - t[:, 1]
        ok = (start >= 0) & (start + t[:, 4] <= len(arr))
        start, row, t = start[ok], row[ok], t[ok]
        check_pos = start + t[:, 2]
        check = arr[check_pos[:, None] + np.arange(8)].copy().view("<u8").ravel() if len(check_pos) else np.zeros(0, np.uint64)
        ok = check == self.frames[row, 3]
        found = set()
        for s, r in zip(start[ok], row[ok]):
            if _digest(arr[s : s + int(self.frames[r, 4])]) == self.frames[r, 5]:
                found.add((int(s), int(r)))
        return found

    def scan_floats(self, values: Iterable[float]) -> int:
        """Hits among consecutive numbers taken as float32 (e.g. a list in a metrics record): pairs that are
        private pairs and carry `TEXT_PAIR_DIGITS` significant digits together."""
        return self._float_hits(_pair_values(values))

    def _float_hits(self, pairs: np.ndarray) -> int:
        """Hits among `_pair_values` pairs [n, 2] float32 (all of them, or any superset of those this index's bitmap
        passes); a private pair counts when its decimal forms carry `TEXT_PAIR_DIGITS` digits together."""
        if not len(self.values) or not len(pairs):
            return 0
        words = pairs.view("<u8").ravel()
        pos = np.minimum(np.searchsorted(self.values, words), len(self.values) - 1)
        matched = np.flatnonzero(self.values[pos] == words)
        return sum(significant_digits(a) + significant_digits(b) >= TEXT_PAIR_DIGITS for a, b in pairs[matched])


def _candidates(arr: np.ndarray, bitmap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(byte offsets, words) of the little-endian uint64 words at every byte offset of `arr` whose bitmap
    slot is set: by `text_scan.c` in one pass, else in NumPy per byte alignment (the same set of pairs)."""
    lib = _text_lib()
    if lib is None:
        return _numpy_candidates(arr, bitmap)
    if len(arr) < 8:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    flags = np.ascontiguousarray(bitmap).view(np.uint8)
    out = np.empty(len(arr) // 64 + 1024, np.int64)
    count = lib.lens_word_candidates(arr.ctypes.data, len(arr), flags.ctypes.data, _BITS, out.ctypes.data, len(out))
    if count > len(out):  # a blob dense in candidates: room for all of them
        out = np.empty(count, np.int64)
        lib.lens_word_candidates(arr.ctypes.data, len(arr), flags.ctypes.data, _BITS, out.ctypes.data, len(out))
    offsets = out[:count]
    return offsets, arr[offsets[:, None] + np.arange(8)].copy().view("<u8").reshape(-1)


def _numpy_candidates(arr: np.ndarray, bitmap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    offsets, words = [np.zeros(0, np.int64)], [np.zeros(0, np.uint64)]
    for shift in range(8):
        n = (len(arr) - shift) // 8
        if n <= 0:
            continue
        w = arr[shift : shift + 8 * n].view("<u8")
        cand = np.flatnonzero(bitmap[_slot(w)])
        offsets.append(shift + 8 * cand)
        words.append(w[cand])
    return np.concatenate(offsets), np.concatenate(words)


TEXT_PAIR_DIGITS = 9
"""Significant decimal digits a pair of text numbers must carry together to count as a private pair.

A private float32 written out as text carries its shortest decimal form: 7-9 significant digits for
almost every value, so a leaked pair of them carries 14-18 (and a value beside a zero, 8-10). A few
private values are short decimals (the point mass's x = 0.07424 at one step, 4 digits), and a Prefect
database holds tens of millions of short numbers (run times such as "total_run_time": 0.07424, counts,
zeros): beside a "0", that one value was found in a 259 MB database that held no private row. A pair
whose two decimal forms carry fewer digits than this is as likely a coincidence as a leak, so it is
not counted; raw and decoded bytes are matched as before, whatever their values."""


def _pair_values(values: Iterable[float]) -> np.ndarray:
    """Every pair of consecutive numbers, taken as float32: [n - 1, 2]."""
    v = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    if v.size < 2:
        return np.zeros((0, 2), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(v.astype(np.float32), 2))


def significant_digits(x: np.float32) -> int:
    """Significant digits of the shortest decimal form that reads back as the float32 `x` (0 for inf and NaN, 1 for 0)."""
    if not np.isfinite(x):
        return 0
    mantissa = np.format_float_scientific(np.float32(x), unique=True, trim="-").split("e")[0]
    return sum(c.isdigit() for c in mantissa)


def union_bitmap(indexes: Mapping[str, PrivateIndex]) -> np.ndarray:
    """The pre-filter of all `indexes` together: a word none of them may hold is rejected once for all."""
    maps = [index._bitmap for index in indexes.values()]
    return maps[0] if len(maps) == 1 else np.logical_or.reduce(maps)


def scan_many(blob, indexes: Mapping[str, PrivateIndex], numbers: Iterable[float] = (),
              bitmap: np.ndarray | None = None) -> dict[str, dict[str, int]]:
    """Each index's `scan(blob)`, with `scan_floats(numbers)` added to its values: the same counts, from one
    pass over the blob's words against `union_bitmap(indexes)` (given, or built here) rather than a pass
    per site."""
    if not indexes:
        return {}
    arr = np.frombuffer(blob, dtype=np.uint8)
    bitmap = union_bitmap(indexes) if bitmap is None else bitmap
    candidates = _candidates(arr, bitmap)
    pairs = _pair_values(numbers)
    pairs = pairs[bitmap[_slot(pairs.view("<u8").ravel())]] if len(pairs) else pairs
    found = {}
    for site, index in indexes.items():
        hits = index._resolve(arr, candidates)
        hits["values"] += index._float_hits(pairs)
        found[site] = hits
    return found


def index_path(episodes_path: Path) -> Path:
    """Where the private index of the store `episodes_path` lives (same folder)."""
    return Path(episodes_path).with_name(INDEX_FILE)


def load_index(episodes_path: Path, eps: Episodes | None = None) -> PrivateIndex:
    """The stored index of a site's store, or (older stores) one built from `eps`."""
    path = index_path(episodes_path)
    if path.is_file():
        return PrivateIndex.load(path)
    if eps is None:
        raise FileNotFoundError(f"no private index at {path} and no episodes to build one from")
    return fingerprints(eps)


def fingerprints(eps: Episodes, exclude: Episodes | None = None) -> PrivateIndex:
    """The private-content index of a site's episodes (frames, actions, proprioception).

    `exclude` (e.g. the public probe) removes keys that also occur there: they are not private.
    """
    values = np.concatenate([value_keys(eps.actions_ELK.reshape(eps.num_episodes, -1)), value_keys(eps.proprio_ELP.reshape(eps.num_episodes, -1))])
    frames = frame_keys(eps.frames_ELHWC.reshape(-1, *eps.frames_ELHWC.shape[2:]))
    if exclude is not None:
        public = fingerprints(exclude)
        values = np.setdiff1d(values, public.values)
        frames = frames[~np.isin(frames[:, 5], public.frames[:, 5])]
    return PrivateIndex(values, frames)


# ---- files: raw bytes plus what they may encode ----

_B64 = re.compile(rb"[A-Za-z0-9+/]{11,}={0,2}")  # 11 chars: one 8-byte key
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2}){8,}")
_NUM = re.compile(rb"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff"}
MAX_DECODED = 256 << 20  # bytes: never inflate more than this from one file


def _containers(data: bytes, suffix: str) -> Iterable[bytes]:
    """What a file's bytes carry as a whole-file format: an image's pixels, zip members, gzip contents."""
    if suffix in _IMAGE_SUFFIXES:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as im:
                yield im.convert("RGB").tobytes()
        except (OSError, ValueError):
            pass
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    if info.file_size <= MAX_DECODED:
                        yield z.read(info)
        except (zipfile.BadZipFile, OSError, ValueError):
            pass
    if data[:2] == b"\x1f\x8b":
        try:
            yield gzip.decompress(data)[:MAX_DECODED]
        except (OSError, EOFError):
            pass


def _decoded(data: bytes, suffix: str) -> Iterable[bytes]:
    """What a file's bytes may carry besides themselves (the reference `_text_parts` must match)."""
    yield from _containers(data, suffix)
    for m in _B64.finditer(data):
        run = m.group()
        try:
            yield base64.b64decode(run + b"=" * (-len(run) % 4))
        except (binascii.Error, ValueError):
            pass
    for m in _HEX.finditer(data):
        yield bytes.fromhex(m.group().decode())


def _text_numbers(data: bytes) -> tuple[list[float], list[bytes]]:
    """Numbers written as text, in order, and runs (>= 8) of integers 0..255 as bytes."""
    nums, runs, run = [], [], []
    for m in _NUM.finditer(data):
        tok = m.group()
        try:
            x = float(tok)
        except ValueError:
            continue
        nums.append(x)
        if tok.isdigit() and int(tok) <= 255:
            run.append(int(tok))
        else:
            if len(run) >= 8:
                runs.append(bytes(run))
            run = []
    if len(run) >= 8:
        runs.append(bytes(run))
    return nums, runs


@functools.cache
def _text_lib() -> ctypes.CDLL | None:
    """`text_scan.c`, the one-pass equivalent of `_text_numbers` and `_decoded`'s base64 and hex runs; None
    without a C compiler (or with LENSEMBLE_NATIVE=0): the regular expressions then do the same work."""
    lib = compiled((Path(__file__).with_name("text_scan.c"),), name="lensemble-text-scan")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lens_text_numbers.restype = i64
    lib.lens_text_numbers.argtypes = [ptr, i64, ptr, ctypes.POINTER(i64), ctypes.POINTER(i64)]
    lib.lens_word_candidates.restype = i64
    lib.lens_word_candidates.argtypes = [ptr, i64, ptr, ctypes.c_int32, ptr, i64]
    lib.lens_text_runs.restype = None
    lib.lens_text_runs.argtypes = [ptr, i64, ptr]
    for fn in (lib.lens_base64_parts, lib.lens_hex_parts):
        fn.restype = i64
        fn.argtypes = [ptr, i64, ptr, ctypes.POINTER(i64)]
    return lib


_SEP = b"\0" * 8  # between decoded parts: a part's rows keep their offsets within it


def _native_parts(lib: ctypes.CDLL, data: bytes) -> tuple[np.ndarray, list[bytes]]:
    """`_text_parts` by `text_scan.c`: each kind's parts come back already joined by `_SEP`."""
    buf = np.frombuffer(data, np.uint8)
    n, src = len(buf), buf.ctypes.data if len(buf) else None
    size, count = ctypes.c_int64(), ctypes.c_int64()
    nums = np.empty(lib.lens_text_numbers(src, n, None, ctypes.byref(size), ctypes.byref(count)), np.float64)
    failed = ctypes.c_int.in_dll(lib, "lens_alloc_failed")
    failed.value = 0
    lib.lens_text_numbers(src, n, nums.ctypes.data, ctypes.byref(size), ctypes.byref(count))
    if failed.value:
        raise MemoryError("text_scan.c: no memory for a long number's text")
    runs = np.empty(size.value, np.uint8)
    if count.value:
        lib.lens_text_runs(src, n, runs.ctypes.data)
    groups = []
    for fn in (lib.lens_base64_parts, lib.lens_hex_parts):
        out = np.empty(fn(src, n, None, ctypes.byref(count)), np.uint8)
        if count.value:
            fn(src, n, out.ctypes.data, ctypes.byref(count))
            groups.append(out.tobytes())
    if runs.size:
        groups.append(runs.tobytes())
    return nums, groups


def _text_parts(data: bytes, suffix: str) -> tuple[np.ndarray, bytes]:
    """(numbers written as text, as float64; every decoded part and small-integer run joined by `_SEP`):
    what `scan_data_many` scans besides the raw bytes. Native when `text_scan.c` builds; the regular
    expressions otherwise (the same numbers bit for bit and the same joined bytes)."""
    lib = _text_lib()
    if lib is None:
        nums, runs = _text_numbers(data)
        return np.asarray(nums, np.float64), _SEP.join([*_decoded(data, suffix), *runs])
    nums, groups = _native_parts(lib, data)
    return nums, _SEP.join([*_containers(data, suffix), *groups])


def scan_file(path: Path, index: PrivateIndex) -> dict[str, int]:
    """Hits per class in a file, its decoded contents and its text-encoded numbers."""
    return scan_data(Path(path).read_bytes(), Path(path).suffix.lower(), index)


def scan_data(data: bytes, suffix: str, index: PrivateIndex) -> dict[str, int]:
    """Hits per class in `data` (a file's bytes, `suffix` its lower-case extension), its decoded contents and text numbers."""
    return scan_data_many(data, suffix, {"": index})[""]


def scan_data_many(data: bytes, suffix: str, indexes: Mapping[str, PrivateIndex],
                   bitmap: np.ndarray | None = None) -> dict[str, dict[str, int]]:
    """`scan_data` against several sites' indexes: the file is decoded and its text numbers parsed once
    (the parsing, not the lookups, is most of a scan's time), and the decoded parts are scanned as one
    buffer (joined by 8 zero bytes, so a part's rows keep their offsets within it). `bitmap`: the
    indexes' `union_bitmap`, when the caller scans many files against them."""
    nums, joined = _text_parts(data, suffix)
    bitmap = union_bitmap(indexes) if bitmap is None and indexes else bitmap
    found = scan_many(data, indexes, nums, bitmap)
    for site, hits in scan_many(joined, indexes, bitmap=bitmap).items():
        for k, v in hits.items():
            found[site][k] += v
    return found


def scan_blobs(blobs: Iterable[tuple[str, bytes]], indexes: Mapping[str, PrivateIndex]) -> dict[str, dict[str, int]]:
    """Objects (name, bytes) in which any site's private content occurs: "name (site)" → hits per class.

    For trees that are not local files, e.g. the exchange's run tree (`Exchange.walk`); each blob is
    read and parsed once and scanned against every index.
    """
    found = {}
    bitmap = union_bitmap(indexes) if indexes else None
    for name, data in blobs:
        for site, hits in sorted(scan_data_many(data, Path(name).suffix.lower(), indexes, bitmap).items()):
            if any(hits.values()):
                found[f"{name} ({site})"] = hits
    return found


def scan_paths_many(paths: Iterable[Path], indexes: Mapping[str, PrivateIndex]) -> dict[str, dict[str, int]]:
    """Files (recursively under each path) in which any site's private content occurs: "file (site)" → hits."""
    files = []
    for root in map(Path, paths):
        files += [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    return scan_blobs(((str(f), f.read_bytes()) for f in files), indexes)


def scan_paths(paths: Iterable[Path], index: PrivateIndex) -> dict[str, dict[str, int]]:
    """Files (recursively under each path) in which private content occurs, with hits per class."""
    found = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        for f in files:
            hits = scan_file(f, index)
            if any(hits.values()):
                found[str(f)] = hits
    return found

