"""Transport names → implementations (params `federate.transport`)."""
from __future__ import annotations

from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lensemble.errors import ConfigError
from lensemble.federation.secure_transport import Int8Transport, SecureInt8Transport
from lensemble.federation.transport import PlainFP32, Transport

TRANSPORTS = ("fp32", "int8", "secure_int8")


def make_transport(name: str, block: int = 4096, site_keys: Mapping[str, Ed25519PrivateKey] | None = None) -> Transport:
    """The transport named in params; ConfigError for an unknown name.

    Signing and key-agreement keys come from OS randomness, never from the run seed: the aggregate
    is still bitwise reproducible because masks cancel exactly and quantization is deterministic.
    """
    if name == "fp32":
        return PlainFP32()
    if name == "int8":
        return Int8Transport(site_keys, block=block)
    if name == "secure_int8":
        return SecureInt8Transport(site_keys, block=block, ring_bits=16)
    raise ConfigError(f"federate.transport: unknown transport {name!r}; known: {list(TRANSPORTS)}")
