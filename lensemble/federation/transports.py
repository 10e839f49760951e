"""Transport names → implementations (params `federate.transport`), one instance per role.

In a federation a site's codec holds that site's signing key only (and its peers' public keys), the
aggregator's holds public keys only: `site_codec` and `aggregator_codec` build them. Neither trusts a
key on first use: keys are registered explicitly and, given `pins`, only when pinned (INV-PINNED-KEYS).
"""
from __future__ import annotations

from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from lensemble.errors import ConfigError
from lensemble.federation.secure_transport import Int8Transport, SecureInt8Transport
from lensemble.federation.transport import PlainFP32, Transport

TRANSPORTS = ("fp32", "int8", "secure_int8")


def make_transport(name: str, block: int = 4096, site_keys: Mapping[str, Ed25519PrivateKey] | None = None, *,
                   pins: Mapping[str, str] | None = None, outlier_factor: float | None = None) -> Transport:
    """The transport named in params; ConfigError for an unknown name.

    `site_keys`: the signing keys this instance holds ({} for an aggregator; None: one object playing
    every party, as in a one-process test, which draws each site's key in `begin_round`). `pins`: site ->
    fingerprint of its public key (INV-PINNED-KEYS); every federation passes them. `outlier_factor`: the
    cap of secure_int8's grid agreement (a federation passes `federate.announce_outlier_factor`; None:
    uncapped). Signing and key-agreement keys come from OS randomness, never from the run seed: the aggregate is still bitwise reproducible because masks cancel exactly and
    quantization is deterministic.
    """
    if name == "fp32":
        return PlainFP32()
    if name == "int8":
        return Int8Transport(site_keys, block=block, pins=pins)
    if name == "secure_int8":
        return SecureInt8Transport(site_keys, block=block, ring_bits=16, pins=pins, outlier_factor=outlier_factor)
    raise ConfigError(f"federate.transport: unknown transport {name!r}; known: {list(TRANSPORTS)}")


def site_codec(name: str, block: int, site: str, key: Ed25519PrivateKey, peers: Mapping[str, Ed25519PublicKey],
               pins: Mapping[str, str] | None = None) -> Transport:
    """One site's codec: its own signing key and its peers' public keys (it checks their key shares).

    With `pins`, the site refuses to start when its own key is not the pinned one, and refuses a peer's
    key that is not pinned (IntegrityError naming the site).
    """
    codec = make_transport(name, block, site_keys={site: key}, pins=pins)
    for peer, public in sorted(peers.items()):
        if peer != site:
            codec.register(peer, public)
    return codec


def aggregator_codec(name: str, block: int, pins: Mapping[str, str] | None = None,
                     outlier_factor: float | None = None) -> Transport:
    """The aggregator's codec: no signing key; sites' public keys arrive through `register`, checked against `pins`."""
    return make_transport(name, block, site_keys={}, pins=pins, outlier_factor=outlier_factor)
