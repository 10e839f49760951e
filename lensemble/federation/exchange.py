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
    <run>/round-<r>/done.json               coordinator → sites: the round is committed (or abandoned)

Only public or protected material is ever written here; what a site writes passes its residency
guard first. A local folder is the default; `memory://` works within one process, and `s3://`,
`gcs://` etc. work with their fsspec packages installed.
"""
from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import fsspec
import torch

from lensemble.errors import ConfigError, ParticipantDropped

POLL_SECONDS = 0.05


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
        """Write `data` at `rel` (temporary name, then move); returns its length."""
        path = self._path(rel)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as fh:
            fh.write(data)
        self.fs.mv(tmp, path)
        return len(data)

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


def pack_tensors(obj: object) -> bytes:
    """torch.save to bytes (tensors, dicts, lists and scalars only: read back with weights_only)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack_tensors(blob: bytes) -> object:
    return torch.load(io.BytesIO(blob), weights_only=True)


def pack_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def round_prefix(run_id: str, round_idx: int) -> str:
    return f"{run_id}/round-{round_idx}"


def attempt_prefix(run_id: str, round_idx: int, attempt: int) -> str:
    return f"{round_prefix(run_id, round_idx)}/a{attempt}"
