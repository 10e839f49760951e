"""INV-RESIDENCY and INV-TYPED-RELEASE: the one boundary every object leaving a site passes, fail-closed.

`ResidencyGuard.release(channel, obj)` returns what may leave (see below) if `obj` matches the
channel's schema exactly, and raises `ResidencyViolation` naming the channel otherwise, writing
nothing but one line of the site's audit log. The schema of each channel:

- "update": a plain dict name → plain dense fp32 tensor whose names and shapes equal the declared
  federated spec exactly; no action-head names (INV-ACTIONHEAD-LOCAL); every value finite; the
  whole message (all tensors' values concatenated in name order) not on an 8-bit pixel grid (see
  `on_pixel_grid`). Returned unchanged.
- "payload": `bytes` from a transport: not a pickle or a known container (zip/torch, npy, image,
  gzip, parquet), of the declared size when given and at most 8 bytes per federated parameter
  + 1 MiB. Returned unchanged.
- "public_probe_embedding": the pooled embedding of the public probe P: a plain dense fp32 tensor
  of shape exactly [probe_rows, probe_dim] (|P| and the latent width d the site's model declares),
  finite, not on a pixel grid. Returned as a fresh contiguous clone, so no backing storage of a
  view rides along when it is serialized.
- "metrics": a plain dict, at most one entry per name, names from `METRIC_NAMES` (the canonical
  names of DESIGN.md §7 and those `tasks.train.site_train` releases); each value an int in the
  int32 range or a finite real number that is finite in fp32. No strings, bools, None, lists or
  nesting: no free text. Returned as a new dict whose floats are rounded to fp32 (Python floats
  holding fp32 values), so at most 32 bits per value leave; a float64 is released as its fp32
  value, never refused for precision alone.
- "manifest": a site's data manifest (`lensemble.data.episodes.data_manifest`), exactly the keys of
  `MANIFEST_FIELDS`: `embodiment` a lower-case name, `episodes` and `steps` int32 counts >= 0,
  `schema_hash`, `content_hash`, `file_sha256` lower-case hex digests of 16..64 chars.
- "log": one log record: a dict with `event` from `LOG_EVENTS` and optional `LOG_FIELDS` (each may
  be None): `run`/`stage` names, `round`/`attempt`/`step`/`bytes` int32 counts >= 0,
  `participant` the guard's own site, `name` a metric name, `value` a number as in metrics (fp32),
  `sha256` a hex digest.

Manifests and logs also pass the generic checks of plain data (`_check_plain`: str keys, short
strings without long base64/hex runs, no tensors, arrays, bytes, sets or objects anywhere).

With a private-content index (`lensemble.data.audit.PrivateIndex`, built from the site's episodes
and optionally its action head) every released message is also scanned as a whole for the site's
private rows: tensor and payload bytes at every byte offset (all tensors of an update as one
stream), numbers in metrics and logs as consecutive float32 pairs, strings as bytes and as decoded
base64/hex. A hit is a refusal.

Audit records hold the decision, a sha256 of what was released, counts and the index's digest;
refusal reasons name the channel and parameters by the federated spec's own names, and never echo
values or untrusted strings (an unknown name is shown as a hash).
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
MAX_LIST = 4096  # items of one list in manifests and logs
MAX_NUMBERS_PER_LIST = 64  # numbers in one manifest/log list: more is a data row, not a summary
MAX_DEPTH = 8
MAX_LEAVES = 50_000
PIXEL_GRID_SHARE = 0.9  # share of nonzero values of a message on an 8-bit pixel grid that means "frames"
PIXEL_TOL = 1e-4  # |scaled - integer| of a value on a pixel grid (fp32 rounding of k/255 or k/127.5 - 1 is ~1e-5)
PIXEL_RUN = 16  # consecutive nonzero values on one pixel grid: a pixel row, never chance (p ~ 1e-4 per value)
PIXEL_MIN_LEVELS = 4  # distinct grid levels among the on-grid values: fewer is a step size that happens to sit on the grid (2 AdamW steps at lr 0.002 land within 1e-6 of 1/255)
INT32 = 1 << 31
FP32_MAX = float(np.finfo(np.float32).max)
# Metric names a site may release: DESIGN.md §7's canonical names, plus what tasks.train.site_train
# (losses, gauge drift, round dynamics, timings) and lensemble.federation.dp release. Exact names only.
METRIC_NAMES = frozenset({
    "loss/pred", "loss/sigreg", "loss/anchor", "loss/proprio",
    "gauge/drift_angle_deg", "gauge/drift_angle_max_deg", "gauge/procrustes_residual", "gauge/reflection",
    "gauge/effective_dim",
    "fed/comm_bytes", "fed/quant_ratio", "fed/round_seconds", "fed/outer_step_seconds",
    "dp/update_norm", "dp/clipped", "dp/noise_std",
    "eval/success_rate", "eval/rollout_vs_copy", "eval/rollout_vs_copy_last", "eval/rollout_vs_copy_proprio",
    "eval/action_sensitivity", "eval/action_sensitivity_proprio", "eval/probe_r2",
    "steps", "train_seconds", "dynamics_seconds", "task_seconds",
})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")  # run ids, stage and site names
_EMBODIMENT = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_DIGEST = re.compile(r"^[0-9a-f]{16,64}$")
MANIFEST_FIELDS = {"embodiment": "embodiment", "episodes": "count", "steps": "count", "schema_hash": "digest",
                   "content_hash": "digest", "file_sha256": "digest"}
LOG_EVENTS = frozenset({"round-start", "round-done", "trained", "released", "refused", "key-share", "announce", "encode",
                        "dropped", "enrolled"})
LOG_FIELDS = {"event": "event", "run": "name", "stage": "name", "round": "count", "attempt": "count", "step": "count",
              "bytes": "count", "participant": "site", "name": "metric", "value": "number", "sha256": "digest"}
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


PICKLE_MIN_OPCODES = 5  # opcodes before STOP that make a protocol-0/1 pickle (one without a PROTO opcode)


def looks_like_pickle(blob: bytes) -> bool:
    """Whether `blob` starts with a complete pickle (opcodes from offset 0 up to STOP) that is one: it
    opens with PROTO 2..5 (every pickle of protocol >= 2), or has PICKLE_MIN_OPCODES opcodes before
    STOP (protocol 0/1 data: `[1.5, "x"]` is 8).

    Any complete pickle would refuse 0.5% of random blobs (a key share's random X25519 key that starts
    with b"." parses as an empty pickle): measured, 1,494 of 300,000 random 96-byte blobs, which dropped
    an honest site in a default run. With these two rules: 0 of 1,000,000.
    """
    opcodes = 0
    try:
        for op, _, _ in pickletools.genops(blob):
            if op.name == "STOP":
                return (blob[:1] == b"\x80" and 2 <= blob[1] <= 5) or opcodes >= PICKLE_MIN_OPCODES
            opcodes += 1
    except (ValueError, EOFError, IndexError, UnicodeDecodeError, struct.error):
        return False
    return False


def _pixel_row(pos: np.ndarray, levels: np.ndarray) -> bool:
    """Whether the on-grid positions `pos` (sorted) hold PIXEL_RUN consecutive ones whose `levels` take
    >= PIXEL_MIN_LEVELS values."""
    if pos.size < PIXEL_RUN:
        return False
    breaks = np.flatnonzero(np.diff(pos) != 1) + 1
    for start, end in zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [pos.size]))):
        if end - start >= PIXEL_RUN and np.unique(levels[start:end]).size >= PIXEL_MIN_LEVELS:
            return True
    return False


def on_pixel_grid(values) -> bool:
    """Whether a message's values (all its tensors, concatenated) carry 8-bit pixels.

    A nonzero value is on a grid when it is, within PIXEL_TOL, an integer 1..255, k/255 (k >= 1) or
    k/127.5 - 1 (0 <= k <= 255). The whole message is on the grid when, for one grid, (a) at least
    PIXEL_GRID_SHARE of its (>= 8) nonzero values are, on at least PIXEL_MIN_LEVELS distinct levels
    (frames copied into parameters, across any number of tensors), or (b) PIXEL_RUN consecutive nonzero
    values are, on at least PIXEL_MIN_LEVELS levels (a pixel row hidden among real deltas).
    Not tested: an excess of on-grid values over chance. AdamW moves many weights by the same few
    amounts (atoms such as ±3/255 after 50 steps at lr 0.002, measured on the default params), so a
    real update can have 8x the on-grid count a continuous distribution predicts; that test refused
    honest sites. Pixels broken into runs shorter than PIXEL_RUN among real values pass this test;
    the private-row scan is what catches copied content.
    """
    raw = values.detach().cpu().reshape(-1).numpy() if isinstance(values, torch.Tensor) else np.asarray(values).reshape(-1)
    raw = raw.astype(np.float32, copy=False)
    nonzero = np.flatnonzero(raw)
    if nonzero.size < 8:
        return False
    # One fp32 pass finds every value that can be on any grid: k/255 and k/127.5 - 1 put v * 255 within
    # 2 * PIXEL_TOL of an integer (fp32 adds < 3e-5 at 255), integers 1..255 have |v| >= 1 - PIXEL_TOL;
    # the grids are then tested exactly, in fp64, on those candidates only (~1e-3 of a real update).
    f = raw * np.float32(255.0)
    cand = np.flatnonzero(((np.abs(f - np.rint(f)) < 3 * PIXEL_TOL) | (np.abs(raw) >= 1.0 - PIXEL_TOL)) & (raw != 0))
    idx = np.searchsorted(nonzero, cand)  # positions among the nonzero values (zeros do not break a row)
    n, c = nonzero.size, raw[cand].astype(np.float64)
    for scaled, lo in ((c, 1.0), (c * 255.0, 1.0), ((c + 1.0) * 127.5, 0.0)):
        levels = np.rint(scaled)
        near = (np.abs(scaled - levels) < PIXEL_TOL) & (scaled >= lo - PIXEL_TOL) & (scaled <= 255.0 + PIXEL_TOL)
        hits = int(np.count_nonzero(near))
        if hits < PIXEL_RUN and hits < PIXEL_GRID_SHARE * n:
            continue
        if hits >= PIXEL_GRID_SHARE * n and np.unique(levels[near]).size >= PIXEL_MIN_LEVELS:
            return True
        if _pixel_row(idx[near], levels[near]):
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
        probe_dim: int | None = None,
        metric_names: frozenset[str] = METRIC_NAMES,
    ) -> None:
        """`probe_rows`, `probe_dim`: |P| and the latent width d of the site's model (`WorldModel.latent_dim`)."""
        self.site = site
        self.probe_rows, self.probe_dim = probe_rows, probe_dim
        self.metric_names = frozenset(metric_names)
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
        """What may leave the site of `obj` on channel `kind` (see the module docstring); otherwise ResidencyViolation.

        Updates and payloads come back unchanged, a probe embedding as a contiguous clone, metrics and
        logs as new dicts with fp32-rounded numbers. Callers send what this returns.
        `expected_size`: for a payload, the byte length the transport declares for it.
        """
        self._scanned = 0
        if kind == "update":
            digest, size, items = self._check_update(obj)
        elif kind == "payload":
            digest, size, items = self._check_payload(obj, expected_size)
        elif kind == "public_probe_embedding":
            obj, digest, size, items = self._check_probe_embedding(obj)
        elif kind in ("metrics", "manifest", "log"):
            if kind != "metrics":  # metrics are flat name → number: their schema alone is stricter
                self._check_plain(kind, obj, kind, 0, [])
            obj, numbers = self._check_record(kind, obj)
            items = len(obj)
            if self.private is not None and self.private.scan_floats(numbers):
                self._refuse(kind, "its numbers carry the site's private rows")
            blob = json.dumps(obj, sort_keys=True).encode()
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
            raw = t.numpy().tobytes()
            h.update(name.encode() + b"\0" + raw)
            raws.append(raw)
        blob = b"".join(raws)  # the whole message: one grid test and one scan (per-tensor scans cost 4x more in overhead)
        if on_pixel_grid(np.frombuffer(blob, np.float32)):
            self._refuse(kind, "its values (all tensors together) lie on an 8-bit pixel grid (image data), not a delta")
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

    def _check_probe_embedding(self, obj: object) -> tuple[torch.Tensor, str, int, int]:
        """Pooled embeddings of the PUBLIC probe only: [probe_rows, probe_dim] fp32, finite; a fresh contiguous clone."""
        kind = "public_probe_embedding"
        if self.probe_rows is None or self.probe_dim is None:
            self._refuse(kind, "no public probe size [|P|, d] declared for this site")
        want = (self.probe_rows, self.probe_dim)
        plain = type(obj) is torch.Tensor and obj.dtype == torch.float32 and obj.layout == torch.strided
        if not plain or tuple(obj.shape) != want:
            got = type(obj).__name__
            if isinstance(obj, torch.Tensor):
                got += f" {obj.dtype} {obj.layout} {tuple(obj.shape)}"
            self._refuse(kind, f"expected a plain {list(want)} fp32 tensor (|P| x latent width), got {got}")
        out = obj.detach().cpu().clone(memory_format=torch.contiguous_format)
        if not torch.isfinite(out).all():
            self._refuse(kind, "the probe embedding holds NaN or Inf")
        if on_pixel_grid(out):
            self._refuse(kind, "the probe embedding lies on an 8-bit pixel grid (image data)")
        raw = out.numpy().view(np.uint8).reshape(-1)
        self._scan(kind, "the probe embedding", raw)
        return out, hashlib.sha256(raw.tobytes()).hexdigest(), raw.size, 1

    # ---- record channels: metrics, manifest, log ----

    def _number(self, kind: str, path: str, v: object) -> int | float:
        """An int32 int as is, or a real number that is finite in fp32 as its fp32 value (a Python float)."""
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            self._refuse(kind, f"{path} must be a number, got {type(v).__name__}")
        if isinstance(v, (int, np.integer)):
            if not -INT32 <= int(v) < INT32:
                self._refuse(kind, f"{path} is an integer outside the int32 range")
            return int(v)
        x = float(v)
        if not math.isfinite(x) or abs(x) > FP32_MAX:
            self._refuse(kind, f"{path} is not a finite fp32 scalar (NaN, Inf or out of fp32 range)")
        return float(np.float32(x))

    def _field(self, kind: str, path: str, ftype: str, v: object) -> object:
        """One typed field of a manifest or log record."""
        if ftype == "number":
            return self._number(kind, path, v)
        if ftype == "count":
            if type(v) is not int and not isinstance(v, np.integer) or not 0 <= int(v) < INT32:
                self._refuse(kind, f"{path} must be an int32 count >= 0")
            return int(v)
        if type(v) is not str:
            self._refuse(kind, f"{path} must be a string ({ftype}), got {type(v).__name__}")
        ok = {"embodiment": _EMBODIMENT.match(v), "digest": _DIGEST.match(v), "name": _NAME.match(v), "site": v == self.site,
              "metric": v in self.metric_names, "event": v in LOG_EVENTS}[ftype]
        if not ok:
            self._refuse(kind, f"{path} is not a valid {ftype}")
        return v

    def _check_record(self, kind: str, obj: object) -> tuple[dict, list[float]]:
        """The record `obj` as released on channel `kind` (metrics, manifest or log), and its numbers in order."""
        if type(obj) is not dict:
            self._refuse(kind, f"a {kind} record must be a plain dict, got {type(obj).__name__}")
        if not all(type(k) is str for k in obj):
            self._refuse(kind, "a key is not a string")
        if kind == "metrics":
            unknown = [k for k in obj if k not in self.metric_names]
            if unknown:  # never echo an unknown name: it may itself carry data
                shown = hashlib.sha256(unknown[0].encode()).hexdigest()[:8]
                self._refuse(kind, f"{len(unknown)} names off the metric whitelist (e.g. <key#{shown}>)")
            out = {k: self._number(kind, k, v) for k, v in obj.items()}
        else:
            fields = MANIFEST_FIELDS if kind == "manifest" else LOG_FIELDS
            extra = [k for k in obj if k not in fields]
            if extra:
                self._refuse(kind, f"{len(extra)} fields off the {kind} schema (e.g. {_show(extra[0])});"
                                   f" allowed: {', '.join(fields)}")
            required = set(fields) if kind == "manifest" else {"event"}
            missing = sorted(required - set(obj))
            if missing:
                self._refuse(kind, f"missing fields {missing}")
            out = {k: None if v is None and k not in required else self._field(kind, k, fields[k], v) for k, v in obj.items()}
        return out, [float(v) for v in out.values() if type(v) in (int, float)]

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
            if len(obj) > MAX_LIST:
                self._refuse(kind, f"{path} is a list of {len(obj)} items (max {MAX_LIST} in {kind})")
            nums = sum(1 for v in obj if type(v) in (int, float) or isinstance(v, (np.integer, np.floating)))
            if nums > MAX_NUMBERS_PER_LIST:
                self._refuse(kind, f"{path} is a list of {nums} numbers (max {MAX_NUMBERS_PER_LIST}): a data row, not a summary")
            leaves = 0
            for i, v in enumerate(obj):
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
