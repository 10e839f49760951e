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
"""
from __future__ import annotations

import json
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
from lensemble.errors import IntegrityError, ParticipantDropped
from lensemble.federation.exchange import (
    Exchange, attempt_prefix, exchange_url, pack_tensors, round_prefix, unpack_tensors,
)
from lensemble.federation.rounds import SiteCodec, SiteEndpoint
from lensemble.federation.transport import RoundContext, param_spec
from lensemble.federation.transports import site_codec
from lensemble.paths import Layout
from lensemble.workflow import probe_frames


def key_path(layout: Layout, site: str) -> Path:
    """The site's long-term Ed25519 signing key: site-local, outside every DVC output and git."""
    return layout.root / "keys" / f"{site}.ed25519"


def enrol(layout: Layout, ex: Exchange, site: str) -> Ed25519PrivateKey:
    """Load (or create, mode 0600) the site's signing key and publish its public half to the exchange.

    IntegrityError if the exchange already holds a different key for this site (trust on first use).
    """
    path = key_path(layout, site)
    if path.is_file():
        key = Ed25519PrivateKey.from_private_bytes(path.read_bytes())
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        tmp = path.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_bytes(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()))
        tmp.replace(path)
    public = key.public_key().public_bytes_raw()
    published = ex.get(f"keys/{site}.pub")
    if published is None:
        ex.put(f"keys/{site}.pub", public)
    elif published != public:
        raise IntegrityError(f"the exchange holds a different signing key for {site!r} than {path}")
    return key


def read_public_key(ex: Exchange, site: str) -> Ed25519PublicKey | None:
    """A site's enrolled public key from the exchange, or None if it has not enrolled."""
    raw = ex.get(f"keys/{site}.pub")
    return None if raw is None else Ed25519PublicKey.from_public_bytes(raw)


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
    key = enrol(layout, ex, site)
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
    ex.put(f"{prefix}/{site}/train.pt", pack_tensors(trained))  # released by the guard inside site_train
    train_seconds = time.perf_counter() - t0
    delta = torch.load(folder / "delta.pt", weights_only=True)
    spec = param_spec(broadcast["state"])
    guard = ResidencyGuard(site, spec, layout.site_audit(site), private=PrivateIndex.load(index_path(layout.site_episodes(site))))
    codec = site_codec(p.federate.transport, p.federate.quant_block, site, key, {})
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
        ctx = RoundContext(run_id, round_idx, invited, spec)
        register_peers(ex, codec, site, invited)
        sent += ex.put(f"{a}/{site}.key", endpoint.key_share(ctx))
        nxt = f"{attempt_prefix(run_id, round_idx, attempt + 1)}/open.json"
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


def register_peers(ex: Exchange, codec: SiteCodec, site: str, invited: tuple[str, ...]) -> None:
    """Give the site's codec every invited peer's enrolled public key (it checks their key shares)."""
    for peer in invited:
        pub = read_public_key(ex, peer)
        if pub is None:
            raise ParticipantDropped(f"site {site}: peer {peer!r} has no enrolled key in {ex.url}")
        codec.register(peer, pub)
