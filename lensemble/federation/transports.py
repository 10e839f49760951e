"""Transport names → implementations (params `federate.transport`), one instance per role.

In a federation a site's codec holds that site's signing key only (and its peers' public keys), the
aggregator's holds public keys only: `site_codec` and `aggregator_codec` build them.
"""
from __future__ import annotations

from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from lensemble.errors import ConfigError
from lensemble.federation.secure_transport import Int8Transport, SecureInt8Transport
from lensemble.federation.transport import PlainFP32, Transport

TRANSPORTS = ("fp32", "int8", "secure_int8")


def make_transport(name: str, block: int = 4096, site_keys: Mapping[str, Ed25519PrivateKey] | None = None) -> Transport:
    """The transport named in params; ConfigError for an unknown name.

    `site_keys`: the signing keys this instance holds ({} for an aggregator; None enrols a key per site
    on first use, one object playing every party, as in a one-process test). Signing and
    key-agreement keys come from OS randomness, never from the run seed: the aggregate is still
    bitwise reproducible because masks cancel exactly and quantization is deterministic.
    """
    if name == "fp32":
        return PlainFP32()
    if name == "int8":
        return Int8Transport(site_keys, block=block)
    if name == "secure_int8":
        return SecureInt8Transport(site_keys, block=block, ring_bits=16)
    raise ConfigError(f"federate.transport: unknown transport {name!r}; known: {list(TRANSPORTS)}")


def site_codec(name: str, block: int, site: str, key: Ed25519PrivateKey, peers: Mapping[str, Ed25519PublicKey]) -> Transport:
    """One site's codec: its own signing key and its peers' public keys (it checks their key shares)."""
    codec = make_transport(name, block, site_keys={site: key})
    for peer, public in sorted(peers.items()):
        if peer != site:
            codec.register(peer, public)
    return codec


def aggregator_codec(name: str, block: int) -> Transport:
    """The aggregator's codec: no signing key; sites' public keys arrive through `register`."""
    return make_transport(name, block, site_keys={})
