"""The Lensemble error model (DESIGN.md §6).

Every error names the offending input so that the CLI can print it on one line and exit non-zero.
"""
from __future__ import annotations


class LensembleError(Exception):
    """Base of every error Lensemble raises on purpose; `exit_code` is what the CLI returns."""

    exit_code = 1


class ConfigError(LensembleError):
    """Bad params: unknown key, wrong type, out-of-range value, unknown name."""

    exit_code = 2


class DataError(LensembleError):
    """A missing, empty, truncated or corrupt episode store, or a schema mismatch."""

    exit_code = 3


class ResidencyViolation(LensembleError):
    """Something private tried to cross a site boundary (INV-RESIDENCY, INV-ACTIONHEAD-LOCAL)."""

    exit_code = 4


class NonDeterministicAggregation(LensembleError):
    """Two evaluations of the outer step disagreed bit for bit (INV-AGG-DETERMINISM)."""

    exit_code = 5


class IntegrityError(LensembleError):
    """An update with a bad signature, wrong run/round/site, wrong names or shapes, NaN or Inf.

    `site`: the site whose message failed, when one did (the round driver drops it and retries).
    """

    exit_code = 6

    def __init__(self, message: str, *, site: str | None = None) -> None:
        super().__init__(message)
        self.site = site


class BudgetExceeded(LensembleError):
    """A pre-flight estimate is over a configured ceiling; nothing was launched."""

    exit_code = 7


class ParticipantDropped(LensembleError):
    """A site failed or timed out and could not be recovered within the round."""

    exit_code = 8
