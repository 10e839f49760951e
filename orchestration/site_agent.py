"""A sovereign site's side of one federation round, run where the site's data lives.

The coordinator publishes the round's global parameters to the exchange and triggers this at each
site (a deployment run on the site's own work pool, or a task for a one-machine trial). The site
trains H inner steps from them on its own episodes, keeps Δ_c and its local state at home, and
answers the secure-aggregation protocol through the exchange: key share, announcement, masked
update. Everything it writes passes its residency guard; its Ed25519 signing key never leaves it.

The site follows whatever attempt the coordinator opens (a dropout elsewhere restarts the key
setup with the survivors) until the coordinator marks the round done, and gives up on any message
it waits for longer than `federate.site_timeout_seconds`. Its local state is snapshotted before each
round, so a round the coordinator redoes after a crash starts from the same state.

Keys (INV-PINNED-KEYS): `keygen` creates the site's Ed25519 key at the site (`lensemble site keygen
SITE`) and prints its fingerprint, which the federation's params pin (`data.sites[].key_fingerprint`).
`enrol` never creates a key: it refuses to run when the site's key is missing or is not the pinned
one, and publishes the public key at `keys/<site>-<first 24 hex of the fingerprint>.pub`, a name the
pin fixes: an impostor's key is never read (a reader checks the full SHA-256 of what it reads), and
a key rotated by `keygen --force` gets a new name, so no exchange name ever holds two blobs. Every
name a site writes is written at most once: a site run that finds its key share for an attempt
already there (an earlier run of itself, retried) sits that attempt out.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from functools import partial
from pathlib import Path

import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from lensemble.config import Params, load_params
from lensemble.data.audit import PrivateIndex, index_path
from lensemble.data.residency import ResidencyGuard
from lensemble.errors import ConfigError, IntegrityError, ParticipantDropped
from lensemble.federation.exchange import (
    Exchange, attempt_prefix, exchange_url, pack_tensors, round_prefix, unpack_tensors,
)
from lensemble.federation.dp import private_codec
from lensemble.federation.rounds import SiteCodec, SiteEndpoint
from lensemble.federation.schedule import round_frozen_prefix
from lensemble.federation.signing import key_fingerprint
from lensemble.federation.transport import RoundContext, param_spec
from lensemble.federation.transports import site_codec
from lensemble.paths import Layout
from lensemble.workflow import probe_frames


def key_path(layout: Layout, site: str) -> Path:
    """The site's long-term Ed25519 signing key: site-local, outside every DVC output and git."""
    return layout.root / "keys" / f"{site}.ed25519"


_SITE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # the pattern of `data.sites[].name` in lensemble.config
_NAME_HEX = 24  # fingerprint digits in a key's exchange name (96 bits: nobody can squat the name of a pinned key)


def keygen(layout: Layout, site: str, force: bool = False) -> tuple[str, bool]:
    """Create the site's Ed25519 signing key (mode 0600) unless it exists: (fingerprint, whether it was created).

    An existing key is kept and its fingerprint returned; `force` replaces it (the old pin then no longer
    matches). Needs no params: a site runs it before the federation's params pin its key.
    """
    if not _SITE_NAME.match(site):
        raise ConfigError(f"site name {site!r} must match {_SITE_NAME.pattern} (as data.sites[].name)")
    path = key_path(layout, site)
    if path.is_file() and not force:
        return key_fingerprint(load_key(layout, site).public_key()), False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()))
    tmp.replace(path)
    return key_fingerprint(key.public_key()), True


def load_key(layout: Layout, site: str) -> Ed25519PrivateKey:
    """The site's signing key; ConfigError naming the site when it has none (keys are never created implicitly)."""
    path = key_path(layout, site)
    if not path.is_file():
        raise ConfigError(f"site {site} has no signing key at {path}; run `lensemble site keygen {site}` at the site and pin"
                          " the fingerprint it prints in params (data.sites[].key_fingerprint)")
    raw = path.read_bytes()
    if len(raw) != 32:
        raise ConfigError(f"site {site}: {path} is not a raw 32-byte Ed25519 key ({len(raw)} bytes)")
    return Ed25519PrivateKey.from_private_bytes(raw)


def site_pins(p: Params) -> dict[str, str]:
    """site -> the key fingerprint params pin (sovereign params pin every site; local ones may pin none)."""
    return {s.name: s.key_fingerprint for s in p.data.sites if s.key_fingerprint is not None}


def public_key_name(site: str, fingerprint: str) -> str:
    """Where a site's public key lives on the exchange: a name fixed by its pinned fingerprint."""
    return f"keys/{site}-{fingerprint[:_NAME_HEX]}.pub"


def enrol(layout: Layout, ex: Exchange, site: str, p: Params | None = None) -> Ed25519PrivateKey:
    """Load the site's signing key, check it against its pin, publish its public half; returns the key.

    ConfigError when the site has no key (see `keygen`); IntegrityError naming the site when params pin
    no key for it, when its key is not the pinned one (the site refuses to run), or when the exchange
    holds other bytes under the pinned name.
    """
    p = p or load_params(layout.root / "params.yaml")
    pinned = site_pins(p).get(site)
    if pinned is None:
        raise IntegrityError(f"site {site!r} has no pinned key_fingerprint in params; it refuses to run", site=site)
    key = load_key(layout, site)
    fingerprint = key_fingerprint(key.public_key())
    if fingerprint != pinned:
        raise IntegrityError(f"site {site!r}: its signing key {key_path(layout, site)} has fingerprint {fingerprint}, not the"
                             f" pinned {pinned}; it refuses to run", site=site)
    name, public = public_key_name(site, pinned), key.public_key().public_bytes_raw()
    published = ex.get(name)
    if published is None:
        ex.put(name, public)
    elif published != public:
        raise IntegrityError(f"site {site!r}: the exchange holds other bytes than its pinned key under {name} (squatted;"
                             " remove the object out of band)", site=site)
    return key


def read_public_key(ex: Exchange, site: str, fingerprint: str) -> Ed25519PublicKey | None:
    """A site's public key with the pinned `fingerprint` from the exchange; None if it has not enrolled.

    IntegrityError naming the site when the blob under that name is not the pinned key.
    """
    raw = ex.get(public_key_name(site, fingerprint))
    if raw is None:
        return None
    if hashlib.sha256(raw).hexdigest() != fingerprint:
        raise IntegrityError(f"site {site!r}: the key published under {public_key_name(site, fingerprint)} does not have the"
                             f" pinned fingerprint {fingerprint}; refused", site=site)
    return Ed25519PublicKey.from_public_bytes(raw)


def state_dir(layout: Layout, site: str, run_id: str) -> Path:
    """The site's local state for one federation run (model, AdamW moments, Δ_c, snapshots)."""
    return layout.root / "site_state" / site / run_id


def snapshot_before(folder: Path, round_idx: int) -> None:
    """Make round `round_idx` idempotent: restore the state from before it if it ran already, else save it."""
    state, snap = folder / "state.pt", folder / f"before-{round_idx}.pt"
    if snap.is_file():
        shutil.copyfile(snap, state)
    elif state.is_file():
        shutil.copyfile(state, snap)
    for old in folder.glob("before-*.pt"):
        if int(old.stem.split("-")[1]) < round_idx:
            old.unlink()


def site_round(root: str, site: str, run_id: str, round_idx: int) -> dict:
    """Train, then answer the exchange protocol until the coordinator closes the round; returns a summary."""
    from tasks.train import site_train  # the same inner loop as in local mode

    layout = Layout(Path(root))
    p = load_params(layout.root / "params.yaml")
    timeout = p.federate.site_timeout_seconds
    ex = Exchange(exchange_url(p.federate.exchange, layout.root))
    key = enrol(layout, ex, site, p)  # refuses to run unless the site's key is the pinned one
    prefix = round_prefix(run_id, round_idx)
    done = f"{prefix}/done.json"
    name, blob = ex.first([done, f"{prefix}/global.pt"], time.monotonic() + timeout, f"site {site} round {round_idx}: global parameters")
    if name == done:
        return {"site": site, "round": round_idx, "attempts": 0, "train_seconds": 0.0, "bytes_sent": 0}
    broadcast = unpack_tensors(blob)
    folder = state_dir(layout, site, run_id)
    folder.mkdir(parents=True, exist_ok=True)
    snapshot_before(folder, round_idx)
    t0 = time.perf_counter()
    trained = site_train.fn(p, layout, site, round_idx, broadcast["state"], probe_frames(layout, p), broadcast["global_probe"],
                            folder / "state.pt", folder / "delta.pt")
    if not ex.exists(f"{prefix}/{site}/train.pt"):  # written once: a retried site run leaves the first result
        ex.put(f"{prefix}/{site}/train.pt", pack_tensors(trained))  # released by the guard inside site_train
    train_seconds = time.perf_counter() - t0
    delta = torch.load(folder / "delta.pt", weights_only=True)
    spec = param_spec(broadcast["state"])
    guard = ResidencyGuard(site, spec, layout.site_audit(site), private=PrivateIndex.load(index_path(layout.site_episodes(site))))
    # DP noise keyed with the site's own secret: the aggregator knows the run seed, never this key
    secret = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    codec = private_codec(site_codec(p.federate.transport, p.federate.quant_block, site, key, {}, site_pins(p)), p, secret)
    endpoint = SiteEndpoint(site, codec, lambda: delta, partial(guard.release, "payload"))
    attempt, sent = 0, 0
    while True:
        a = attempt_prefix(run_id, round_idx, attempt)
        name, blob = ex.first([f"{a}/open.json", done], time.monotonic() + timeout, f"site {site} round {round_idx}: attempt {attempt}")
        if name == done:
            break
        invited = tuple(json.loads(blob)["sites"])
        if site not in invited:
            break  # dropped by the coordinator for this round
        ctx = RoundContext(run_id, round_idx, invited, spec, frozen=round_frozen_prefix(p, spec, round_idx))
        register_peers(ex, codec, site, invited, site_pins(p))
        nxt = f"{attempt_prefix(run_id, round_idx, attempt + 1)}/open.json"
        if ex.exists(f"{a}/{site}.key"):  # an earlier run of this site answered this attempt; its X25519 key is lost
            name, blob = ex.first([nxt, done], time.monotonic() + timeout, f"site {site} round {round_idx}: attempt {attempt + 1}")
        else:
            sent += ex.put(f"{a}/{site}.key", endpoint.key_share(ctx))
            name, blob = ex.first([f"{a}/roster.pt", nxt, done], time.monotonic() + timeout, f"site {site} round {round_idx}: roster")
        if name == f"{a}/roster.pt":
            sent += ex.put(f"{a}/{site}.ann", endpoint.announce(ctx, unpack_tensors(blob)))
            name, blob = ex.first([f"{a}/grid.bin", nxt, done], time.monotonic() + timeout, f"site {site} round {round_idx}: grid")
            if name == f"{a}/grid.bin":
                payload, seconds = endpoint.encode(ctx, blob)
                ex.put(f"{a}/{site}.enc_seconds", str(seconds).encode())
                sent += ex.put(f"{a}/{site}.upd", payload)
        if name == done:
            break
        attempt += 1
    (folder / "delta.pt").unlink(missing_ok=True)  # Δ_c is spent once the round is closed
    return {"site": site, "round": round_idx, "attempts": attempt + 1, "train_seconds": train_seconds, "bytes_sent": sent}


def register_peers(ex: Exchange, codec: SiteCodec, site: str, invited: tuple[str, ...], pins: dict[str, str]) -> None:
    """Give the site's codec every invited peer's pinned public key (it checks their key shares)."""
    for peer in invited:
        if peer not in pins:
            raise IntegrityError(f"site {site}: peer {peer!r} has no pinned key fingerprint in params; refused", site=peer)
        pub = read_public_key(ex, peer, pins[peer])
        if pub is None:
            raise ParticipantDropped(f"site {site}: peer {peer!r} has no enrolled key with its pinned fingerprint in {ex.url}")
        codec.register(peer, pub)
