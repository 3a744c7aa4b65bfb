"""Summary statistics over seeds: the mean and its 95% confidence interval.

With n seeds the interval is mean +- t(0.975, n - 1) * s / sqrt(n) (Student's t, s the sample
standard deviation): the usual interval for a handful of independent runs, wide on purpose at
n = 3 (t = 4.30). One seed has no interval (reported as ``None``, never as 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Student's t quantile t(0.975, df) for df = 1..30; beyond that the normal 1.96 is within 2%.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least 2 values")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass(frozen=True)
class Interval:
    mean: float
    half_width: float | None  # None with a single value
    n: int

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def text(self, digits: int = 3) -> str:
        if self.half_width is None:
            return f"{self.mean:.{digits}f} (1 seed)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"

    def as_dict(self) -> dict[str, float | int | None]:
        return {**asdict(self), "low": self.low, "high": self.high}


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean and 95% t-interval half-width of independent values (one per seed)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("no values")
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return Interval(mean, None, 1)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return Interval(mean, t975(len(xs) - 1) * math.sqrt(var / len(xs)), len(xs))
