"""`config.valid_cron` (the serve schedule's check, without Prefect) against Prefect's own cron validation."""
from __future__ import annotations

import pytest

from lensemble.config import valid_cron

ACCEPTED = ("0 * * * *", "*/15 * * * *", "0 0 * * 7", "0 0 * jan *", "0 0 * JAN-mar *", "0 0 * * mon-fri", "@hourly", "@HOURLY",
            "1-5/2 * * * *", "5/10 * * * *", "0 0 L * *", "0 0 * * 5#3", "0 0 ? * *", "0,30 * * * *", "0 0 * * 0-7",
            "  0 * * * * ", "0 0 1-31/7 * *", "00 * * * *", "*/61 * * * *", "0 0 29 2 *")
REFUSED = ("61 * * * *", "0 24 * * *", "0 0 0 * *", "0 0 32 * *", "0 0 * 13 *", "0 0 * * 8", "@reboot", "* * * *", "*/0 * * * *",
           "? * * * *", ",0 * * * *", "-1 * * * *", "a * * * *", "0 0 15W * *", "H * * * *", "R * * * *", "0 0 * * 0#6", "0-60 * * * *")
STRICTER = ("0 0 1 * * *", "5-1 * * * *", "* * * * mon-sun", "0 0 * * mon#2", "0 0 L,1 * *")  # croniter extensions refused here


def _prefect_accepts(expr: str) -> bool:
    from prefect._internal.schemas.validators import validate_cron_string

    try:
        validate_cron_string(expr)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("expr", ACCEPTED + REFUSED)
def test_valid_cron_agrees_with_prefect(expr):
    assert valid_cron(expr) == _prefect_accepts(expr) == (expr in ACCEPTED)


@pytest.mark.parametrize("expr", STRICTER)
def test_valid_cron_refuses_only_what_prefect_accepts_beyond_five_standard_fields(expr):
    assert _prefect_accepts(expr) and not valid_cron(expr)
