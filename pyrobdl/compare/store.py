r"""The results folder: one directory per cell, every file written atomically.

Layout of ``OUT/``::

    suite.toml                the suite file as given (copied on every run)
    cells/<cell id>/
        result.json           the record of the cell; written LAST: its presence marks the cell done
        arrays.npz            ELBO history, predictive bands (1-D data), calibration curve
        inference_data.nc     ArviZ InferenceData (netCDF), when the suite asks for it
        reference_draws.pt    posterior draws, for cells other cells use as their reference

Every file is written to a temporary name in the same folder, flushed to disk, then renamed with
:func:`os.replace`, which is atomic on POSIX and Windows.  A process killed at any moment (even
``kill -9``) therefore leaves either the previous complete file or none, plus at most a stray
``.*.tmp-*`` file, which the next run deletes.  Since ``result.json`` is written last, a cell
killed before it is simply run again.

Resume policy (:func:`cell_state`):

* ``ok``: a valid record with status ``ok`` for the same resolved configuration: skipped.
* ``failed``: a valid record of a failed cell: run again (the failure may have been transient or
  fixed since).
* ``missing``: no record: run.
* ``incomplete``: an ``ok`` record evaluated without its reference posterior because the reference
  was not available then: run again.
* ``stale``: a record of a different configuration (the suite, a default option or the code's
  record schema changed) and ``corrupt``: an unreadable record.  Both stop the run with an error
  naming the files, before anything runs, unless ``rerun_invalid`` is set, in which case the old
  record is renamed to ``result.json.invalid-<timestamp>`` and the cell runs again.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

__all__ = [
    "RESULT_FILE",
    "SCHEMA",
    "ResultsError",
    "atomic_write",
    "atomic_write_json",
    "cell_state",
    "clean_tmp",
    "jsonable",
    "list_results",
    "read_result",
]

#: Version tag of the result record; bump when its fields change meaning.
SCHEMA = "pyrobdl.cell/1"
RESULT_FILE = "result.json"
_REQUIRED_FIELDS = ("schema", "id", "status", "dataset", "method", "split", "seed", "config_hash")


class ResultsError(RuntimeError):
    """A results folder that cannot be used as is (corrupt or stale records, nothing to report)."""


def atomic_write(path: Path, writer: Callable[[Path], Any]) -> Path:
    """Create ``path`` atomically: ``writer(tmp)`` writes a temporary file that is then renamed.

    Parameters
    ----------
    path : pathlib.Path
        Destination.
    writer : callable
        ``writer(tmp_path)`` writes the complete file at ``tmp_path`` (same folder).

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        writer(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def jsonable(obj: Any, *, max_elements: int = 100_000) -> Any:
    """Convert ``obj`` to plain JSON types.

    Tensors and arrays become (nested) lists, numpy scalars Python numbers, dataclasses and
    objects with ``to_dict`` dicts; non-finite floats become None (strict JSON has no NaN).
    Arrays larger than ``max_elements`` are summarised (shape, mean, min, max).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            return [str(v) for v in obj.ravel().tolist()]
        if obj.size > max_elements:
            a = obj.astype(float)
            return {"shape": list(obj.shape), "mean": jsonable(np.nanmean(a)),
                    "min": jsonable(np.nanmin(a)), "max": jsonable(np.nanmax(a))}
        return jsonable(obj.tolist())
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v, max_elements=max_elements) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v, max_elements=max_elements) for v in obj]
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return jsonable(obj.to_dict(), max_elements=max_elements)
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj), max_elements=max_elements)
    return str(obj)


def atomic_write_json(path: Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` (made JSON-safe with :func:`jsonable`) atomically, strict JSON."""
    text = json.dumps(jsonable(record), indent=1, allow_nan=False, sort_keys=False)
    return atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))


def atomic_save_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write a compressed ``.npz`` atomically."""

    def write(tmp: Path) -> None:
        buf = io.BytesIO()
        np.savez_compressed(buf, **{k: np.asarray(v) for k, v in arrays.items()})
        tmp.write_bytes(buf.getvalue())

    return atomic_write(path, write)


def read_result(path: Path) -> dict[str, Any]:
    """Read one cell record.

    Raises
    ------
    ResultsError
        If the file is not valid JSON, is not a record of this schema, or lacks a field; the
        message names the file.
    """
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultsError(f"corrupt result file {path}: {e}") from e
    if not isinstance(record, dict):
        raise ResultsError(f"corrupt result file {path}: not a JSON object")
    missing = [k for k in _REQUIRED_FIELDS if k not in record]
    if missing:
        raise ResultsError(f"corrupt result file {path}: missing field(s) {missing}")
    if record["schema"] != SCHEMA:
        raise ResultsError(f"result file {path} has schema {record['schema']!r}; this pyrobdl reads {SCHEMA!r}")
    return record


def cell_state(cell_dir: Path, config_hash: str, needs_reference: bool) -> tuple[str, str]:
    """State of a cell's folder for resuming, and a reason; see the module docstring."""
    path = Path(cell_dir) / RESULT_FILE
    if not path.exists():
        return "missing", ""
    try:
        record = read_result(path)
    except ResultsError as e:
        return "corrupt", str(e)
    if record["config_hash"] != config_hash:
        return "stale", (
            f"result file {path} was produced by a different configuration "
            f"(stored hash {record['config_hash'][:12]}, current {config_hash[:12]})"
        )
    if record["status"] != "ok":
        return "failed", record.get("error", {}).get("message", "") if isinstance(record.get("error"), dict) else ""
    if needs_reference and not record.get("reference", {}).get("used", False):
        return "incomplete", "evaluated without its reference posterior"
    return "ok", ""


def set_aside(cell_dir: Path) -> Path:
    """Rename an invalid record out of the way (``result.json.invalid-<timestamp>``)."""
    src = Path(cell_dir) / RESULT_FILE
    dst = src.with_name(f"{RESULT_FILE}.invalid-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    os.replace(src, dst)
    return dst


def clean_tmp(cells_root: Path) -> int:
    """Delete temporary files left by killed runs below ``cells_root``; return how many."""
    n = 0
    if Path(cells_root).is_dir():
        for p in Path(cells_root).glob("*/.*.tmp-*"):
            p.unlink(missing_ok=True)
            n += 1
    return n


def list_results(out: Path) -> list[dict[str, Any]]:
    """Every cell record under ``out/cells``, sorted by id.

    Raises
    ------
    ResultsError
        If ``out`` holds no results, or a record is corrupt (naming the file).
    """
    root = Path(out) / "cells"
    paths = sorted(root.glob(f"*/{RESULT_FILE}")) if root.is_dir() else []
    if not paths:
        raise ResultsError(f"no results in {out} (expected {root}/<cell>/{RESULT_FILE}); run `pyrobdl compare` first")
    records = []
    for p in paths:
        r = read_result(p)
        r["_dir"] = str(p.parent)
        records.append(r)
    return records
