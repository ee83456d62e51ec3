r"""The results folder: one directory per cell, every file written atomically and checksummed.

Layout of ``OUT/``::

    .pyrobdl.lock             held (``fcntl.flock``) by the one run writing here; see lock.py
    suite.toml                the suite file as given (copied on every run)
    cells.json                the suite's grid: cell id -> config hash (the report reads these cells only)
    cells/<cell id>/
        result.json           the record of the cell; written LAST: its presence marks the cell done
        arrays.npz            ELBO history, predictive bands (1-D data), calibration curve
        inference_data.nc     ArviZ InferenceData (netCDF), when the suite asks for it
        reference_draws.pt    posterior draws, for cells other cells use as their reference

Every file is serialised in memory, written to a temporary name in the same folder
(``.<name>.tmp-<run>-<pid>-<random>``: the run that owns it is in its name), flushed to disk, then
renamed with :func:`os.replace`, which is atomic on POSIX and Windows.  A process killed at any
moment (even ``kill -9``) therefore leaves either the previous complete file or none, plus at most
a stray temporary file, which a later run deletes once the process that owns it is gone.  Since
``result.json`` is written last and holds the SHA-256 of every other file of the cell
(``checksums``), a cell killed before it is simply run again, and a file damaged later is noticed.
A write that fails (a full disk, an I/O error, a permission) raises :class:`WriteError` naming
the file; nothing half-written is renamed into place.

Resume policy (:func:`cell_state`):

* ``ok``: a valid record with status ``ok`` for the same resolved configuration whose artifacts
  match their checksums (and, for a cell scored against a reference, whose reference draws are
  still the ones it was scored against): skipped.
* ``failed``: a valid record of a failed cell: run again (the failure may have been transient or
  fixed since).
* ``missing``: no record: run.
* ``incomplete``: an ``ok`` record evaluated without its reference posterior because the reference
  was not available then: run again.
* ``damaged``: an ``ok`` record whose artifact is missing or does not match its checksum: run again.
* ``stale_reference``: an ``ok`` record scored against reference draws that have since changed
  (refitted, or damaged and redone): run again.
* ``stale``: a record of a different configuration (the suite, a default option or the code's
  record schema changed) and ``corrupt``: an unreadable record, or one whose ``config`` does not
  hash to its ``config_hash`` or that describes another cell.  Both stop the run with an error
  naming the files, before anything runs, unless ``rerun_invalid`` is set, in which case the old
  record is renamed to ``result.json.invalid-<timestamp>`` and the cell runs again.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from .._io import WriteError, atomic_write, atomic_write_bytes, file_sha256, new_run_id
from .._validation import MAX_NESTING, nesting_depth

__all__ = [
    "RESULT_FILE",
    "RUN_STATES",
    "SCHEMA",
    "ResultsError",
    "WriteError",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "cell_state",
    "clean_tmp",
    "config_hash",
    "file_sha256",
    "jsonable",
    "list_results",
    "new_run_id",
    "read_result",
    "verify_artifacts",
]

#: Version tag of the result record; bump when its fields change meaning.
#: ``/2``: every artifact's SHA-256 in ``checksums``; ``reference.draws_sha256``.
SCHEMA = "pyrobdl.cell/2"
RESULT_FILE = "result.json"
_REQUIRED_FIELDS = ("schema", "id", "status", "dataset", "method", "split", "seed", "config_hash")
#: States :func:`cell_state` returns that mean "run this cell (again)".
RUN_STATES = ("missing", "failed", "incomplete", "damaged", "stale_reference")
_TMP = re.compile(r"^\..+\.tmp-(r[0-9a-f]{12})-(\d+)-[0-9a-f]{8}$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


class ResultsError(RuntimeError):
    """A results folder that cannot be used as is (corrupt or stale records, nothing to report)."""


def config_hash(spec: Mapping[str, Any]) -> str:
    """SHA-256 of a resolved cell configuration (canonical JSON, sorted keys)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


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


def atomic_write_json(path: Path, record: Mapping[str, Any], *, owner: str | None = None) -> str:
    """Write ``record`` (made JSON-safe with :func:`jsonable`) atomically as strict JSON; return its SHA-256.

    Raises
    ------
    WriteError
        If the file cannot be written (naming it).
    """
    text = json.dumps(jsonable(record), indent=1, allow_nan=False, sort_keys=False)
    return atomic_write_bytes(path, (text + "\n").encode("utf-8"), owner=owner)


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """A compressed ``.npz`` file's bytes."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return buf.getvalue()


def atomic_save_npz(path: Path, arrays: Mapping[str, np.ndarray], *, owner: str | None = None) -> str:
    """Write a compressed ``.npz`` atomically; return its SHA-256."""
    return atomic_write_bytes(path, npz_bytes(arrays), owner=owner)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


#: A file name an artifact may have: a plain name inside the cell's folder.
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _type_problems(record: Mapping[str, Any]) -> list[str]:
    """Fields of a record whose type is not what the runner writes (what a report would trip on)."""
    bad = []
    for key in ("id", "dataset", "method", "schema"):
        if not isinstance(record[key], str):
            bad.append(f"{key} must be a string")
    if record["status"] not in ("ok", "failed"):
        bad.append(f"status must be 'ok' or 'failed', got {str(record['status'])[:40]!r}")
    for key in ("split", "seed"):
        if not _is_int(record[key]) or record[key] < 0:
            bad.append(f"{key} must be an integer >= 0")
    if not isinstance(record["config_hash"], str) or not _SHA.match(record["config_hash"]):
        bad.append("config_hash must be 64 hex digits")
    if not isinstance(record.get("config"), dict):
        bad.append("config must be an object")
    for key in ("metrics", "train_metrics", "exact_metrics"):
        v = record.get(key, {})
        if not isinstance(v, dict) or not all(_is_scalar(x) for x in v.values()):
            bad.append(f"{key} must be an object of numbers")
    for key in ("artifacts", "checksums"):
        v = record.get(key, {})
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
            bad.append(f"{key} must be an object of strings")
        elif key == "artifacts" and not all(_ARTIFACT_NAME.match(x) for x in v.values()):
            bad.append("artifacts must name plain files inside the cell's folder")
    for key in ("reference", "cost", "data", "diagnostics", "settings", "versions"):
        if record.get(key) is not None and not isinstance(record.get(key), dict):
            bad.append(f"{key} must be an object or null")
    if record.get("error") is not None and not isinstance(record["error"], dict):
        bad.append("error must be an object or null")
    for key in ("warnings", "published"):
        v = record.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            bad.append(f"{key} must be a list of strings")
    for key in ("wall_time_s", "cpu_time_s", "fit_cpu_time_s", "eval_time_s"):
        if not _is_number_or_null(record.get(key)):
            bad.append(f"{key} must be a number or null")
    cost = record.get("cost")
    if isinstance(cost, dict):
        for key in ("wall_time_s", "gradient_evaluations", "epochs", "peak_memory_bytes"):
            if not _is_number_or_null(cost.get(key)):
                bad.append(f"cost.{key} must be a number or null")
    for key in ("suite", "host"):
        if not isinstance(record.get(key, ""), str):
            bad.append(f"{key} must be a string")
    if not isinstance(record.get("is_reference", False), bool):
        bad.append("is_reference must be true or false")
    return bad


def _is_number_or_null(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def read_result(path: Path) -> dict[str, Any]:
    """Read one cell record and check the types of its fields.

    Raises
    ------
    ResultsError
        If the file is not valid JSON, is nested absurdly deep, is not a record of this schema,
        lacks a field or has a field of the wrong type; the message names the file.
    """
    try:
        record = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ResultsError(f"corrupt result file {path}: {reason}") from None
    if not isinstance(record, dict):
        raise ResultsError(f"corrupt result file {path}: not a JSON object")
    if nesting_depth(record) > MAX_NESTING:
        raise ResultsError(f"corrupt result file {path}: nested deeper than {MAX_NESTING} levels")
    missing = [k for k in _REQUIRED_FIELDS if k not in record]
    if missing:
        raise ResultsError(f"corrupt result file {path}: missing field(s) {missing}")
    if record["schema"] != SCHEMA:
        raise ResultsError(f"result file {path} has schema {str(record['schema'])[:40]!r}; this pyrobdl reads {SCHEMA!r}")
    bad = _type_problems(record)
    if bad:
        raise ResultsError(f"corrupt result file {path}: {'; '.join(bad)}")
    return record


def check_identity(record: Mapping[str, Any], path: Path) -> None:
    """Refuse a record that describes another cell or whose ``config`` was edited.

    Raises
    ------
    ResultsError
        If its labels are not valid labels, its ``id`` is not the id of its dataset, method,
        split and seed or not its folder's name, or its ``config`` does not hash to its
        ``config_hash`` (naming the file).
    """
    from .config import label_problem

    folder = Path(path).parent.name
    for key in ("dataset", "method"):
        why = label_problem(record[key])
        if why:
            raise ResultsError(f"corrupt result file {path}: {key}: {why}")
    expected = f"{record['dataset']}__{record['method']}__split-{record['split']}__seed-{record['seed']}"
    if record["id"] != expected:
        raise ResultsError(f"corrupt result file {path}: its id does not match its dataset, method, split and seed")
    if record["id"] != folder:
        raise ResultsError(f"corrupt result file {path}: it is the record of cell {str(record['id'])[:80]!r}, "
                           f"not of the folder it is in ({folder!r})")
    if config_hash(record["config"]) != record["config_hash"]:
        raise ResultsError(f"corrupt result file {path}: its config does not hash to its config_hash "
                           "(the record was edited or damaged)")


def verify_artifacts(record: Mapping[str, Any], cell_dir: Path) -> list[str]:
    """Problems with a record's artifacts: missing files, missing checksums, checksum mismatches.

    Returns
    -------
    list of str
        One line per problem, each naming the file; empty when every artifact matches.
    """
    problems = []
    checksums = record.get("checksums") or {}
    for name in (record.get("artifacts") or {}).values():
        path = Path(cell_dir) / name
        expected = checksums.get(name)
        if expected is None:
            problems.append(f"{path} has no checksum in its record")
        elif not path.is_file():
            problems.append(f"{path} is missing")
        else:
            try:
                actual = file_sha256(path)
            except OSError as e:
                problems.append(f"{path} cannot be read: {e.strerror or e}")
                continue
            if actual != expected:
                problems.append(f"{path} does not match its checksum (damaged or replaced)")
            elif path.suffix == ".npz":
                problems += _npz_problems(path)
    return problems


def _npz_problems(path: Path) -> list[str]:
    """An NPZ artifact must hold plain numeric arrays: an object array (which only unpickling
    could read) is refused, even with a matching checksum (a forged record and file)."""
    import zipfile

    try:
        with path.open("rb") as fh:
            data = np.load(fh, allow_pickle=False)
            if not hasattr(data, "files"):
                return [f"{path} is not an NPZ archive"]
            with data:
                for key in data.files:
                    if data[key].dtype.kind not in "biufc":
                        return [f"{path}: array {key[:40]!r} is not numeric (dtype {data[key].dtype})"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        return [f"{path} is not a numeric NPZ file ({type(e).__name__}: {str(e)[:100]})"]
    return []


def cell_state(cell_dir: Path, config_hash: str, needs_reference: bool,
               reference_sha256: str | None = None) -> tuple[str, str]:
    """State of a cell's folder for resuming, and a reason; see the module docstring.

    Parameters
    ----------
    cell_dir : pathlib.Path
        The cell's folder.
    config_hash : str
        The hash of the cell's current resolved configuration.
    needs_reference : bool
        Whether the cell is scored against a reference.
    reference_sha256 : str, optional
        SHA-256 of the reference draws as its cell now records them; a record scored against
        other draws is ``stale_reference``.
    """
    path = Path(cell_dir) / RESULT_FILE
    if not path.exists():
        return "missing", ""
    try:
        record = read_result(path)
        check_identity(record, path)
    except ResultsError as e:
        return "corrupt", str(e)
    if record["config_hash"] != config_hash:
        return "stale", (
            f"result file {path} was produced by a different configuration "
            f"(stored hash {record['config_hash'][:12]}, current {config_hash[:12]})"
        )
    if record["status"] != "ok":
        return "failed", str((record.get("error") or {}).get("message", ""))[:500]
    problems = verify_artifacts(record, cell_dir)
    if problems:
        return "damaged", "; ".join(problems)
    ref = record.get("reference") or {}
    if needs_reference and not ref.get("used", False):
        return "incomplete", "evaluated without its reference posterior"
    if needs_reference and reference_sha256 is not None and ref.get("draws_sha256") != reference_sha256:
        return "stale_reference", "scored against reference draws that have changed since"
    return "ok", ""


def reference_draws_sha256(cell_dir: Path, draws_file: str) -> str | None:
    """The checksum of a reference cell's draws as its valid ``ok`` record gives it, else None."""
    try:
        record = read_result(Path(cell_dir) / RESULT_FILE)
    except ResultsError:
        return None
    if record["status"] != "ok":
        return None
    return (record.get("checksums") or {}).get(draws_file)


def set_aside(cell_dir: Path) -> Path:
    """Rename an invalid record out of the way (``result.json.invalid-<timestamp>``)."""
    src = Path(cell_dir) / RESULT_FILE
    dst = src.with_name(f"{RESULT_FILE}.invalid-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    try:
        os.replace(src, dst)
    except OSError as e:
        raise WriteError(str(src), f"cannot set it aside: {e.strerror or e}") from e
    return dst


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def clean_tmp(cells_root: Path, run_id: str | None = None) -> int:
    """Delete pyrobdl's own temporary files below ``cells_root`` that no live process owns.

    Only names of the form ``.<file>.tmp-<run>-<pid>-<random>`` are considered; any other file
    (a user's, or another program's) is never touched.  With ``run_id``, only that run's files
    are deleted (its writers have all finished); without, files whose owning process is no
    longer alive on this machine (a run killed earlier).

    Returns
    -------
    int
        How many files were deleted.
    """
    n = 0
    root = Path(cells_root)
    if not root.is_dir():
        return 0
    for p in root.glob("*/.*.tmp-*"):
        m = _TMP.match(p.name)
        if m is None:
            continue
        owner, pid = m.group(1), int(m.group(2))
        if (owner == run_id) if run_id is not None else not _pid_alive(pid):
            try:
                p.unlink()
                n += 1
            except FileNotFoundError:
                pass
    return n


MANIFEST = "cells.json"
MANIFEST_SCHEMA = "pyrobdl.cells/1"


def write_manifest(out: Path, suite_name: str, cells: Mapping[str, str], *, owner: str | None = None) -> None:
    """Record the suite's grid (cell id -> config hash) in ``out/cells.json``, for the report."""
    atomic_write_json(Path(out) / MANIFEST, {"schema": MANIFEST_SCHEMA, "suite": suite_name, "cells": dict(cells)},
                      owner=owner)


def read_manifest(out: Path) -> dict[str, str] | None:
    """The grid recorded by :func:`write_manifest`, or None when the folder has none.

    Raises
    ------
    ResultsError
        If the file exists but is not a valid manifest.
    """
    path = Path(out) / MANIFEST
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ResultsError(f"corrupt suite manifest {path}: {type(e).__name__}") from None
    cells = doc.get("cells") if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("schema") != MANIFEST_SCHEMA or not isinstance(cells, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in cells.items())):
        raise ResultsError(f"corrupt suite manifest {path}: not a {MANIFEST_SCHEMA} file")
    return cells


def scan_results(out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records the report may use, verified, and the cell folders it skips with the reason.

    Every record is read with its types checked, must sit in the folder named by its id, must
    hash to its ``config_hash``, and an ``ok`` record's artifacts must match their checksums.
    When the folder has a suite manifest (``cells.json``, written by every run) only the cells of
    that suite with its current configuration are used; others are skipped and listed.

    Returns
    -------
    records : list of dict
        Sorted by id; each with ``_dir``, its folder.
    skipped : list of str
        ``"<folder>: <why>"`` per skipped cell folder.

    Raises
    ------
    ResultsError
        If ``out`` holds no results, or a record or an artifact is corrupt (naming the file).
    """
    root = Path(out) / "cells"
    paths = sorted(root.glob(f"*/{RESULT_FILE}")) if root.is_dir() else []
    if not paths:
        raise ResultsError(f"no results in {out} (expected {root}/<cell>/{RESULT_FILE}); run `pyrobdl compare` first")
    manifest = read_manifest(out)
    records, skipped = [], []
    for p in paths:
        name = p.parent.name
        if manifest is not None and name not in manifest:
            skipped.append(f"{name}: not a cell of the suite stored with the results")
            continue
        r = read_result(p)
        check_identity(r, p)
        if manifest is not None and manifest[name] != r["config_hash"]:
            skipped.append(f"{name}: produced by another configuration than the suite stored with the results")
            continue
        if r["status"] == "ok":
            problems = verify_artifacts(r, p.parent)
            if problems:
                raise ResultsError("corrupt cell: " + "; ".join(problems))
        r["_dir"] = str(p.parent)
        records.append(r)
    if not records:
        raise ResultsError(f"no results of the suite stored in {out}: {len(skipped)} cell folder(s) skipped:\n  "
                           + "\n  ".join(skipped))
    return records, skipped


def list_results(out: Path) -> list[dict[str, Any]]:
    """Every verified cell record of the suite stored in ``out``, sorted by id (:func:`scan_results`).

    Raises
    ------
    ResultsError
        If ``out`` holds no results, or a record or an artifact is corrupt (naming the file).
    """
    return scan_results(out)[0]
