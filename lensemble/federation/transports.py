"""Transport names → implementations (params `federate.transport`)."""
from __future__ import annotations

from lensemble.errors import ConfigError
from lensemble.federation.transport import PlainFP32, Transport


def make_transport(name: str, run_seed: int) -> Transport:
    """The transport named in params; ConfigError for an unknown name."""
    if name == "fp32":
        return PlainFP32()
    raise ConfigError(f"federate.transport: unknown transport {name!r}; known: ['fp32']")
