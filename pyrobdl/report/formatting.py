r"""Number formatting of the report's tables: one format per column, "± s.e." only where n > 1."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["decimals_for", "fmt", "fmt_column", "fmt_fixed", "fmt_mean_se", "mean_se"]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt(v: Any, digits: int = 4) -> str:
    """A number with ``digits`` significant digits; "—" for missing or non-finite values."""
    if not _finite(v):
        return "—" if v is None else str(v)
    if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def mean_se(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, standard error (NaN for one value) and count of the finite ``values``."""
    vals = np.asarray([v for v in values if _finite(v)], dtype=float)
    n = vals.size
    if n == 0:
        return math.nan, math.nan, 0
    se = float(vals.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return float(vals.mean()), se, n


def fmt_mean_se(mean: float, se: float) -> str:
    """``mean ± se`` (just the mean when the s.e. is unknown)."""
    if not _finite(mean):
        return "—"
    return fmt(mean) if not _finite(se) else f"{fmt(mean)} ± {fmt(se, 2)}"


def decimals_for(values: Iterable[Any], companions: Iterable[Any] = ()) -> int | None:
    """Decimals that give the column's median magnitude three significant figures (0 to 6), so
    every number of a column is written alike; 0 when every value is a whole number; None when
    the column is better in e-notation (a median below 1e-4)."""
    values = [v for v in values if _finite(v)]
    companions = [v for v in companions if _finite(v)]  # e.g. standard errors: only the whole-number test
    if values and all(float(v).is_integer() for v in values + companions):
        return 0  # counts (divergences, gradient evaluations) and whole numbers stay whole
    mags = np.asarray([abs(v) for v in values if v != 0], dtype=float)
    if mags.size == 0:
        return 2
    med = float(np.median(mags))
    if med < 1e-4:
        return None
    return int(min(6, max(0, 2 - math.floor(math.log10(med)))))


def fmt_fixed(v: Any, decimals: int | None) -> str:
    """``v`` with ``decimals`` decimals (thousands separated); e-notation when None."""
    if not _finite(v):
        return "—" if v is None else str(v)
    if decimals is None:
        return f"{v:.2e}"
    return f"{v:,.{decimals}f}"


def fmt_column(stats: Sequence[tuple[float, float, int]]) -> list[str]:
    """Cells of one column of ``(mean, se, n)``: one number format for the whole column,
    "± s.e." only where n > 1."""
    d = decimals_for([m for m, _, _ in stats], [se for _, se, n in stats if n > 1])
    return ["—" if not _finite(m) else fmt_fixed(m, d) + (f" ± {fmt_fixed(se, d)}" if n > 1 and _finite(se) else "")
            for m, se, n in stats]
