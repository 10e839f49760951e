"""The exchange: where a coordinator and sovereign sites swap one round's messages, over any fsspec URL.

A message is an immutable blob at a relative name, written once (to a temporary name, then moved,
so a reader never sees half of it) and polled for by the other side with a deadline. The layout of
one federation run (`<run>` is the params hash prefix the coordinator uses as its run id):

    keys/<site>.pub                         site → all: Ed25519 public key (enrolment, trust on first use)
    <run>/round-<r>/global.pt               coordinator → sites: global parameters and probe embedding
    <run>/round-<r>/<site>/train.pt         site → coordinator: metrics + public-probe embedding (guarded)
    <run>/round-<r>/a<k>/open.json          coordinator → sites: attempt k's invited sites
    <run>/round-<r>/a<k>/<site>.key         site → coordinator: key share
    <run>/round-<r>/a<k>/roster.pt          coordinator → sites: every accepted key share
    <run>/round-<r>/a<k>/<site>.ann         site → coordinator: announcement
    <run>/round-<r>/a<k>/grid.bin           coordinator → sites: the agreed grid
    <run>/round-<r>/a<k>/<site>.upd         site → coordinator: the encoded update
    <run>/round-<r>/a<k>/<site>.enc_seconds site → coordinator: the update's encode time, a decimal number
    <run>/round-<r>/done.json               coordinator → sites: the round is committed (or abandoned)
    .probe-<32 hex>                         `Exchange.check`'s probe blob (deleted at once)

A site's public key may also be named by its pinned fingerprint: keys/<site>-<hex>.pub.

INV-TYPED-RELEASE, "exchange object name": `put` writes only names of this grammar (`OBJECT_NAME`:
<site> and <run> are 1..64 of [A-Za-z0-9_-] starting alphanumeric, <r> and <k> decimal without
leading zeros), and an `.enc_seconds` body must be a decimal number of <= 32 chars; anything else is
a `ResidencyViolation` naming the channel, and nothing is written. Objects are write-once: a `put`
at an existing name passes only if the bytes are identical (an idempotent retry), and a different
blob is a `ResidencyViolation` (a replaced message would be an equivocation; the round driver's
clean slate for a redone round is `remove_tree`). On a local folder the final move is an atomic
hard link, which fails if the name exists; on other backends existence is checked just before the
move (best effort: object stores have no create-if-absent in fsspec).

Only public or protected material is ever written here; what a site writes passes its residency
guard first. A local folder is the default; `memory://` works within one process, and `s3://`,
`gcs://` etc. work with their fsspec packages installed.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import fsspec
import torch

from lensemble.errors import ConfigError, ParticipantDropped, ResidencyViolation

POLL_SECONDS = 0.05
_ID = r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}"
_INT = r"(?:0|[1-9][0-9]{0,5})"
OBJECT_NAME = re.compile(
    rf"keys/{_ID}(?:-[0-9a-f]{{8,64}})?\.pub"
    rf"|{_ID}/round-{_INT}/(?:global\.pt|done\.json|{_ID}/train\.pt"
    rf"|a{_INT}/(?:open\.json|roster\.pt|grid\.bin|{_ID}\.(?:key|ann|upd|enc_seconds)))"
    r"|\.probe-[0-9a-f]{32}"
)
_DECIMAL = re.compile(rb"-?[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?")
CHANNEL = "exchange object name"


def _shown(rel: object) -> str:
    """An object name as an error may show it: a name of the layout, else (untrusted: it may carry data) a hash."""
    if isinstance(rel, str) and OBJECT_NAME.fullmatch(rel):
        return repr(rel)
    return "<name#" + hashlib.sha256(repr(rel).encode()).hexdigest()[:8] + ">"


def check_object(rel: str, data: bytes) -> None:
    """ResidencyViolation naming the channel unless `rel` is a name of the grammar and `data` bytes of its type."""
    if type(rel) is not str or not OBJECT_NAME.fullmatch(rel):
        raise ResidencyViolation(f"refused {CHANNEL}: {_shown(rel)} is not a name of the exchange layout")
    if type(data) is not bytes:
        raise ResidencyViolation(f"refused {CHANNEL}: {_shown(rel)}: the body must be bytes, got {type(data).__name__}")
    if rel.endswith(".enc_seconds") and not (len(data) <= 32 and _DECIMAL.fullmatch(data)):
        raise ResidencyViolation(f"refused {CHANNEL}: {_shown(rel)}: the body must be a decimal number of <= 32 chars")


def exchange_url(spec: str, root: Path) -> str:
    """A params `federate.exchange` value as a URL: a plain path is a folder under the project root."""
    if "://" in spec:
        return spec
    path = Path(spec)
    return (path if path.is_absolute() else Path(root).resolve() / path).as_uri()


class Exchange:
    """Write-once blobs under one fsspec URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self.fs, self.base = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"federate.exchange {url!r} cannot be used: {exc}") from None

    def _path(self, rel: str) -> str:
        return f"{self.base.rstrip('/')}/{rel}"

    def check(self) -> None:
        """Write, read back and delete a probe blob; ConfigError naming the URL if any step fails."""
        rel = f".probe-{uuid.uuid4().hex}"
        try:
            self.put(rel, b"lensemble")
            ok = self.get(rel) == b"lensemble"
            self.fs.rm(self._path(rel))
        except Exception as exc:  # any backend error means the exchange is not usable
            raise ConfigError(f"federate.exchange {self.url!r} cannot be reached: {type(exc).__name__}: {exc}") from None
        if not ok:
            raise ConfigError(f"federate.exchange {self.url!r} did not return what was written to it")

    def put(self, rel: str, data: bytes) -> int:
        """Write `data` once at `rel` (temporary name, then move); returns its length.

        ResidencyViolation ("exchange object name") for a name off the layout, or for an existing
        object that holds other bytes; the same bytes again are a no-op (an idempotent retry).
        """
        check_object(rel, data)
        path = self._path(rel)
        if self._same_or_refuse(rel, data):
            return len(data)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as fh:
            fh.write(data)
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        if "file" in protocols:
            try:
                os.link(tmp, path)  # atomic create-if-absent: a concurrent writer cannot be overwritten
            except FileExistsError:
                self.fs.rm(tmp)
                if not self._same_or_refuse(rel, data):
                    raise
                return len(data)
            self.fs.rm(tmp)
        else:
            if self._same_or_refuse(rel, data):
                self.fs.rm(tmp)
                return len(data)
            self.fs.mv(tmp, path)
        return len(data)

    def _same_or_refuse(self, rel: str, data: bytes) -> bool:
        """True if `rel` already holds exactly `data`; False if it does not exist; else ResidencyViolation."""
        old = self.get(rel)
        if old is None:
            return False
        if old != data:
            raise ResidencyViolation(f"refused {CHANNEL}: {_shown(rel)} exists with other bytes; exchange objects are write-once")
        return True

    def walk(self, rel: str) -> Iterator[tuple[str, bytes]]:
        """(name relative to the exchange, bytes) of every object under `rel`, in name order."""
        root = self._path(rel)
        if not self.fs.exists(root):
            return
        base = self.base.strip("/") + "/"
        for path in sorted(self.fs.find(root)):
            with self.fs.open(path, "rb") as fh:
                yield path.lstrip("/").removeprefix(base), fh.read()

    def get(self, rel: str) -> bytes | None:
        """The blob at `rel`, or None while it is not there."""
        try:
            with self.fs.open(self._path(rel), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._path(rel))

    def first(self, rels: Sequence[str], deadline: float, what: str) -> tuple[str, bytes]:
        """The first of `rels` that appears (earlier names win on a tie); ParticipantDropped at `deadline`."""
        while True:
            for rel in rels:
                blob = self.get(rel)
                if blob is not None:
                    return rel, blob
            if time.monotonic() >= deadline:
                raise ParticipantDropped(f"{what}: nothing at {list(rels)} in {self.url} before the deadline")
            time.sleep(POLL_SECONDS)

    def gather(self, rels: dict[str, str], deadline: float) -> dict[str, bytes]:
        """For each key, the blob at its name once it appears; keys still missing at `deadline` are left out."""
        got: dict[str, bytes] = {}
        while True:
            for key, rel in rels.items():
                if key not in got:
                    blob = self.get(rel)
                    if blob is not None:
                        got[key] = blob
            if len(got) == len(rels) or time.monotonic() >= deadline:
                return got
            time.sleep(POLL_SECONDS)

    def remove_tree(self, rel: str) -> None:
        """Delete everything under `rel` (a finished run's messages)."""
        if self.fs.exists(self._path(rel)):
            self.fs.rm(self._path(rel), recursive=True)


def _fresh(obj: object) -> object:
    """`obj` with every tensor replaced by a fresh contiguous clone (only its own elements in its storage)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(obj, dict):
        return {k: _fresh(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fresh(v) for v in obj) if type(obj) in (list, tuple) else obj
    return obj


def pack_tensors(obj: object) -> bytes:
    """torch.save to bytes (tensors, dicts, lists and scalars only: read back with weights_only).

    Every tensor is saved from a fresh contiguous clone: `torch.save` writes a tensor's whole backing
    storage, so a view of a larger tensor would otherwise carry the rest of it along.
    """
    buf = io.BytesIO()
    torch.save(_fresh(obj), buf)
    return buf.getvalue()


def unpack_tensors(blob: bytes) -> object:
    return torch.load(io.BytesIO(blob), weights_only=True)


def pack_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def round_prefix(run_id: str, round_idx: int) -> str:
    return f"{run_id}/round-{round_idx}"


def attempt_prefix(run_id: str, round_idx: int, attempt: int) -> str:
    return f"{round_prefix(run_id, round_idx)}/a{attempt}"
