r"""The runner: plan a suite's grid, run its cells through an executor, record each atomically.

:func:`run_suite` validates everything it can before the first fit (the suite file, the
``--only`` filter, data loading, model construction and each method's own ``check_model``),
decides from the results folder which cells are already done (see :mod:`pyrobdl.compare.store`
for the resume policy), runs the reference cells first and then the rest, and returns a
:class:`RunSummary`.  :func:`run_cell` is the unit of work: load data, build the model,
:func:`pyrobdl.fit`, :func:`pyrobdl.diagnostics.evaluate` on the test split (against the
reference when the dataset names one) and :func:`pyrobdl.diagnostics.fit_diagnostics` on the
training split (PSIS-LOO, the VI Pareto k̂), the stored artifacts, and finally the record.  A cell that raises is
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

import hashlib
import inspect
import io
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
from ..inference import fit
from . import artifacts
from .config import Suite
from .executors import Executor, InProcessExecutor
from .grid import Cell, build_model, check_plan, describe, expand, select
from .lock import RunLock, check_out_folder
from .sources import load_dataset
from .store import (
    RESULT_FILE,
    SCHEMA,
    ResultsError,
    WriteError,
    atomic_write_bytes,
    atomic_write_json,
    cell_state,
    clean_tmp,
    new_run_id,
    npz_bytes,
    read_result,
    reference_draws_sha256,
    set_aside,
    write_manifest,
)

__all__ = ["CellOutcome", "CellTask", "RunSummary", "library_versions", "run_cell", "run_suite"]

REFERENCE_DRAWS = "reference_draws.pt"
INFERENCE_DATA = "inference_data.nc"
ARRAYS = "arrays.npz"


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


def _evaluate(posterior: Any, data: Any, reference: Any, num_samples: int, seed: int) -> dict[str, float]:
    from .. import diagnostics

    evaluate = getattr(diagnostics, "evaluate", None)
    if evaluate is None:
        raise RuntimeError("pyrobdl.diagnostics.evaluate is not available in this pyrobdl")
    kwargs: dict[str, Any] = {"reference": reference, "num_samples": num_samples, "seed": seed}
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


def _load_reference(task: CellTask, data: Any, device: torch.device) -> tuple[Any, str, str | None]:
    """The reference posterior of ``task`` from its cell's stored draws, or (None, why not, None).

    The draws are read only when they match the checksum their cell recorded; the third element
    is that checksum, recorded by the dependent cell so a later change of the draws makes it stale.
    Its ``certification`` is the reference cell's recorded one; a record without one (a method
    without chains, or a record written before certifications existed) gives a failed
    certification, "no certification recorded".

    Raises
    ------
    ResultsError
        If the reference's draws are missing, damaged or unreadable although its record is
        ``ok`` (naming the file).
    """
    ref_dir = Path(task.out) / "cells" / str(task.cell.reference)
    path = ref_dir / REFERENCE_DRAWS
    try:
        record = read_result(ref_dir / RESULT_FILE)
    except (ResultsError, FileNotFoundError, OSError) as e:
        return None, f"reference {task.cell.reference} unavailable: {e}", None
    if record["status"] != "ok":
        return None, f"reference {task.cell.reference} unavailable: its cell {record['status']}", None
    expected = (record.get("checksums") or {}).get(REFERENCE_DRAWS)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise ResultsError(f"reference draws {path} cannot be read: {e.strerror or e}") from None
    if expected is None or hashlib.sha256(blob).hexdigest() != expected:
        raise ResultsError(f"reference draws {path} do not match the checksum in their cell's record "
                           "(damaged or replaced); rerun to refit the reference")
    try:
        draws = artifacts.load_draws_bytes(blob)
    except Exception as e:  # torch's zip reader: its message does not name the file
        raise ResultsError(f"reference draws {path} cannot be loaded: {type(e).__name__}: {e}") from None
    model = build_model(task.reference_model or {}, data).to(device)
    from ..diagnostics.certification import Certification
    from ..posterior import Cost

    cost = Cost(**record["cost"]) if isinstance(record.get("cost"), dict) else None
    recorded = record.get("certification")
    certification = (Certification.from_dict(recorded) if isinstance(recorded, dict)
                     else Certification.missing("no certification recorded"))
    return artifacts.StoredPosterior(model, draws, str(task.reference_method), cost, certification), "", expected


def _warning_texts(stage: str, caught: Sequence[warnings.WarningMessage]) -> list[str]:
    return [f"{stage}: {w.category.__name__}: {w.message}" for w in caught]


def run_cell(task: CellTask) -> CellOutcome:
    """Run one cell and write its record; never raises for a failure of the cell itself.

    Parameters
    ----------
    task : CellTask

    Returns
    -------
    CellOutcome
        ``status`` is ``"failed"`` (with the error) when any step raised an ``Exception``;
        the record then holds the error, its traceback and the stage it happened in.

    Raises
    ------
    WriteError
        When a file of the cell cannot be written (full disk, I/O or permission error): that is
        not a failure of the cell but of the results folder, and the run must stop.  No record
        is written then, so the cell is not counted as done.
    """
    cell = task.cell
    spec = cell.spec
    folder = Path(task.out) / "cells" / cell.id
    owner = task.run_id or None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(str(folder), f"[Errno {e.errno}] {e.strerror or e}") from e
    start, cpu_start = time.perf_counter(), time.process_time()
    record: dict[str, Any] = {
        "schema": SCHEMA, "id": cell.id, "status": "running", "suite": spec["suite"],
        "dataset": cell.dataset, "method": cell.method, "method_name": spec["method"]["name"],
        "split": cell.split, "seed": cell.seed, "is_reference": cell.is_reference,
        "config": spec, "config_hash": cell.config_hash, "published": spec["published"],
        "started_at": _now(), "host": socket.gethostname(), "versions": library_versions(),
        "metrics": {}, "train_metrics": {}, "exact_metrics": {}, "cost": None,
        "reference": {"cell": cell.reference, "used": False, "note": "", "certified": None},
        "certification": None, "warnings": [], "artifacts": {}, "checksums": {}, "error": None,
    }
    stage = "load data"
    try:
        ds = spec["dataset"]
        data = load_dataset(ds["source"], ds["options"], cell.split, task.data_dir, Path(task.base))
        stage = "build model"
        model = build_model(spec["model"], data)
        record["data"] = _data_info(data, model)
        stage = "fit"
        cpu_fit = time.process_time()
        # fit's warnings (not certified as a reference, a saturated sampler) belong in the record
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            try:
                posterior = fit(
                    model, data.x_train, data.y_train, spec["method"]["name"], seed=cell.seed,
                    device=task.device, progress=task.progress, **spec["method"]["options"],
                )
            finally:
                record["warnings"] += _warning_texts("fit", caught)
        certification = getattr(posterior, "certification", None)
        if certification is not None and callable(getattr(posterior, "certify", None)):
            # the suite certifies on held-back inputs: the test split's first points (the fit's
            # own certification, on training inputs, stays in the diagnostics)
            points = int(posterior.settings.get("diagnostic_points", 50))
            certification = posterior.certify(data.x_test[:points].to(posterior.model.device))
            if not certification.passed:
                record["warnings"].append(
                    f"certify: the {cell.method} posterior is not certified on held-back inputs: "
                    + "; ".join(certification.failures))
        record["certification"] = certification.to_dict() if certification is not None else None
        record["cost"] = posterior.cost.to_dict()
        record["fit_cpu_time_s"] = time.process_time() - cpu_fit
        record["diagnostics"] = posterior.diagnostics
        record["settings"] = posterior.settings
        data = data.to(posterior.model.device)
        n, seed = int(spec["num_eval_samples"]), cell.seed
        reference = None
        if cell.reference:
            stage = "load reference"
            reference, note, draws_sha = _load_reference(task, data, posterior.model.device)
            record["reference"].update(used=reference is not None, note=note, draws_sha256=draws_sha)
            if note:
                record["warnings"].append(note)
            if reference is not None:
                ref_cert = reference.certification
                record["reference"]["certified"] = bool(ref_cert.passed)
                if not ref_cert.passed:
                    record["warnings"].append(
                        f"the reference {cell.reference} is not certified ({'; '.join(ref_cert.failures)}): "
                        "agreement with it means nothing"
                    )
        stage = "evaluate"
        t_eval = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            # said above in the record's own words
            warnings.filterwarnings("ignore", message="agreement with an uncertified reference", category=UserWarning)
            try:
                record["metrics"] = _evaluate(posterior, data, reference, n, seed)
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
        record["checksums"][ARRAYS] = atomic_write_bytes(folder / ARRAYS, npz_bytes(arrays), owner=owner)
        record["artifacts"]["arrays"] = ARRAYS
        record["eval_time_s"] = time.perf_counter() - t_eval
        if spec.get("gradient_variance") is not None:
            stage = "gradient variance"
            try:
                record["gradient_variance"] = _gradient_variance(posterior, data, spec["gradient_variance"])
            except Exception as e:  # a diagnostic that does not apply to this posterior
                record["warnings"].append(f"gradient_variance: {type(e).__name__}: {e}")
        if cell.is_reference:
            stage = "save reference draws"
            record["checksums"][REFERENCE_DRAWS] = atomic_write_bytes(
                folder / REFERENCE_DRAWS, artifacts.draws_bytes(posterior, n, seed), owner=owner)
            record["artifacts"]["reference_draws"] = REFERENCE_DRAWS
        if spec.get("inference_data", True):
            stage = "inference data"
            try:
                idata = _inference_data(posterior, data, n)
            except Exception as e:  # a posterior without ArviZ data: metrics stand, the record says why
                idata = None
                record["warnings"].append(f"inference_data: {type(e).__name__}: {e}")
            if idata is not None:  # a failed serialisation fails the cell; a failed write stops the run
                record["checksums"][INFERENCE_DATA] = atomic_write_bytes(
                    folder / INFERENCE_DATA, netcdf_bytes(idata), owner=owner)
                record["artifacts"]["inference_data"] = INFERENCE_DATA
        record["status"] = "ok"
    except WriteError:
        raise
    except Exception as e:
        record["status"] = "failed"
        record["error"] = {
            "type": type(e).__name__, "message": str(e), "stage": stage,
            "traceback": traceback.format_exc(),
        }
    record["wall_time_s"] = time.perf_counter() - start
    record["cpu_time_s"] = time.process_time() - cpu_start
    record["finished_at"] = _now()
    try:
        atomic_write_json(folder / RESULT_FILE, record, owner=owner)
    except WriteError:
        raise
    except Exception as e:  # e.g. an unserialisable diagnostic: keep a record of the failure
        record = {k: record[k] for k in ("schema", "id", "dataset", "method", "split", "seed", "config_hash", "config")}
        record.update(status="failed", error={"type": type(e).__name__, "message": f"writing the record: {e}",
                                              "stage": "write record", "traceback": traceback.format_exc()})
        atomic_write_json(folder / RESULT_FILE, record, owner=owner)
    err = record.get("error") or {}
    return CellOutcome(
        cell.id, record["status"], f"{err.get('type')}: {err.get('message')}" if err else "",
        time.perf_counter() - start,
    )


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
    out = check_out_folder(out)
    check_plan(suite, cells, data_dir)
    cells_root = out / "cells"
    if log is None:
        log = (lambda s: _tqdm_write(s)) if progress else (lambda s: None)
    run_id = new_run_id()
    with RunLock(out, run_id):
        return _run_locked(suite, grid, cells, out, run_id, data_dir, device, executor, progress, rerun_invalid,
                           log, started)


def _state(c: Cell, cells_root: Path) -> tuple[str, str]:
    ref_sha = reference_draws_sha256(cells_root / c.reference, REFERENCE_DRAWS) if c.reference else None
    return cell_state(cells_root / c.id, c.config_hash, c.reference is not None, ref_sha)


def _run_locked(suite: Suite, grid: list[Cell], cells: list[Cell], out: Path, run_id: str, data_dir: str | None,
                device: str | None, executor: Executor, progress: bool, rerun_invalid: bool,
                log: Callable[[str], None], started: float) -> RunSummary:
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
    todo_refs = [c for c in cells if c.is_reference and states[c.id][0] != "ok"]
    log(f"{suite.name}: {describe(cells)}; {sum(s == 'ok' for s, _ in states.values())} done, "
        f"{sum(s != 'ok' for s, _ in states.values())} to run")
    by_id = {c.id: c for c in cells}

    def task(c: Cell) -> CellTask:
        ref = by_id.get(c.reference) if c.reference else None
        return CellTask(
            c, str(out), data_dir, str(suite.path.parent), device, progress and executor.in_process,
            dict(ref.spec["model"]) if ref else None, ref.spec["method"]["name"] if ref else None, run_id,
        )

    ok: list[str] = []
    failed: list[str] = []
    errors: dict[str, str] = {}
    skipped: list[str] = [c.id for c in cells if c.is_reference and states[c.id][0] == "ok"]
    bar = _tqdm(total=sum(s != "ok" for s, _ in states.values()), desc=suite.name, unit="cell",
                disable=not progress, position=0)
    try:
        # Reference cells first: the others read their draws, and are decided only once the
        # references are final (a refitted reference makes the cells scored against it stale).
        stage: list[Cell] = todo_refs
        for second in (False, True):
            if second:
                stage = []
                for c in (c for c in cells if not c.is_reference):
                    state, why = _state(c, cells_root)
                    if state == "ok":
                        skipped.append(c.id)
                        continue
                    if state == "stale_reference" and states[c.id][0] != state:
                        log(f"{state}: {c.id}: {why}; it runs again")
                    stage.append(c)
                bar.total = len(todo_refs) + len(stage)
                bar.refresh()
            for outcome in executor.map_unordered(run_cell, [task(c) for c in stage]):
                (ok if outcome.status == "ok" else failed).append(outcome.cell_id)
                if outcome.error:
                    errors[outcome.cell_id] = outcome.error
                log(f"{outcome.status:6s} {outcome.cell_id} ({outcome.wall_time_s:.1f} s)"
                    + (f": {outcome.error}" if outcome.error else ""))
                bar.update(1)
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
