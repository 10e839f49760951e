"""Statistics of success counts, from scipy: the Wilson interval of a rate."""
from __future__ import annotations


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion, two-sided at the confidence of normal quantile `z` (95% by
    default), from scipy's `binomtest(...).proportion_ci(method="wilson")`; no episodes say nothing: (0, 1)."""
    if n == 0:
        return 0.0, 1.0
    from scipy import stats  # here, not at import: scipy.stats costs ~1.5 s of every stage that imports this module

    confidence = 1 - 2 * stats.norm.sf(z)  # z = 1.959964 → 0.95
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)
