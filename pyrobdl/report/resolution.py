r"""The reference's resolution as the report reads it from stored records.

A suite with ``reference_replicates = 2`` runs each reference twice; every cell scored against it
records the two runs' own disagreement (``<key>_resolution``), its distance in units of it
(``<key>_in_resolutions``) and whether it is distinguishable from the reference
(``reference_resolved``): :func:`pyrobdl.diagnostics.reference_resolution`.  This module turns
those keys into the report's words: a sentence on the resolution, which agreement columns stay
meaningful against an uncertified reference, and whether the method closest to the reference is
resolved from the next one (their distances differ by more than twice the resolution).  It reads
plain record dicts and imports nothing of the report.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

__all__ = [
    "IN_RESOLUTIONS",
    "RESOLVED",
    "closest_sentence",
    "is_resolution_value",
    "meaningful_without_certificate",
    "resolution_sentence",
    "split_resolutions",
]

#: Suffix of a metric that is the reference's own resolution (the same in every cell of a split).
RESOLUTION = "_resolution"
#: Suffix of a metric that is a distance in units of the resolution.
IN_RESOLUTIONS = "_in_resolutions"
#: Metric: 1.0 when the method is farther from the reference than its resolution.
RESOLVED = "reference_resolved"
#: Words for the agreement keys.
NAMES = {"w2_function_to_reference": "function-space W2", "w2_to_reference": "predictive W2",
         "kl_gaussian_to_reference": "predictive KL", "total_variation": "total variation",
         "agreement": "disagreement (1 - agreement)"}


def is_resolution_value(key: str) -> bool:
    """A ``<key>_resolution`` metric: the reference's own value, said in a sentence, not a column."""
    return key.endswith(RESOLUTION)


def meaningful_without_certificate(key: str) -> bool:
    """Metrics read in units of the resolution: meaningful against an uncertified reference."""
    return key.endswith(IN_RESOLUTIONS) or key == RESOLVED


def _ok(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("status") == "ok" and (r.get("reference") or {}).get("used")]


def split_resolutions(records: Sequence[Mapping[str, Any]], key: str) -> dict[tuple[Any, Any], float]:
    """The resolution of agreement metric ``key`` per (dataset, split), from the cells scored with one."""
    out: dict[tuple[Any, Any], float] = {}
    for r in _ok(records):
        value = (r.get("metrics") or {}).get(key + RESOLUTION)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.setdefault((r.get("dataset"), r.get("split")), float(value))
    return out


def _mean_resolution(records: Sequence[Mapping[str, Any]], key: str) -> tuple[float, int]:
    values = list(split_resolutions(records, key).values())
    return (sum(values) / len(values), len(values)) if values else (math.nan, 0)


def resolution_sentence(records: Sequence[Mapping[str, Any]], key: str) -> str:
    """E.g. ``"Two independent runs of the reference disagree by function-space W2 0.0412 (its
    resolution; mean over 3 splits): distances to it are also given in units of it (…_in_resolutions)."``;
    "" when no cell recorded a resolution."""
    value, n = _mean_resolution(records, key)
    if not n:
        return ""
    over = f"mean over {n} splits" if n > 1 else "one split"
    return (f"Two independent runs of the reference disagree by {NAMES.get(key, key)} {value:.3g} (its resolution; "
            f"{over}): each distance to the reference is also given in units of it ({key}{IN_RESOLUTIONS}), and "
            f"{RESOLVED} = 1 marks a method farther from the reference than the reference's two runs are from "
            "each other.")


def closest_sentence(distances: Mapping[str, float], records: Sequence[Mapping[str, Any]], key: str,
                     certified: bool, number: Any) -> str:
    """The verdict's sentence on the method closest to the reference.

    Parameters
    ----------
    distances : Mapping
        Method label -> its mean distance ``key`` to the reference (finite values only).
    records : sequence of dict
        The dataset's records (for the resolution).
    key : str
        The agreement metric.
    certified : bool
        Whether the reference is certified.
    number : callable
        Formats a number as the report does.
    """
    closest = min(distances, key=lambda m: distances[m])
    head = f"Closest to the reference ({key}, lower is better): {closest}, {number(distances[closest])}"
    res, n = _mean_resolution(records, key)
    if not n:
        return head + ("." if certified else " (against an uncertified reference: this means nothing).")
    others = sorted((d, m) for m, d in distances.items() if m != closest)
    units = f" ({number(distances[closest] / res)} resolutions)" if res > 0 else ""
    if not others:
        return head + units + "."
    gap, runner_up = others[0][0] - distances[closest], others[0][1]
    precision = "" if certified else " of an uncertified reference"
    if gap > 2 * res:
        return (head + units + f", resolved at this precision{precision}: the next closest, {runner_up} "
                f"({number(others[0][0])}), is more than twice the resolution {number(res)} farther.")
    return (head + units + f", not resolved{precision}: the next closest, {runner_up} ({number(others[0][0])}), "
            f"is within twice the resolution {number(res)}.")
