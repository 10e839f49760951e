"""Plain progress lines for long loops, readable in a non-TTY log (DVC, CI, `nohup`).

    centralized: step 400/2000 (20%), loss/pred 0.93, 21.0 steps/s, ETA 76 s

A `Progress` prints at every `every_fraction` of its total, at least every `every_seconds`, and when
the loop ends, on the `lensemble.progress` logger at INFO. The CLI shows that logger on stderr, and
Prefect sends its records to the Logs tab of the run they are emitted in (`PREFECT_LOGGING_EXTRA_LOGGERS`).
It only reads a clock and the figures it is handed: no RNG draw, no tensor op, no device sync, so a
run's numbers are the same with or without it; a line is formatted only when it is printed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("lensemble.progress")


def format_line(label: str, unit: str, done: int, total: int, seconds: float,
                figures: Mapping[str, float] | None = None) -> str:
    """`label: unit done/total (pct%), name value, ..., rate units/s, ETA s` (the ETA only while work is left)."""
    parts = [f"{label}: {unit} {done}/{total} ({100 * done / max(total, 1):.0f}%)"]
    parts += [f"{name} {value:.4g}" for name, value in (figures or {}).items()]
    if seconds > 0 and done > 0:
        rate = done / seconds
        parts.append(f"{rate:.3g} {unit}s/s")
        parts.append(f"ETA {(total - done) / rate:.0f} s" if done < total else f"{seconds:.1f} s")
    return ", ".join(parts)


class Progress:
    """Counts `total` units of work and logs a line at every `every_fraction` (None: never by count; 0: every
    update), at least every `every_seconds`, and at the end."""

    def __init__(self, label: str, total: int, unit: str = "step", every_fraction: float | None = 0.1,
                 every_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.unit, self.every_seconds, self.clock = label, total, unit, every_seconds, clock
        self.stride = None if every_fraction is None else max(1, round(total * every_fraction))
        self.done = 0
        self.started = clock()
        self._next_count = self.stride or total
        self._next_time = self.started + every_seconds

    def update(self, done: int, figures: Mapping[str, float] | None = None) -> None:
        """`done` units finished so far; `figures` (e.g. the last loss) appear on the line if one is printed."""
        self.done = done
        if done < self._next_count and done < self.total:
            now = self.clock()
            if now < self._next_time:
                return
        else:
            now = self.clock()
        if self.stride is not None:
            self._next_count = (done // self.stride + 1) * self.stride
        self._next_time = now + self.every_seconds
        if log.isEnabledFor(logging.INFO):
            log.info(format_line(self.label, self.unit, done, self.total, now - self.started, figures))

    def advance(self, n: int = 1, figures: Mapping[str, float] | None = None) -> None:
        """`n` more units finished."""
        self.update(self.done + n, figures)
