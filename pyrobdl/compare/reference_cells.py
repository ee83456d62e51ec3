r"""A dependent cell's view of its reference cells: the reference's stored draws (and those of its
replicate, ``reference_replicates = 2``), checked against their records, and the resolution of the
two.

The driver reads a reference cell's record and draws once per stage (:func:`reference_payload`);
a worker turns them into a posterior (:func:`stored_reference`) and, with a replicate, into the
reference's resolution (:func:`resolution_of`).  A dependent cell records the checksums of the
draws it was scored against (:func:`combined_sha` for two), so a refitted reference or replicate
makes it stale.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..diagnostics import reference_resolution
from ..diagnostics.certification import Certification
from ..posterior import Cost
from . import artifacts
from .store import RESULT_FILE, ResultsError, read_result

__all__ = ["REFERENCE_DRAWS", "ReferencePayload", "combined_sha", "reference_payload", "resolution_of",
           "stored_reference"]

#: A reference cell's draws file (in its cell folder).
REFERENCE_DRAWS = "reference_draws.pt"


@dataclass(frozen=True)
class ReferencePayload:
    """A reference cell's stored posterior as the driver read it for a dependent cell.

    Attributes
    ----------
    record : Mapping or None
        The reference cell's record (None when unavailable).
    draws : bytes or None
        Its draws file, checked against the checksum in its record.
    draws_sha256 : str or None
        That checksum (recorded by the dependent cell).
    note : str
        Why the reference is unavailable (the dependent cell is then scored without it).
    error : str
        Why the stored draws cannot be used although the record is ``ok`` (damaged, replaced,
        unreadable); the dependent cell fails with it.
    """

    record: Mapping[str, Any] | None
    draws: bytes | None
    draws_sha256: str | None
    note: str = ""
    error: str = ""


def reference_payload(out: str | Path, reference: str) -> ReferencePayload:
    """Read and verify a reference cell's record and draws for its dependents (driver side).

    The draws are passed on only when they match the checksum their cell recorded.  A reference
    that is missing or did not finish gives a ``note`` (its dependents are scored without it); a
    record that is ``ok`` but whose draws are missing, damaged or unreadable gives an ``error``
    naming the file (its dependents fail with it), as a stored result must never be silently
    replaced.
    """
    ref_dir = Path(out) / "cells" / str(reference)
    path = ref_dir / REFERENCE_DRAWS
    try:
        record = read_result(ref_dir / RESULT_FILE)
    except (ResultsError, FileNotFoundError, OSError) as e:
        return ReferencePayload(None, None, None, note=f"reference {reference} unavailable: {e}")
    if record["status"] != "ok":
        return ReferencePayload(None, None, None, note=f"reference {reference} unavailable: its cell {record['status']}")
    expected = (record.get("checksums") or {}).get(REFERENCE_DRAWS)
    try:
        blob = path.read_bytes()
    except OSError as e:
        return ReferencePayload(record, None, None, error=f"reference draws {path} cannot be read: {e.strerror or e}")
    if expected is None or hashlib.sha256(blob).hexdigest() != expected:
        return ReferencePayload(record, None, None, error=(
            f"reference draws {path} do not match the checksum in their cell's record "
            "(damaged or replaced); rerun to refit the reference"))
    return ReferencePayload(record, blob, expected)


def stored_reference(payload: ReferencePayload, path: Path, make_model: Callable[[], Any],
                     method: str) -> tuple[Any, str, str | None]:
    """A reference cell's stored posterior, or (None, why not, None).

    Parameters
    ----------
    payload : ReferencePayload
        What the driver read (:func:`reference_payload`).
    path : pathlib.Path
        The draws file, named in errors.
    make_model : callable
        Builds the reference's model on the cell's device (called only when the draws load).
    method : str
        Registry name of the reference's method.

    Returns
    -------
    tuple
        The :class:`~pyrobdl.compare.artifacts.StoredPosterior` (its ``certification`` the
        reference cell's recorded one; a record without one gives a failed certification, "no
        certification recorded"), a note (why it is unavailable, else ""), and the draws'
        checksum, which the dependent cell records so a later change of the draws makes it stale.

    Raises
    ------
    ResultsError
        If the reference's draws are missing, damaged or unreadable although its record is
        ``ok`` (naming the file).
    """
    if payload.error:
        raise ResultsError(payload.error)
    if payload.record is None or payload.draws is None:
        return None, payload.note, None
    record = payload.record
    try:
        draws = artifacts.load_draws_bytes(payload.draws)
    except Exception as e:  # torch's zip reader: its message does not name the file
        raise ResultsError(f"reference draws {path} cannot be loaded: {type(e).__name__}: {e}") from None
    cost = Cost(**record["cost"]) if isinstance(record.get("cost"), dict) else None
    recorded = record.get("certification")
    certification = (Certification.from_dict(recorded) if isinstance(recorded, dict)
                     else Certification.missing("no certification recorded"))
    return artifacts.StoredPosterior(make_model(), draws, method, cost, certification), "", payload.draws_sha256


def resolution_of(replicate: Any, reference: Any, data: Any, num_samples: int, seed: int) -> Any:
    """The reference's resolution at the cell's test inputs: the replicate in a method's place, the
    reference in its own, with the cell's draws, seed and target scale (what its evaluation uses)."""
    kwargs: dict[str, Any] = {"num_samples": num_samples, "seed": seed}
    if hasattr(data, "y_std"):
        kwargs.update(y_mean=float(data.y_mean), y_std=float(data.y_std))
    return reference_resolution(replicate, reference, data.x_test, **kwargs)


def combined_sha(reference_sha: str | None, replicate_sha: str | None) -> str | None:
    """What a cell scored against a reference and its replicate records of their draws (None when
    either is unknown)."""
    return f"{reference_sha}+{replicate_sha}" if reference_sha and replicate_sha else None
