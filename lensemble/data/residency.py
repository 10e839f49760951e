"""INV-RESIDENCY: the one boundary every object leaving a site passes, fail-closed.

`ResidencyGuard.release(kind, obj)` returns `obj` unchanged if it is on the allow-list and raises
`ResidencyViolation` otherwise, writing nothing but one line of the site's audit log:

- "update": a plain dict name → fp32 CPU-layout tensor whose names and shapes equal the declared
  federated spec exactly; no action-head names (INV-ACTIONHEAD-LOCAL), finite values, and not
  values laid out on an 8-bit pixel grid (frames copied into a parameter).
- "payload": `bytes` from a transport: not a pickle or a known container (zip/torch, npy, image,
  gzip, parquet), of the declared size when given and at most 8 bytes per federated parameter.
- "public_probe_embedding": the pooled embedding of the public probe P, exactly [|P|, D] fp32.
- "metrics" / "manifest" / "log": plain dicts and lists with str keys and scalar leaves (bool, int,
  float, None, short str such as names and hashes). Tensors, arrays (0-d included), bytes, sets,
  dataclasses, generators and any other object are refused wherever they hide; metrics lists are
  short and flat, manifest and log lists carry at most `MAX_NUMBERS_PER_LIST` numbers; strings
  are short and hold no long base64/hex run.

With a private-content index (`lensemble.data.audit.PrivateIndex`, built from the site's episodes
and optionally its action head) every released object is also scanned for the site's private rows:
tensor and payload bytes at every byte offset, numbers in metrics as consecutive float32 pairs,
strings as bytes and as decoded base64/hex. A hit is a refusal.

Audit records hold the decision, a sha256 of what was released, counts and the index's digest;
refusal reasons name parameters by the federated spec's own names and never echo values or
untrusted strings.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import math
import pickletools
import re
import struct
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from lensemble.data.audit import PrivateIndex
from lensemble.errors import ResidencyViolation
from lensemble.model.world_model import FEDERATED_PREFIXES

MAX_STR = 256  # chars of one string leaf (names, hashes, short reasons)
MAX_KEY = 128  # chars of one dict key
MAX_BLOB_RUN = 88  # chars of one base64/hex run in a string: a sha512 in base64, nothing longer
MAX_METRIC_LIST = 16  # items of one list in metrics (per-step losses of a short run, a band)
MAX_LIST = 4096  # items of one list in manifests and logs
MAX_NUMBERS_PER_LIST = 64  # numbers in one manifest/log list: more is a data row, not a summary
MAX_DEPTH = 8
MAX_LEAVES = 50_000
PIXEL_GRID_SHARE = 0.9  # share of nonzero update values on an 8-bit pixel grid that means "frames"
LOCAL_PREFIXES = ("action_heads.",)
CONTAINER_MAGIC = {
    b"PK\x03\x04": "a zip archive (torch.save)",
    b"\x93NUMPY": "a numpy .npy array",
    b"\x89PNG": "a PNG image",
    b"\xff\xd8\xff": "a JPEG image",
    b"\x1f\x8b": "gzip data",
    b"PAR1": "a Parquet file",
}
KINDS = ("update", "payload", "public_probe_embedding", "metrics", "manifest", "log")
_SAFE_KEY = re.compile(r"^(?=.*[A-Za-z])[A-Za-z0-9_./:\-]{1,64}$")
_BLOB_RUN = re.compile(r"[A-Za-z0-9+/=_\-]{%d,}" % (MAX_BLOB_RUN + 1))
_B64_RUN = re.compile(rb"[A-Za-z0-9+/]{11,}={0,2}")  # 11: one 8-byte row
_HEX_RUN = re.compile(rb"(?:[0-9a-fA-F]{2}){8,}")
_SCALARS = (bool, int, float, str, type(None))
_NUMPY_SCALARS = (np.bool_, np.integer, np.floating)


def _show(key: object) -> str:
    """A key as it may appear in an error or the audit log: code-like names, else a hash."""
    if isinstance(key, str) and _SAFE_KEY.match(key):
        return key
    return "<key#" + hashlib.sha256(repr(key).encode()).hexdigest()[:8] + ">"


def looks_like_pickle(blob: bytes) -> bool:
    """Whether `blob` starts with a complete pickle (opcodes from offset 0 up to STOP)."""
    try:
        for op, _, _ in pickletools.genops(blob):
            if op.name == "STOP":
                return True
    except (ValueError, EOFError, IndexError, UnicodeDecodeError, struct.error):
        return False
    return False


def on_pixel_grid(values: torch.Tensor) -> bool:
    """Whether most nonzero values are 8-bit pixels: integers 0..255, k/255 or k/127.5 - 1."""
    v = values.detach().cpu().reshape(-1).numpy()
    v = v[v != 0].astype(np.float64)
    if v.size < 64:
        return False
    for scaled, lo in ((v, 1.0), (v * 255.0, 1.0), ((v + 1.0) * 127.5, 0.0)):
        near = np.abs(scaled - np.rint(scaled)) < 1e-3
        if np.count_nonzero(near & (scaled >= lo - 1e-3) & (scaled <= 255.0 + 1e-3)) >= PIXEL_GRID_SHARE * v.size:
            return True
    return False


class ResidencyGuard:
    """The boundary of one site. See the module docstring for what passes."""

    def __init__(
        self,
        site: str,
        spec: tuple[tuple[str, tuple[int, ...]], ...] | None,
        audit_path: Path | None,
        probe_rows: int | None = None,
        *,
        private: PrivateIndex | None = None,
        max_payload_bytes: int | None = None,
    ) -> None:
        self.site = site
        self.probe_rows = probe_rows
        self.spec = dict(spec) if spec is not None else None
        self.audit_path = Path(audit_path) if audit_path is not None else None
        self.private = private
        numel = sum(math.prod(s) for s in self.spec.values()) if self.spec else 0
        self.max_payload_bytes = max_payload_bytes if max_payload_bytes is not None else (8 * numel + (1 << 20) if self.spec else None)
        self._scanned = 0

    # ---- audit ----

    def _audit(self, kind: str, decision: str, digest: str, size: int, items: int, reason: str = "") -> None:
        if self.audit_path is None:
            return
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        rec = {"t": time.time(), "site": self.site, "kind": kind, "decision": decision, "sha256": digest, "size": size,
               "items": items, "scanned_bytes": self._scanned, "index": self.private.digest()[:16] if self.private is not None else None,
               "reason": reason}
        with self.audit_path.open("a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")

    def _refuse(self, kind: str, reason: str):
        self._audit(kind, "refused", "", 0, 0, reason)
        raise ResidencyViolation(f"site {self.site!r}: refused {kind}: {reason}")

    def _scan(self, kind: str, what: str, blob) -> None:
        if self.private is None:
            return
        self._scanned += blob.nbytes if isinstance(blob, np.ndarray) else len(blob)
        hits = self.private.scan(blob)
        if any(hits.values()):
            self._refuse(kind, f"{what} carries the site's private rows ({hits['values']} value pairs, {hits['frames']} frames)")

    # ---- the boundary ----

    def release(self, kind: str, obj: object, *, expected_size: int | None = None) -> object:
        """Return `obj` unchanged if it may leave the site; otherwise ResidencyViolation.

        `expected_size`: for a payload, the byte length the transport declares for it.
        """
        self._scanned = 0
        if kind == "update":
            digest, size, items = self._check_update(obj)
        elif kind == "payload":
            digest, size, items = self._check_payload(obj, expected_size)
        elif kind == "public_probe_embedding":
            digest, size, items = self._check_probe_embedding(obj)
        elif kind in ("metrics", "manifest", "log"):
            numbers: list[float] = []
            items = self._check_plain(kind, obj, kind, 0, numbers)
            if self.private is not None and self.private.scan_floats(numbers):
                self._refuse(kind, "its numbers carry the site's private rows")
            blob = json.dumps(obj, sort_keys=True, default=str).encode()
            digest, size = hashlib.sha256(blob).hexdigest(), len(blob)
        else:
            self._refuse("unknown", f"unknown kind {_show(kind)}; allowed: {', '.join(KINDS)}")
        self._audit(kind, "released", digest, size, items)
        return obj

    def _check_update(self, obj: object) -> tuple[str, int, int]:
        kind = "update"
        if self.spec is None:
            self._refuse(kind, "no federated spec declared for this site")
        declared_local = [n for n in self.spec if n.startswith(LOCAL_PREFIXES) or not n.startswith(FEDERATED_PREFIXES)]
        if declared_local:
            self._refuse(kind, f"the declared spec holds {len(declared_local)} non-federated parameters (e.g. {_show(declared_local[0])}); action heads stay local")
        if type(obj) not in (dict, OrderedDict):
            self._refuse(kind, f"an update must be a plain dict of tensors, got {type(obj).__name__}")
        names = list(obj)
        if not all(type(n) is str for n in names):
            self._refuse(kind, "an update has a non-string name")
        local = [n for n in names if n.startswith(LOCAL_PREFIXES)]
        if local:
            self._refuse(kind, f"{len(local)} action-head parameters (e.g. {_show(local[0])}) never leave the site")
        extra, missing = sorted(set(names) - set(self.spec)), sorted(set(self.spec) - set(names))
        if extra or missing:
            shown = f"; missing {missing[:3]}" if missing else ""
            self._refuse(kind, f"names differ from the federated spec: {len(extra)} extra ({', '.join(_show(n) for n in extra[:3])}), {len(missing)} missing{shown}")
        h = hashlib.sha256()
        raws = []
        for name in sorted(names):
            t = obj[name]
            if type(t) is not torch.Tensor or t.layout != torch.strided or t.dtype != torch.float32:
                self._refuse(kind, f"{name} must be a plain dense fp32 tensor, got {type(t).__name__}{'' if not isinstance(t, torch.Tensor) else f' {t.dtype} {t.layout}'}")
            if tuple(t.shape) != tuple(self.spec[name]):
                self._refuse(kind, f"{name} has shape {tuple(t.shape)}, declared {tuple(self.spec[name])}")
            t = t.detach().cpu().contiguous()
            if not torch.isfinite(t).all():
                self._refuse(kind, f"{name} holds NaN or Inf")
            if on_pixel_grid(t):
                self._refuse(kind, f"{name} holds values on an 8-bit pixel grid (image data), not a parameter delta")
            raw = t.numpy().tobytes()
            h.update(name.encode() + b"\0" + raw)
            raws.append(raw)
        blob = b"".join(raws)  # one scan of the whole update: per-tensor scans cost 4x more in overhead
        if self.private is not None and any(self.private.scan(blob).values()):
            for name, raw in zip(sorted(names), raws):  # the refusal path only: name the tensor
                self._scan(kind, name, raw)
            self._refuse(kind, "the update carries the site's private rows across tensor boundaries")
        self._scanned = len(blob) if self.private is not None else 0
        return h.hexdigest(), len(blob), len(names)

    def _check_payload(self, obj: object, expected_size: int | None) -> tuple[str, int, int]:
        kind = "payload"
        if type(obj) is not bytes:
            self._refuse(kind, f"a payload must be bytes, got {type(obj).__name__}")
        if expected_size is not None and len(obj) != expected_size:
            self._refuse(kind, f"{len(obj)} bytes, the transport declares {expected_size}")
        if self.max_payload_bytes is not None and len(obj) > self.max_payload_bytes:
            self._refuse(kind, f"{len(obj)} bytes exceed {self.max_payload_bytes} (8 bytes per federated parameter + 1 MiB)")
        for magic, what in CONTAINER_MAGIC.items():
            if obj.startswith(magic):
                self._refuse(kind, f"the payload is {what}")
        if looks_like_pickle(obj):
            self._refuse(kind, "the payload is a pickle")
        self._scan(kind, "the payload", obj)
        return hashlib.sha256(obj).hexdigest(), len(obj), 1

    def _check_probe_embedding(self, obj: object) -> tuple[str, int, int]:
        """Pooled embeddings of the PUBLIC probe only: [probe_rows, D] fp32, nothing else."""
        kind = "public_probe_embedding"
        if self.probe_rows is None:
            self._refuse(kind, "no public probe size declared for this site")
        if type(obj) is not torch.Tensor or obj.dtype != torch.float32 or obj.layout != torch.strided or obj.dim() != 2 or obj.shape[0] != self.probe_rows:
            shape = tuple(obj.shape) if isinstance(obj, torch.Tensor) else type(obj).__name__
            self._refuse(kind, f"expected [{self.probe_rows}, D] fp32 embeddings of the public probe, got {shape}")
        raw = obj.detach().cpu().contiguous().numpy().view(np.uint8).reshape(-1)
        self._scan(kind, "the probe embedding", raw)
        return hashlib.sha256(raw.tobytes()).hexdigest(), raw.size, 1

    def _check_plain(self, kind: str, obj: object, path: str, depth: int, numbers: list[float]) -> int:
        """Leaves under `obj` (ResidencyViolation for anything off the allow-list); numbers collected in order."""
        if depth > MAX_DEPTH:
            self._refuse(kind, f"{path} nests deeper than {MAX_DEPTH}")
        t = type(obj)
        if t in _SCALARS or isinstance(obj, _NUMPY_SCALARS):
            if t is str:
                self._check_str(kind, obj, path)
            elif t is not bool and obj is not None and not isinstance(obj, np.bool_) and abs(obj) < 1e300:
                numbers.append(float(obj))
            return 1
        if t is dict:
            leaves = 0
            for k, v in obj.items():
                if type(k) is not str or len(k) > MAX_KEY:
                    self._refuse(kind, f"{path} has a key {_show(k)} that is not a string of <= {MAX_KEY} chars")
                self._check_str(kind, k, f"{path} key")
                leaves += self._check_plain(kind, v, f"{path}.{_show(k)}", depth + 1, numbers)
                if leaves > MAX_LEAVES:
                    self._refuse(kind, f"{path} holds more than {MAX_LEAVES} values")
            return leaves
        if t in (list, tuple):
            limit = MAX_METRIC_LIST if kind == "metrics" else MAX_LIST
            if len(obj) > limit:
                self._refuse(kind, f"{path} is a list of {len(obj)} items (max {limit} in {kind})")
            nums = sum(1 for v in obj if type(v) in (int, float) or isinstance(v, (np.integer, np.floating)))
            if kind != "metrics" and nums > MAX_NUMBERS_PER_LIST:
                self._refuse(kind, f"{path} is a list of {nums} numbers (max {MAX_NUMBERS_PER_LIST}): a data row, not a summary")
            leaves = 0
            for i, v in enumerate(obj):
                if kind == "metrics" and type(v) in (list, tuple, dict):
                    self._refuse(kind, f"{path}[{i}] nests a container in metrics")
                leaves += self._check_plain(kind, v, f"{path}[{i}]", depth + 1, numbers)
            return leaves
        what = "a dataclass" if dataclasses.is_dataclass(obj) else f"a {t.__name__}"
        self._refuse(kind, f"{path} is {what}; only scalars, short strings and plain dicts/lists of them leave a site")

    def _check_str(self, kind: str, s: str, path: str) -> None:
        if len(s) > MAX_STR:
            self._refuse(kind, f"{path} is a string of {len(s)} chars (max {MAX_STR})")
        if _BLOB_RUN.search(s):
            self._refuse(kind, f"{path} holds an encoded blob (a base64/hex run longer than {MAX_BLOB_RUN} chars)")
        if self.private is None:
            return
        raw = s.encode("utf-8", "surrogatepass")
        self._scan(kind, path, raw)
        for m in _B64_RUN.finditer(raw):
            try:
                self._scan(kind, path, base64.b64decode(m.group() + b"=" * (-len(m.group()) % 4)))
            except (binascii.Error, ValueError):
                pass
        for m in _HEX_RUN.finditer(raw):
            self._scan(kind, path, bytes.fromhex(m.group().decode()))
