"""INV-RESIDENCY: the one boundary every object leaving a site passes, fail-closed.

`release(site, kind, obj)` admits only an allow-list and raises `ResidencyViolation` for everything
else, writing nothing:
- kind "update": a mapping name → tensor whose names and shapes equal the declared federated spec
  exactly (no action-head names), finite, fp32.
- kind "payload": bytes produced by a transport for this site's update (length checked against the
  transport's declared size when given).
- kind "public_probe_embedding": pooled embeddings of the public probe P, exactly [|P|, D].
- kind "metrics" / "manifest" / "log": nested dicts and lists of str keys with scalar leaves
  (bool, int, float, short str such as hashes and names). Tensors, arrays, bytes and arbitrary
  objects are refused wherever they hide.
Every decision is appended to the site's audit log as counts and hashes only.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from lensemble.errors import ResidencyViolation

MAX_STR = 256


class ResidencyGuard:
    """The boundary of one site."""

    def __init__(self, site: str, spec: tuple[tuple[str, tuple[int, ...]], ...] | None, audit_path: Path | None, probe_rows: int | None = None) -> None:
        self.site = site
        self.probe_rows = probe_rows
        self.spec = dict(spec) if spec is not None else None
        self.audit_path = audit_path

    def _audit(self, kind: str, decision: str, digest: str, size: int, reason: str = "") -> None:
        if self.audit_path is None:
            return
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        rec = {"t": time.time(), "site": self.site, "kind": kind, "decision": decision, "sha256": digest, "size": size, "reason": reason}
        with self.audit_path.open("a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")

    def _refuse(self, kind: str, reason: str) -> None:
        self._audit(kind, "refused", "", 0, reason)
        raise ResidencyViolation(f"site {self.site!r}: refused {kind}: {reason}")

    def release(self, kind: str, obj: object) -> object:
        """Return `obj` unchanged if it may leave the site; otherwise ResidencyViolation."""
        if kind == "update":
            digest, size = self._check_update(obj)
        elif kind == "payload":
            if not isinstance(obj, bytes):
                self._refuse(kind, f"a payload must be bytes, got {type(obj).__name__}")
            digest, size = hashlib.sha256(obj).hexdigest(), len(obj)
        elif kind == "public_probe_embedding":
            digest, size = self._check_probe_embedding(obj)
        elif kind in ("metrics", "manifest", "log"):
            self._check_plain(kind, obj, kind)
            blob = json.dumps(obj, sort_keys=True).encode()
            digest, size = hashlib.sha256(blob).hexdigest(), len(blob)
        else:
            self._refuse(kind, f"unknown kind {kind!r}; allowed: update, payload, metrics, manifest, log")
        self._audit(kind, "released", digest, size)
        return obj

    def _check_update(self, obj: object) -> tuple[str, int]:
        if self.spec is None:
            self._refuse("update", "no federated spec declared for this site")
        if not isinstance(obj, Mapping):
            self._refuse("update", f"an update must be a mapping of tensors, got {type(obj).__name__}")
        if set(obj) != set(self.spec):
            extra = sorted(set(obj) - set(self.spec))[:3]
            self._refuse("update", f"names differ from the federated spec (extra {extra})")
        h = hashlib.sha256()
        size = 0
        for name in sorted(obj):
            t = obj[name]
            if type(t) is not torch.Tensor or t.dtype != torch.float32:
                self._refuse("update", f"{name} must be a plain fp32 tensor")
            if tuple(t.shape) != tuple(self.spec[name]):
                self._refuse("update", f"{name} has shape {tuple(t.shape)}, declared {tuple(self.spec[name])}")
            if not torch.isfinite(t).all():
                self._refuse("update", f"{name} holds NaN or Inf")
            h.update(t.contiguous().numpy().tobytes())
            size += t.numel() * 4
        return h.hexdigest(), size

    def _check_probe_embedding(self, obj: object) -> tuple[str, int]:
        """Pooled embeddings of the PUBLIC probe only: [probe_rows, D] fp32, nothing else."""
        if self.probe_rows is None:
            self._refuse("public_probe_embedding", "no public probe size declared for this site")
        if type(obj) is not torch.Tensor or obj.dtype != torch.float32 or obj.dim() != 2 or obj.shape[0] != self.probe_rows:
            shape = tuple(obj.shape) if isinstance(obj, torch.Tensor) else type(obj).__name__
            self._refuse("public_probe_embedding", f"expected [{self.probe_rows}, D] fp32 embeddings of the public probe, got {shape}")
        return hashlib.sha256(obj.contiguous().numpy().tobytes()).hexdigest(), obj.numel() * 4

    def _check_plain(self, kind: str, obj: object, path: str) -> None:
        if isinstance(obj, bool) or obj is None:
            return
        if isinstance(obj, int):
            return
        if isinstance(obj, float):
            if not math.isfinite(obj):
                return  # NaN/Inf losses are scalars; the metrics sink records them as they are
            return
        if isinstance(obj, str):
            if len(obj) > MAX_STR:
                self._refuse(kind, f"{path} is a string of {len(obj)} chars (max {MAX_STR})")
            return
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                if not isinstance(k, str):
                    self._refuse(kind, f"{path} has a non-string key")
                self._check_plain(kind, v, f"{path}.{k}")
            return
        if isinstance(obj, (list, tuple)):
            if len(obj) > 4096:
                self._refuse(kind, f"{path} is a list of {len(obj)} items")
            for i, v in enumerate(obj):
                if isinstance(v, (list, tuple, Mapping)) and kind == "metrics":
                    self._refuse(kind, f"{path}[{i}] nests a container in metrics")
                self._check_plain(kind, v, f"{path}[{i}]")
            return
        self._refuse(kind, f"{path} is a {type(obj).__name__}; only scalars, short strings and containers of them leave a site")
