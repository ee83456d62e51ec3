r"""The runner: plan a suite's grid, run its cells through an executor, record each atomically.

:func:`run_suite` validates everything it can before the first fit (the suite file, the
``--only`` filter, data loading, model construction and each method's own ``check_model``),
decides from the results folder which cells are already done (see :mod:`pyrobdl.compare.store`
for the resume policy), runs the reference cells first and then the rest, and returns a
:class:`RunSummary`.  :func:`compute_cell` is the unit of work, run by a worker (in this process,
another process or a Ray node): load data, build the model,
:func:`pyrobdl.fit`, :func:`pyrobdl.diagnostics.evaluate` on the test split (against the
reference when the dataset names one) and :func:`pyrobdl.diagnostics.fit_diagnostics` on the
training split (PSIS-LOO, the VI Pareto k̂), the artifacts' bytes, and finally the record; it writes
nothing.  :func:`write_cell`, in the driver only, writes them into the results folder.  A cell that raises is
recorded with its error and the others go on.  The fit's and the evaluation's warnings (e.g. "not
certified as a reference", a saturated sampler) are recorded in the cell's ``warnings`` as text; a
cell evaluated against a reference whose certification failed, or was never recorded, says so there
and in ``reference.certified``.  Nothing here depends on which method a cell runs: methods are
looked up in the registry and only used through the posterior contract.

The results folder is guarded as :mod:`pyrobdl.compare.store` and :mod:`pyrobdl.compare.lock`
describe: ``--out`` is checked before any work, the run holds the folder's lock throughout,
every artifact's checksum goes into the record, a dependent cell records the checksum of the
reference draws it was scored against (and is redone when they change), and a file that cannot be
written (:class:`~pyrobdl.compare.store.WriteError`) stops the run instead of failing the cell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import inspect
import io
import json
import platform
import socket
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .. import __version__
from ..diagnostics.inputs import spread_indices
from ..inference import fit
from ..inference.registry import get_method
from . import artifacts
from .config import Suite
from .executors import Executor, InProcessExecutor
from .grid import Cell, build_model, check_plan, describe, expand, select
from .lock import RunLock, check_out_contents, check_out_folder
from .reference_cells import (
    REFERENCE_DRAWS,
    ReferencePayload,
    combined_sha,
    reference_payload,
    resolution_of,
    stored_reference,
)
from .sources import load_dataset
from .store import (
    RESULT_FILE,
    SCHEMA,
    ResultsError,
    WriteError,
    atomic_write_bytes,
    atomic_write_json,
    jsonable,
    cell_state,
    clean_tmp,
    new_run_id,
    npz_bytes,
    reference_draws_sha256,
    set_aside,
    write_manifest,
)

__all__ = [
    "CellOutcome", "CellResult", "CellTask", "ReferencePayload", "RunSummary", "compute_cell", "crashed_result",
    "library_versions", "reference_payload", "run_cell", "run_suite", "write_cell",
]

CELL_LOG = "cell.log"
INFERENCE_DATA = "inference_data.nc"
ARRAYS = "arrays.npz"
#: Folder of the results folder holding in-process cells' fit checkpoints (:attr:`CellTask.checkpoint`).
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class CellResult:
    """What a worker returns: the cell's record and the bytes of its files.

    The driver writes them (:func:`write_cell`): workers never touch the results folder, so a
    results folder does not depend on a shared file system, and one process holds its lock.

    Attributes
    ----------
    cell_id : str
    record : dict
        The record, JSON types only, with the SHA-256 of every file in ``files`` under
        ``checksums``.
    files : dict of str to bytes
        File name (in the cell's folder) -> contents.
    wall_time_s : float
        Seconds the worker spent on the cell.
    """

    cell_id: str
    record: dict[str, Any]
    files: dict[str, bytes]
    wall_time_s: float = 0.0


@dataclass(frozen=True)
class CellTask:
    """Everything a worker needs to run one cell (picklable).

    Attributes
    ----------
    cell : Cell
        The cell.
    out : str
        Results folder.
    data_dir : str or None
        Datasets root.
    base : str
        Folder of the suite file (relative paths in the suite).
    device : str or None
        Device override.
    progress : bool
        Show the fit's own progress bar.
    reference_model : Mapping or None
        Model spec of the reference cell (its draws are read from its folder).
    reference_method : str or None
        Registry name of the reference cell's method.
    run_id : str
        Id of the run (:func:`~pyrobdl.compare.store.new_run_id`); names its temporary files.
    reference : ReferencePayload or None
        The reference cell's record and draws, read and verified by the driver (a worker never
        reads the results folder).
    data : object or None
        The cell's dataset split, loaded by the driver and shipped with the task (``ship_data``);
        None: the worker loads it from ``data_dir``.
    threads : int or None
        torch threads for the cell (and ``fit``'s default); None leaves the process's setting.
    capture_output : bool
        Capture the cell's stdout and stderr into its ``cell.log`` instead of the console (for
        workers in other processes, whose output would interleave).
    replicate : ReferencePayload or None
        The reference replicate's record and draws (``reference_replicates = 2``): with the
        reference's, the reference's resolution.
    checkpoint : str or None
        Where the fit keeps its resumable state (methods with a ``checkpoint`` option, e.g.
        ``"chees"``): set by the driver for cells run in its own process, so a run killed inside
        a long reference cell resumes that cell where it stopped; removed once the cell's record
        is written with status ok.  None: no checkpoint (a worker elsewhere never writes into
        the results folder).
    """

    cell: Cell
    out: str
    data_dir: str | None
    base: str
    device: str | None
    progress: bool
    reference_model: Mapping[str, Any] | None = None
    reference_method: str | None = None
    run_id: str = ""
    reference: ReferencePayload | None = None
    data: Any = None
    threads: int | None = None
    capture_output: bool = False
    checkpoint: str | None = None
    replicate: ReferencePayload | None = None


@dataclass(frozen=True)
class CellOutcome:
    """What a worker reports back.

    Attributes
    ----------
    cell_id : str
    status : {"ok", "failed"}
    error : str
        ``"Type: message"`` of a failure, empty otherwise.
    wall_time_s : float
        Seconds the whole cell took (fit, evaluation and writing).
    """

    cell_id: str
    status: str
    error: str = ""
    wall_time_s: float = 0.0


@dataclass(frozen=True)
class RunSummary:
    """Result of :func:`run_suite`.

    Attributes
    ----------
    out : pathlib.Path
        Results folder.
    total : int
        Cells in the (filtered) grid.
    skipped : tuple of str
        Cells already done.
    ok, failed : tuple of str
        Cells run now, by outcome.
    errors : Mapping[str, str]
        Cell id -> error of the failed ones.
    wall_time_s : float
        Seconds the run took.
    """

    out: Path
    total: int
    skipped: tuple[str, ...]
    ok: tuple[str, ...]
    failed: tuple[str, ...]
    errors: Mapping[str, str] = field(default_factory=dict)
    wall_time_s: float = 0.0

    @property
    def success(self) -> bool:
        """True when no cell failed."""
        return not self.failed


def library_versions() -> dict[str, str]:
    """Versions of Python, the platform and the libraries a result depends on."""
    import arviz
    import pyro

    versions = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "pyrobdl": __version__,
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "arviz": arviz.__version__,
        "numpy": np.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }
    if torch.cuda.is_available():
        versions["cuda_device"] = torch.cuda.get_device_name(0)
        versions["cuda"] = str(torch.version.cuda)
    return versions


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
    """An ``InferenceData`` as the bytes of a netCDF-4 file (every group, numeric variables zlib-compressed).

    Serialised in memory, so that only plain Python file writes touch the disk: HDF5 writing to
    a full disk raised and then crashed the process (segmentation fault while closing the file,
    measured with h5py 3.16 / h5netcdf 1.8 on a 300 kB tmpfs).  The bytes are read back once
    before they are returned, so a file that would not open is never stored.
    """
    import xarray as xr

    tree = idata.to_datatree()
    encoding = {
        node.path: {name: {"zlib": True} for name, var in node.dataset.variables.items()
                    if var.dtype.kind in "biuf"}
        for node in tree.subtree if node.has_data
    }
    buf = io.BytesIO()
    tree.to_netcdf(buf, engine="h5netcdf", encoding=encoding)
    blob = buf.getvalue()
    with xr.open_datatree(io.BytesIO(blob), engine="h5netcdf") as back:
        missing = sorted({n.path for n in tree.subtree if n.has_data} - {n.path for n in back.subtree if n.has_data})
    if missing:
        raise RuntimeError(f"the netCDF serialisation lost group(s) {missing}")
    return blob


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
    from ..inference.registry import DEFAULTS

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


def _compute_cell(task: CellTask, log: io.StringIO) -> CellResult:
    cell = task.cell
    spec = cell.spec
    start, cpu_start = time.perf_counter(), time.process_time()
    files: dict[str, bytes] = {}

    def add_file(name: str, blob: bytes) -> str:
        files[name] = blob
        record["checksums"][name] = hashlib.sha256(blob).hexdigest()
        return name

    record: dict[str, Any] = {
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
    stage = "load data"
    try:
        ds = spec["dataset"]
        if task.data is not None:
            data = task.data
        else:
            try:
                data = load_dataset(ds["source"], ds["options"], cell.split, task.data_dir, Path(task.base))
            except FileNotFoundError as e:
                if task.capture_output:  # a worker elsewhere: the data directory may not be visible there
                    raise FileNotFoundError(f"{e} (on worker host {socket.gethostname()}; when workers cannot "
                                            "see the data directory, ship the data with --ship-data)") from e
                raise
        stage = "build model"
        model = build_model(spec["model"], data)
        record["data"] = {**_data_info(data, model),
                          "loaded_by": "driver (shipped)" if task.data is not None else "worker"}
        stage = "fit"
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
        data = data.to(posterior.model.device)
        n, seed = int(spec["num_eval_samples"]), cell.seed
        reference = resolution = None
        if cell.reference:
            stage = "load reference"
            reference, note, draws_sha = _load_reference(task, data, posterior.model.device)
            record["reference"].update(used=reference is not None, note=note, draws_sha256=draws_sha)
            if note:
                record["warnings"].append(note)
            if reference is not None:
                ref_cert = reference.certification
                record["reference"]["certified"] = bool(ref_cert.passed)
                if cell.replicate:
                    stage = "reference resolution"
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
        stage = "evaluate"
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
            stage = "fit diagnostics"
            try:
                record["train_metrics"] = _fit_diagnostics(posterior, data, n, seed)
            except Exception as e:  # e.g. PSIS on degenerate draws: the test metrics stand
                record["warnings"].append(f"fit_diagnostics: {type(e).__name__}: {e}")
        stage = "artifacts"
        arrays: dict[str, Any] = {"history": np.asarray(posterior.history, dtype=np.float64)}
        arrays.update(artifacts.predictive_band(posterior, data, n, seed))
        arrays.update(artifacts.calibration_curve(posterior, data, n, seed))
        record["artifacts"]["arrays"] = add_file(ARRAYS, npz_bytes(arrays))
        record["eval_time_s"] = time.perf_counter() - t_eval
        if spec.get("gradient_variance") is not None:
            stage = "gradient variance"
            try:
                record["gradient_variance"] = _gradient_variance(posterior, data, spec["gradient_variance"])
            except Exception as e:  # a diagnostic that does not apply to this posterior
                record["warnings"].append(f"gradient_variance: {type(e).__name__}: {e}")
        if cell.is_reference or cell.is_replicate:
            stage = "save reference draws"
            record["artifacts"]["reference_draws"] = add_file(REFERENCE_DRAWS, artifacts.draws_bytes(posterior, n, seed))
        if spec.get("inference_data", True):
            stage = "inference data"
            try:
                idata = _inference_data(posterior, data, n)
            except Exception as e:  # a posterior without ArviZ data: metrics stand, the record says why
                idata = None
                record["warnings"].append(f"inference_data: {type(e).__name__}: {e}")
            if idata is not None:  # a failed serialisation fails the cell
                record["artifacts"]["inference_data"] = add_file(INFERENCE_DATA, netcdf_bytes(idata))
        record["status"] = "ok"
    except Exception as e:
        record["status"] = "failed"
        record["error"] = {
            "type": type(e).__name__, "message": str(e), "stage": stage,
            "traceback": traceback.format_exc(),
        }
    record["wall_time_s"] = time.perf_counter() - start
    record["cpu_time_s"] = time.process_time() - cpu_start
    record["finished_at"] = _now()
    if task.capture_output:
        record["artifacts"]["log"] = add_file(CELL_LOG, log.getvalue().encode("utf-8", "replace"))
    try:
        record = json.loads(json.dumps(jsonable(record), allow_nan=False))
    except Exception as e:  # e.g. an unserialisable diagnostic: keep a record of the failure
        record = _failure_record(record, "write record", f"writing the record: {e}", traceback.format_exc())
        files = {}
    return CellResult(cell.id, record, files, time.perf_counter() - start)


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


def write_cell(out: str | Path, result: CellResult, *, owner: str | None = None) -> CellOutcome:
    """Write a worker's :class:`CellResult` into the results folder (driver side).

    Every file is written atomically first and its checksum checked against the record's; the
    record (``result.json``) is written last, so a cell counts as done only once all its files are
    in place.

    Raises
    ------
    WriteError
        When a file cannot be written (full disk, I/O or permission error): that is not a failure
        of the cell but of the results folder, and the run must stop.  No record is written then,
        so the cell is not counted as done.
    ResultsError
        When a file's bytes do not match the checksum the worker recorded (corrupted in transit).
    """
    folder = Path(out) / "cells" / result.cell_id
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(str(folder), f"[Errno {e.errno}] {e.strerror or e}") from e
    checksums = result.record.get("checksums") or {}
    for name, blob in result.files.items():
        sha = atomic_write_bytes(folder / name, blob, owner=owner)
        if checksums.get(name) != sha:
            raise ResultsError(f"{folder / name}: the bytes received do not match the worker's checksum")
    atomic_write_json(folder / RESULT_FILE, result.record, owner=owner)
    record = result.record
    if record["status"] == "ok":
        # the record holds the result now, so the cell's fit checkpoints (CellTask.checkpoint, of
        # this and earlier configurations) go; a failed cell keeps them, so a rerun resumes
        for path in (Path(out) / CHECKPOINTS).glob(f"{glob.escape(result.cell_id)}--*.pt*"):
            path.unlink(missing_ok=True)
    err = record.get("error") or {}
    return CellOutcome(
        result.cell_id, record["status"], f"{err.get('type')}: {err.get('message')}" if err else "",
        float(record.get("wall_time_s", result.wall_time_s) or result.wall_time_s),
    )


def run_cell(task: CellTask) -> CellOutcome:
    """Run one cell in this process and write it: :func:`compute_cell` then :func:`write_cell`.

    Raises
    ------
    WriteError
        When a file of the cell cannot be written (see :func:`write_cell`).
    """
    return write_cell(task.out, compute_cell(task), owner=task.run_id or None)


def _tqdm(**kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(**kwargs)


def run_suite(
    suite: Suite,
    out: str | Path,
    *,
    data_dir: str | None = None,
    device: str | None = None,
    only: Mapping[str, Sequence[str]] | None = None,
    executor: Executor | None = None,
    progress: bool = True,
    rerun_invalid: bool = False,
    log: Callable[[str], None] | None = None,
    ship_data: bool = False,
    threads: int | None = None,
) -> RunSummary:
    """Run (or resume) a suite into ``out``.

    Parameters
    ----------
    suite : Suite
        A validated suite (:func:`~pyrobdl.compare.config.load_suite`).
    out : str or pathlib.Path
        Results folder (created).
    data_dir : str, optional
        Datasets root; default the suite's ``data_dir``, else ``PYROBDL_DATA_DIR``.
    device : str, optional
        Device for every fit; default the suite's ``device``, else the data's (CPU).
    only : Mapping, optional
        Filter, as returned by :func:`~pyrobdl.compare.grid.parse_only`; the reference cells
        the chosen cells need are added.
    executor : Executor, optional
        Default :class:`~pyrobdl.compare.executors.InProcessExecutor`.
    progress : bool, default True
        Overall progress bar, and per-cell bars when cells run in this process.
    rerun_invalid : bool, default False
        Set corrupt or stale records aside and rerun their cells instead of stopping.
    log : callable, optional
        Receives one line per event (default: ``tqdm.write``, or nothing without progress).
    ship_data : bool, default False
        Load every (dataset, split) once here and ship it with its cells' tasks (through the
        object store of a distributed executor), for workers that cannot see the data
        directory; default: each worker loads its cell's data from the data directory.
    threads : int, optional
        torch threads for every cell (and ``fit``'s default), set in the worker; default: the
        worker's own setting (a distributed executor may set it from the cell's resources).

    Returns
    -------
    RunSummary

    Raises
    ------
    ConfigError
        Problems found while planning (nothing has run).
    ValueError
        An invalid ``only`` filter or device.
    ResultsError
        Corrupt or stale records in ``out`` (naming the files) unless ``rerun_invalid``.
    FolderLockedError
        Another run is writing into ``out`` (a :class:`ResultsError`; naming its pid).
    OutFolderError
        ``out`` cannot be created or written (a ``ValueError``); nothing has run.
    WriteError
        A file could not be written during the run (full disk, I/O or permission error); the
        run stops, the cells finished before are kept, the one being written is not done.
    """
    started = time.perf_counter()
    executor = executor or InProcessExecutor()
    data_dir = data_dir or suite.data_dir
    device = device or suite.device
    if device is not None:
        from .._validation import resolve_device

        resolve_device(device, torch.device("cpu"))
    grid = expand(suite, data_dir)
    cells = select(grid, only or {})
    check_out_contents(out)  # refused before anything is loaded; created only once the plan holds
    check_plan(suite, cells, data_dir)
    out = check_out_folder(out)
    cells_root = out / "cells"
    if log is None:
        log = (lambda s: _tqdm_write(s)) if progress else (lambda s: None)
    run_id = new_run_id()
    with RunLock(out, run_id):
        return _run_locked(suite, grid, cells, out, run_id, data_dir, device, executor, progress, rerun_invalid,
                           log, started, ship_data, threads, only)


def _state(c: Cell, cells_root: Path) -> tuple[str, str]:
    ref_sha = reference_draws_sha256(cells_root / c.reference, REFERENCE_DRAWS) if c.reference else None
    if c.replicate:
        ref_sha = combined_sha(ref_sha, reference_draws_sha256(cells_root / c.replicate, REFERENCE_DRAWS))
    return cell_state(cells_root / c.id, c.config_hash, c.reference is not None, ref_sha)


def _run_locked(suite: Suite, grid: list[Cell], cells: list[Cell], out: Path, run_id: str, data_dir: str | None,
                device: str | None, executor: Executor, progress: bool, rerun_invalid: bool,
                log: Callable[[str], None], started: float, ship_data: bool = False,
                threads: int | None = None, only: Mapping[str, Any] | None = None) -> RunSummary:
    """:func:`run_suite` once the folder's lock is held."""
    cells_root = out / "cells"
    removed = clean_tmp(cells_root)
    if removed:
        log(f"removed {removed} temporary file(s) left by an interrupted run")
    states = {c.id: _state(c, cells_root) for c in cells}
    invalid = {cid: why for cid, (state, why) in states.items() if state in ("corrupt", "stale")}
    if invalid and not rerun_invalid:
        lines = "\n".join(f"  {why}" for why in invalid.values())
        raise ResultsError(
            f"{len(invalid)} stored result(s) in {out} cannot be resumed:\n{lines}\n"
            "Use another --out folder, delete them, or pass --rerun-invalid to set them aside and rerun."
        )
    for cid in invalid:
        log(f"set aside {set_aside(cells_root / cid)}")
    if suite.path.is_file():
        atomic_write_bytes(out / "suite.toml", suite.path.read_bytes(), owner=run_id)
    write_manifest(out, suite.name, {c.id: c.config_hash for c in grid}, owner=run_id)
    for cid, (state, why) in states.items():
        if state in ("damaged", "stale_reference"):
            log(f"{state}: {cid}: {why}; it runs again")
    # the references and their replicates: independent runs, the first stage
    todo_refs = [c for c in cells if (c.is_reference or c.is_replicate) and states[c.id][0] != "ok"]
    log(f"{suite.name}: {describe(cells, only)}; {sum(s == 'ok' for s, _ in states.values())} done, "
        f"{sum(s != 'ok' for s, _ in states.values())} to run")
    by_id = {c.id: c for c in cells}
    shipped: dict[tuple[str, int], Any] = {}
    remote = not executor.in_process

    def data_of(c: Cell) -> Any:
        if not ship_data:
            return None
        key = (c.dataset, c.split)
        if key not in shipped:  # once per (dataset, split): its cells share one object
            ds = c.spec["dataset"]
            shipped[key] = load_dataset(ds["source"], ds["options"], c.split, data_dir, suite.path.parent)
        return shipped[key]

    payloads: dict[str, ReferencePayload] = {}

    def reference_of(ref_id: str) -> ReferencePayload:
        if ref_id not in payloads:  # read once per stage; its dependents share one object
            payloads[ref_id] = reference_payload(out, ref_id)
        return payloads[ref_id]

    def checkpoint_of(c: Cell) -> str | None:
        # a method that can resume inside a fit gets a file of its own, when the cell runs here; named
        # by the configuration's hash, so a changed configuration starts afresh
        takes = "checkpoint" in get_method(c.spec["method"]["name"]).options
        return str(out / CHECKPOINTS / f"{c.id}--{c.config_hash[:16]}.pt") if takes and not remote else None

    def task(c: Cell) -> CellTask:
        ref = by_id.get(c.reference) if c.reference else None
        return CellTask(
            c, str(out), data_dir, str(suite.path.parent), device, progress and executor.in_process,
            dict(ref.spec["model"]) if ref else None, ref.spec["method"]["name"] if ref else None, run_id,
            reference=reference_of(c.reference) if c.reference else None,
            data=data_of(c), threads=threads, capture_output=remote, checkpoint=checkpoint_of(c),
            replicate=reference_of(c.replicate) if c.replicate else None,
        )

    ok: list[str] = []
    failed: list[str] = []
    errors: dict[str, str] = {}
    skipped: list[str] = [c.id for c in cells if (c.is_reference or c.is_replicate) and states[c.id][0] == "ok"]
    bar = _tqdm(total=sum(s != "ok" for s, _ in states.values()), desc=suite.name, unit="cell",
                disable=not progress, position=0)

    def show_counts() -> None:
        in_flight = getattr(executor, "in_flight", None)
        counts = {"done": len(ok), "failed": len(failed)}
        if callable(in_flight):
            counts["in flight"] = in_flight()  # running, or queued on a busy cluster
        bar.set_postfix(counts, refresh=True)

    try:
        # Reference cells first: the others read their draws, and are decided only once the
        # references are final (a refitted reference makes the cells scored against it stale).
        stage: list[Cell] = todo_refs
        for second in (False, True):
            if second:
                stage = []
                for c in (c for c in cells if not (c.is_reference or c.is_replicate)):
                    state, why = _state(c, cells_root)
                    if state == "ok":
                        skipped.append(c.id)
                        continue
                    if state == "stale_reference" and states[c.id][0] != state:
                        log(f"{state}: {c.id}: {why}; it runs again")
                    stage.append(c)
                bar.total = len(todo_refs) + len(stage)
                bar.refresh()
            payloads.clear()  # references are final once their stage is over
            tasks = [task(c) for c in stage]
            show_counts()
            # The workers compute; this process alone writes into the results folder.
            for result in executor.map_unordered(compute_cell, tasks, on_crash=crashed_result):
                outcome = write_cell(out, result, owner=run_id)
                (ok if outcome.status == "ok" else failed).append(outcome.cell_id)
                if outcome.error:
                    errors[outcome.cell_id] = outcome.error
                log(f"{outcome.status:6s} {outcome.cell_id} ({outcome.wall_time_s:.1f} s)"
                    + (f": {outcome.error}" if outcome.error else ""))
                bar.update(1)
                show_counts()
    except WriteError as e:
        log(f"stopped: {e}; {len(ok) + len(failed)} cell(s) finished before it are kept")
        raise
    finally:
        bar.close()
    clean_tmp(cells_root, run_id=run_id)
    return RunSummary(out, len(cells), tuple(skipped), tuple(ok), tuple(failed), errors, time.perf_counter() - started)


def _tqdm_write(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line)
