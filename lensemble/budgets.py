"""Budgets as data (DESIGN.md §8): bands per hardware class, evaluated on every run.

`budgets.yaml` holds a list of entries: name, metric, low, high, unit, stage, hardware_class,
response (revise | investigate | error), planning (true until measured on that class), and optionally
only_if (a boolean params key such as `dp.enabled`: the budget exists only for runs that turn it on).
A measured value is `within`, `below` or `above` its band; a budget with no measurement is
`not_measured`; a hardware class with no band for a budget is `no_band` - never a silent pass.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lensemble.config import load_yaml
from lensemble.errors import ConfigError
from lensemble.observability.metrics import CANONICAL


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    metric: str
    low: float
    high: float
    unit: str
    stage: str
    hardware_class: str
    response: Literal["revise", "investigate", "error"]
    planning: bool = Field(False, description="A planning band, not yet measured on this class.")
    only_if: str | None = Field(None, description="A boolean params key (section.field, e.g. dp.enabled); "
                                                  "the budget applies only to runs where it is true.")

    @model_validator(mode="after")
    def _check(self) -> "Budget":
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) > high ({self.high})")
        if not CANONICAL.match(self.metric):
            raise ValueError(f"unknown metric name {self.metric!r}")
        if self.only_if is not None and not _bool_param(self.only_if):
            raise ValueError(f"only_if {self.only_if!r} is not a boolean params key (section.field)")
        return self


def _bool_param(key: str) -> bool:
    """Whether `key` names a boolean field of a params section."""
    from lensemble.config import Params

    section, _, name = key.partition(".")
    model = Params.model_fields.get(section)
    fields = getattr(model.annotation, "model_fields", {}) if model is not None else {}
    return name in fields and fields[name].annotation is bool


def applies(budget: Budget, params: Any | None) -> bool:
    """Whether `budget` applies to a run of `params` (None: unknown, so it does and is never skipped)."""
    if budget.only_if is None or params is None:
        return True
    section, _, name = budget.only_if.partition(".")
    return bool(getattr(getattr(params, section), name))


def load_budgets(path: Path) -> list[Budget]:
    """Parse and validate budgets.yaml; ConfigError naming the bad entry."""
    if not Path(path).is_file():
        raise ConfigError(f"budgets file {path} does not exist")
    raw = load_yaml(path, "budgets file") or {}
    entries = raw.get("budgets") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: expected a top-level 'budgets' list")
    out = []
    for i, entry in enumerate(entries):
        try:
            out.append(Budget.model_validate(entry))
        except ValidationError as exc:
            name = entry.get("name", f"#{i}") if isinstance(entry, dict) else f"#{i}"
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ConfigError(f"{path}: budget {name!r}: {loc + ': ' if loc else ''}{err['msg'].removeprefix('Value error, ')}") from None
    return out


def evaluate_budgets(budgets: list[Budget], stage: str, hw_class: str, measured: dict[str, float],
                     params: Any | None = None) -> list[dict]:
    """Status of every budget of `stage` that applies to a run of `params`: one row per budget name, for this hardware class."""
    rows = []
    budgets = [b for b in budgets if applies(b, params)]
    names = sorted({b.name for b in budgets if b.stage == stage})
    for name in names:
        band = next((b for b in budgets if b.name == name and b.stage == stage and b.hardware_class == hw_class), None)
        any_band = next(b for b in budgets if b.name == name and b.stage == stage)
        value = measured.get(any_band.metric)
        if band is None:
            status = "no_band"
        elif value is None:
            status = "not_measured"
        elif value < band.low:
            status = "below"
        elif value > band.high:
            status = "above"
        else:
            status = "within"
        rows.append(
            {"name": name, "metric": any_band.metric, "stage": stage, "hardware_class": hw_class,
             "low": band.low if band else None, "high": band.high if band else None, "unit": any_band.unit,
             "value": value, "status": status, "response": any_band.response,
             "planning": band.planning if band else None}
        )
    return rows


def violations(rows: list[dict]) -> list[dict]:
    """Rows whose failure response is `error` and whose value left its band (an invariant touched)."""
    return [r for r in rows if r["response"] == "error" and r["status"] in ("below", "above")]
