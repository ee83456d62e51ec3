r"""The worker's half of a cell: :func:`compute_cell` runs one cell and returns its record and files.

Load data, build the model, :func:`pyrobdl.fit`, :func:`pyrobdl.diagnostics.evaluate` on the test
split (against the reference when the dataset names one) and
:func:`pyrobdl.diagnostics.fit_diagnostics` on the training split (PSIS-LOO, the VI Pareto k̂),
the artifacts' bytes, and finally the record; nothing is written here (the driver writes,
:func:`~pyrobdl.compare.runner.write_cell`).  A cell that raises is recorded with its error and the
stage it happened in.  The fit's and the evaluation's warnings are recorded in the cell's
``warnings`` as text.  :func:`crashed_result` is the record of a cell whose worker died.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import socket
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..diagnostics.inputs import spread_indices
from ..inference import fit
from ..inference.registry import get_method
from . import artifacts
from .grid import Cell, build_model
from .reference_cells import REFERENCE_DRAWS, combined_sha, reference_payload, resolution_of, stored_reference
from .sources import load_dataset
from .store import SCHEMA, jsonable, npz_bytes
from .tasks import ARRAYS, CELL_LOG, INFERENCE_DATA, CellResult, CellTask, _now, library_versions

__all__ = ["compute_cell", "crashed_result", "netcdf_bytes"]


def _data_info(data: Any, model: Any) -> dict[str, Any]:
    return {
        "name": data.name,
        "task": model.likelihood.task,
        "num_train": int(data.x_train.shape[0]),
        "num_test": int(data.x_test.shape[0]),
        "in_features": int(model.in_features),
        "out_features": int(model.out_features),
        "y_mean": float(getattr(data, "y_mean", 0.0)),
        "y_std": float(getattr(data, "y_std", 1.0)),
    }


def _evaluate(posterior: Any, data: Any, reference: Any, num_samples: int, seed: int,
              resolution: Any = None) -> dict[str, float]:
    from .. import diagnostics

    evaluate = getattr(diagnostics, "evaluate", None)
    if evaluate is None:
        raise RuntimeError("pyrobdl.diagnostics.evaluate is not available in this pyrobdl")
    kwargs: dict[str, Any] = {"reference": reference, "num_samples": num_samples, "seed": seed}
    if resolution is not None:
        kwargs["resolution"] = resolution
    if hasattr(data, "y_std"):
        kwargs.update(y_mean=float(data.y_mean), y_std=float(data.y_std))
    return dict(evaluate(posterior, data.x_test, data.y_test, **kwargs))


def _fit_diagnostics(posterior: Any, data: Any, num_samples: int, seed: int) -> dict[str, float]:
    from .. import diagnostics

    kwargs = {"y_std": float(data.y_std)} if hasattr(data, "y_std") else {}
    return dict(diagnostics.fit_diagnostics(posterior, data.x_train, data.y_train, num_samples=num_samples,
                                            seed=seed, **kwargs))


def _gradient_variance(posterior: Any, data: Any, kwargs: Mapping[str, Any]) -> Any:
    from .. import diagnostics

    table = diagnostics.gradient_variance(posterior.model, data.x_train, data.y_train, guide_params=posterior, **kwargs)
    return table.to_records() if callable(getattr(table, "to_records", None)) else table


def _inference_data(posterior: Any, data: Any, num_samples: int) -> Any:
    to_idata = getattr(posterior, "to_inference_data", None)
    if to_idata is None:
        raise RuntimeError(f"{type(posterior).__name__} has no to_inference_data")
    params = inspect.signature(to_idata).parameters
    kwargs = {"num_samples": num_samples} if "num_samples" in params else {}
    return to_idata(data.x_test, data.y_test, **kwargs)


def netcdf_bytes(idata: Any) -> bytes:
    """An ``InferenceData`` as the bytes of a netCDF-4 file (every group, numeric variables compressed).

    Compression: HDF5's byte shuffle, then zlib at level 1 — on the quickstart's 64-chain gap
    reference (118.5 MB raw) 70.5 MB in 1.97 CPU s, against zlib's default level 4 without the
    shuffle, 82.3 MB in 3.32 CPU s (measured 2026-11-28).

    Serialised in memory, so that only plain Python file writes touch the disk: HDF5 writing to
    a full disk raised and then crashed the process (segmentation fault while closing the file,
    measured with h5py 3.16 / h5netcdf 1.8 on a 300 kB tmpfs).  The bytes are read back once
    before they are returned (every group and variable, with its shape), so a file that would
    not open is never stored.
    """
    tree = idata.to_datatree()
    encoding = {
        node.path: {name: {"zlib": True, "complevel": 1, "shuffle": True} for name, var in node.dataset.variables.items()
                    if var.dtype.kind in "biuf"}
        for node in tree.subtree if node.has_data
    }
    buf = io.BytesIO()
    tree.to_netcdf(buf, engine="h5netcdf", encoding=encoding)
    blob = buf.getvalue()
    wanted = {node.path.strip("/"): {name: tuple(var.shape) for name, var in node.dataset.variables.items()}
              for node in tree.subtree if node.has_data}
    lost = _netcdf_differences(blob, wanted)
    if lost:
        raise RuntimeError(f"the netCDF serialisation lost or changed {', '.join(lost)}")
    return blob


def _netcdf_differences(blob: bytes, wanted: Mapping[str, Mapping[str, tuple]]) -> list[str]:
    """What of ``wanted`` (group -> variable -> shape) the netCDF file ``blob`` does not hold.

    Opened as the HDF5 file a netCDF-4 file is (h5py, which h5netcdf wrote it with): every group
    and variable is found as a dataset and its shape read from the file's own metadata.  Over the
    quickstart's 22 files 0.05 CPU s against 0.46 through h5netcdf (which resolves every
    variable's dimensions) and ~2.6 re-opening each as an xarray tree.
    """
    import h5py

    with h5py.File(io.BytesIO(blob), "r") as f:
        held: dict[str, dict[str, tuple]] = {"": {}}
        for name, obj in f.items():
            if isinstance(obj, h5py.Group):
                held[name] = {v: tuple(d.shape) for v, d in obj.items() if isinstance(d, h5py.Dataset)}
            else:
                held[""][name] = tuple(obj.shape)
    out = []
    for group, variables in wanted.items():
        if group not in held:
            out.append(f"group {group!r}")
            continue
        out += [f"{group}/{v} {list(shape)}" for v, shape in variables.items() if held[group].get(v) != shape]
    return out


def _load_reference(task: CellTask, data: Any, device: torch.device,
                    replicate: bool = False) -> tuple[Any, str, str | None]:
    """The reference posterior of ``task`` (or its replicate) from the draws the driver shipped, or
    (None, why not, None): :func:`~pyrobdl.compare.reference_cells.stored_reference`."""
    ref_id = str(task.cell.replicate if replicate else task.cell.reference)
    payload = (task.replicate if replicate else task.reference) or reference_payload(task.out, ref_id)
    return stored_reference(payload, Path(task.out) / "cells" / ref_id / REFERENCE_DRAWS,
                            lambda: build_model(task.reference_model or {}, data).to(device), str(task.reference_method))


def _resolution(task: CellTask, data: Any, reference: Any, device: torch.device, num_samples: int,
                seed: int) -> tuple[Any, str, str | None]:
    """The reference's resolution from its replicate's draws, or (None, why not, None); the third
    element is the replicate draws' checksum."""
    replicate, note, sha = _load_reference(task, data, device, replicate=True)
    if replicate is None:
        return None, note, None
    return resolution_of(replicate, reference, data, num_samples, seed), "", sha


def _warning_texts(stage: str, caught: Sequence[warnings.WarningMessage]) -> list[str]:
    return [f"{stage}: {w.category.__name__}: {w.message}" for w in caught]


def compute_cell(task: CellTask) -> CellResult:
    """Run one cell and return its record and files; never raises for a failure of the cell itself.

    The worker's half of a cell: nothing is written here (the driver writes, :func:`write_cell`).

    Parameters
    ----------
    task : CellTask

    Returns
    -------
    CellResult
        The record's ``status`` is ``"failed"`` (with the error, its traceback and the stage it
        happened in) when any step raised an ``Exception``.
    """
    from .._allocator import retain_freed_memory
    from ..inference.registry import DEFAULTS

    retain_freed_memory()  # the worker process (a pool's or Ray's) is the suite's: see pyrobdl._allocator

    saved_threads = (torch.get_num_threads(), DEFAULTS.get("threads"))
    if task.threads is not None:
        torch.set_num_threads(task.threads)
        DEFAULTS["threads"] = task.threads
    log = io.StringIO()
    try:
        if task.capture_output:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                return _compute_cell(task, log)
        return _compute_cell(task, log)
    finally:
        torch.set_num_threads(saved_threads[0])
        DEFAULTS["threads"] = saved_threads[1]


class _CellRun:
    """One cell being computed: its task, its record, its files' bytes and the stage it is in (a
    failure names it)."""

    def __init__(self, task: CellTask) -> None:
        self.task = task
        self.stage = "load data"
        self.files: dict[str, bytes] = {}
        self.record = _new_record(task.cell)

    def add_file(self, name: str, blob: bytes) -> str:
        self.files[name] = blob
        self.record["checksums"][name] = hashlib.sha256(blob).hexdigest()
        return name


def _new_record(cell: Cell) -> dict[str, Any]:
    spec = cell.spec
    return {
        "schema": SCHEMA, "id": cell.id, "status": "running", "suite": spec["suite"],
        "dataset": cell.dataset, "method": cell.method, "method_name": spec["method"]["name"],
        "split": cell.split, "seed": cell.seed, "is_reference": cell.is_reference,
        "is_replicate": cell.is_replicate,
        "config": spec, "config_hash": cell.config_hash, "published": spec["published"],
        "started_at": _now(), "host": socket.gethostname(), "versions": library_versions(),
        "metrics": {}, "train_metrics": {}, "exact_metrics": {}, "cost": None,
        "reference": {"cell": cell.reference, "used": False, "note": "", "certified": None},
        "certification": None, "warnings": [], "artifacts": {}, "checksums": {}, "error": None,
    }


def _compute_cell(task: CellTask, log: io.StringIO) -> CellResult:
    cell = task.cell
    spec = cell.spec
    start, cpu_start = time.perf_counter(), time.process_time()
    run = _CellRun(task)
    record = run.record
    try:
        data = _load_data(task)
        run.stage = "build model"
        model = build_model(spec["model"], data)
        record["data"] = {**_data_info(data, model),
                          "loaded_by": "driver (shipped)" if task.data is not None else "worker"}
        run.stage = "fit"
        posterior = _fit(run, model, data)
        data = data.to(posterior.model.device)
        n, seed = int(spec["num_eval_samples"]), cell.seed
        reference = resolution = None
        if cell.reference:
            reference, resolution = _reference_and_resolution(run, posterior, data, n, seed)
        _evaluate_and_store(run, posterior, data, reference, resolution, n, seed)
        record["status"] = "ok"
    except Exception as e:
        record["status"] = "failed"
        record["error"] = {
            "type": type(e).__name__, "message": str(e), "stage": run.stage,
            "traceback": traceback.format_exc(),
        }
    record["wall_time_s"] = time.perf_counter() - start
    record["cpu_time_s"] = time.process_time() - cpu_start
    record["finished_at"] = _now()
    if task.capture_output:
        record["artifacts"]["log"] = run.add_file(CELL_LOG, log.getvalue().encode("utf-8", "replace"))
    files = run.files
    try:
        record = json.loads(json.dumps(jsonable(record), allow_nan=False))
    except Exception as e:  # e.g. an unserialisable diagnostic: keep a record of the failure
        record = _failure_record(record, "write record", f"writing the record: {e}", traceback.format_exc())
        files = {}
    return CellResult(cell.id, record, files, time.perf_counter() - start)


def _load_data(task: CellTask) -> Any:
    """The cell's dataset split: shipped with the task, else loaded here from the data directory."""
    if task.data is not None:
        return task.data
    cell = task.cell
    ds = cell.spec["dataset"]
    try:
        return load_dataset(ds["source"], ds["options"], cell.split, task.data_dir, Path(task.base))
    except FileNotFoundError as e:
        if task.capture_output:  # a worker elsewhere: the data directory may not be visible there
            raise FileNotFoundError(f"{e} (on worker host {socket.gethostname()}; when workers cannot "
                                    "see the data directory, ship the data with --ship-data)") from e
        raise


def _fit(run: _CellRun, model: Any, data: Any) -> Any:
    """Fit the cell's method, certify it on held-back test inputs, and record what the fit reports."""
    task, record = run.task, run.record
    cell = task.cell
    spec = cell.spec
    cpu_fit = time.process_time()
    certifies_held_back = "certify_inputs" in get_method(spec["method"]["name"]).options
    # fit's warnings (not certified as a reference, a saturated sampler) belong in the record
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            options = dict(spec["method"]["options"])
            if task.checkpoint is not None:
                options["checkpoint"] = task.checkpoint
            if certifies_held_back:
                # certified at held-back inputs (and, with max_num_samples, sampled until certified
                # there): diagnostic_points test inputs spread over the test split
                held = spread_indices(data.x_test, int(options["diagnostic_points"]))
                options["certify_inputs"] = data.x_test[held]
            posterior = fit(
                model, data.x_train, data.y_train, spec["method"]["name"], seed=cell.seed,
                device=task.device, progress=task.progress, **options,
            )
        finally:
            record["warnings"] += _warning_texts("fit", caught)
    certification = getattr(posterior, "certification", None)
    if certification is not None and callable(getattr(posterior, "certify", None)):
        # the suite certifies on held-back inputs spread over the test split: the fit already
        # did (and warned) when it took them as certify_inputs; a chain method that does not is
        # certified here
        if not certifies_held_back:
            held = spread_indices(data.x_test, int(posterior.settings.get("diagnostic_points", 50)))
            certification = posterior.certify(data.x_test[held].to(posterior.model.device))
            if not certification.passed:
                record["warnings"].append(
                    f"certify: the {cell.method} posterior is not certified on held-back inputs: "
                    + "; ".join(certification.failures))
        # where: the test split's rows (the fit knew only the inputs' digest)
        certification = dataclasses.replace(certification, inputs={
            **(certification.inputs or {}), "source": "held-back inputs", "points": len(held), "indices": held})
        posterior.certification = certification
        if certifies_held_back:  # the fit's own certification, now with its rows
            posterior.diagnostics["certification"] = certification.to_dict()
    record["certification"] = certification.to_dict() if certification is not None else None
    record["cost"] = posterior.cost.to_dict()
    record["fit_cpu_time_s"] = time.process_time() - cpu_fit
    record["diagnostics"] = posterior.diagnostics
    record["settings"] = posterior.settings
    return posterior


def _reference_and_resolution(run: _CellRun, posterior: Any, data: Any, n: int, seed: int) -> tuple[Any, Any]:
    """The cell's reference posterior and (with a replicate) its resolution, each None when not
    available; what was used, and why not, goes into the record."""
    task, record = run.task, run.record
    cell = task.cell
    resolution = None
    run.stage = "load reference"
    reference, note, draws_sha = _load_reference(task, data, posterior.model.device)
    record["reference"].update(used=reference is not None, note=note, draws_sha256=draws_sha)
    if note:
        record["warnings"].append(note)
    if reference is not None:
        ref_cert = reference.certification
        record["reference"]["certified"] = bool(ref_cert.passed)
        if cell.replicate:
            run.stage = "reference resolution"
            resolution, rep_note, rep_sha = _resolution(task, data, reference, posterior.model.device, n, seed)
            record["reference"].update(replicate=cell.replicate, replicate_note=rep_note,
                                       resolution=resolution.to_dict() if resolution is not None else None)
            if rep_note:
                record["warnings"].append(rep_note)
            # a change of either run's draws makes this cell stale
            record["reference"]["draws_sha256"] = combined_sha(draws_sha, rep_sha)
        if not ref_cert.passed and resolution is None:
            record["warnings"].append(
                f"the reference {cell.reference} is not certified ({'; '.join(ref_cert.failures)}): "
                "agreement with it means nothing"
            )
        elif not ref_cert.passed:
            record["warnings"].append(
                f"the reference {cell.reference} is not certified ({'; '.join(ref_cert.failures)}): "
                f"agreement with it is read in units of its {resolution.summary()}"
            )
    return reference, resolution


def _evaluate_and_store(run: _CellRun, posterior: Any, data: Any, reference: Any, resolution: Any, n: int,
                        seed: int) -> None:
    """Score the posterior on the test split (and the training split), and add the cell's files."""
    cell, record = run.task.cell, run.record
    spec = cell.spec
    run.stage = "evaluate"
    t_eval = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        # said above in the record's own words
        warnings.filterwarnings("ignore", message="agreement with an uncertified reference", category=UserWarning)
        try:
            record["metrics"] = _evaluate(posterior, data, reference, n, seed, resolution)
        finally:
            record["warnings"] += _warning_texts("evaluate", caught)
    record["exact_metrics"] = artifacts.exact_posterior_metrics(posterior.model, posterior, data, n, seed)
    if spec.get("fit_diagnostics", True):
        run.stage = "fit diagnostics"
        try:
            record["train_metrics"] = _fit_diagnostics(posterior, data, n, seed)
        except Exception as e:  # e.g. PSIS on degenerate draws: the test metrics stand
            record["warnings"].append(f"fit_diagnostics: {type(e).__name__}: {e}")
    run.stage = "artifacts"
    arrays: dict[str, Any] = {"history": np.asarray(posterior.history, dtype=np.float64)}
    arrays.update(artifacts.predictive_band(posterior, data, n, seed))
    arrays.update(artifacts.calibration_curve(posterior, data, n, seed))
    record["artifacts"]["arrays"] = run.add_file(ARRAYS, npz_bytes(arrays))
    record["eval_time_s"] = time.perf_counter() - t_eval
    if spec.get("gradient_variance") is not None:
        run.stage = "gradient variance"
        try:
            record["gradient_variance"] = _gradient_variance(posterior, data, spec["gradient_variance"])
        except Exception as e:  # a diagnostic that does not apply to this posterior
            record["warnings"].append(f"gradient_variance: {type(e).__name__}: {e}")
    if cell.is_reference or cell.is_replicate:
        run.stage = "save reference draws"
        record["artifacts"]["reference_draws"] = run.add_file(REFERENCE_DRAWS,
                                                              artifacts.draws_bytes(posterior, n, seed))
    if spec.get("inference_data", True):
        run.stage = "inference data"
        try:
            idata = _inference_data(posterior, data, n)
        except Exception as e:  # a posterior without ArviZ data: metrics stand, the record says why
            idata = None
            record["warnings"].append(f"inference_data: {type(e).__name__}: {e}")
        if idata is not None:  # a failed serialisation fails the cell
            record["artifacts"]["inference_data"] = run.add_file(INFERENCE_DATA, netcdf_bytes(idata))


def _failure_record(record: Mapping[str, Any], stage: str, message: str, tb: str = "",
                    error_type: str | None = None) -> dict[str, Any]:
    """A minimal failed record keeping the cell's identity (when the full one cannot be kept)."""
    keep = {k: record[k] for k in ("schema", "id", "dataset", "method", "split", "seed", "config_hash", "config")
            if k in record}
    keep.update(status="failed", error={"type": error_type or "RuntimeError", "message": message, "stage": stage,
                                        "traceback": tb})
    return json.loads(json.dumps(jsonable(keep), allow_nan=False))


def crashed_result(task: CellTask, message: str) -> CellResult:
    """The failed result of a cell whose worker died (and whose retries were spent)."""
    cell = task.cell
    record = {"schema": SCHEMA, "id": cell.id, "dataset": cell.dataset, "method": cell.method,
              "split": cell.split, "seed": cell.seed, "config_hash": cell.config_hash, "config": cell.spec}
    return CellResult(cell.id, _failure_record(record, "worker", message, error_type="WorkerCrashed"), {})
