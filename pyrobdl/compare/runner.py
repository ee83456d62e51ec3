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
"""

from __future__ import annotations

import inspect
import platform
import shutil
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
from .sources import load_dataset
from .store import (
    RESULT_FILE,
    SCHEMA,
    ResultsError,
    atomic_save_npz,
    atomic_write,
    atomic_write_json,
    cell_state,
    clean_tmp,
    read_result,
    set_aside,
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
    """

    cell: Cell
    out: str
    data_dir: str | None
    base: str
    device: str | None
    progress: bool
    reference_model: Mapping[str, Any] | None = None
    reference_method: str | None = None


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


def _write_inference_data(path: Path, posterior: Any, data: Any, num_samples: int) -> None:
    to_idata = getattr(posterior, "to_inference_data", None)
    if to_idata is None:
        raise RuntimeError(f"{type(posterior).__name__} has no to_inference_data")
    params = inspect.signature(to_idata).parameters
    kwargs = {"num_samples": num_samples} if "num_samples" in params else {}
    idata = to_idata(data.x_test, data.y_test, **kwargs)
    atomic_write(path, lambda tmp: idata.to_netcdf(str(tmp)))


def _load_reference(task: CellTask, data: Any, device: torch.device) -> tuple[Any, str]:
    """The reference posterior of ``task`` from its cell's stored draws, or (None, why not).

    Its ``certification`` is the reference cell's recorded one; a record without one (a method
    without chains, or a record written before certifications existed) gives a failed
    certification, "no certification recorded".
    """
    ref_dir = Path(task.out) / "cells" / str(task.cell.reference)
    path = ref_dir / REFERENCE_DRAWS
    try:
        record = read_result(ref_dir / RESULT_FILE)
    except (ResultsError, FileNotFoundError, OSError) as e:
        return None, f"reference {task.cell.reference} unavailable: {e}"
    if record["status"] != "ok" or not path.exists():
        return None, f"reference {task.cell.reference} unavailable: its cell {record['status']}"
    model = build_model(task.reference_model or {}, data).to(device)
    from ..diagnostics.certification import Certification
    from ..posterior import Cost

    cost = Cost(**record["cost"]) if isinstance(record.get("cost"), dict) else None
    recorded = record.get("certification")
    certification = (Certification.from_dict(recorded) if isinstance(recorded, dict)
                     else Certification.missing("no certification recorded"))
    return artifacts.StoredPosterior(model, artifacts.load_draws(path), str(task.reference_method), cost,
                                     certification), ""


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
    """
    cell = task.cell
    spec = cell.spec
    folder = Path(task.out) / "cells" / cell.id
    folder.mkdir(parents=True, exist_ok=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    record: dict[str, Any] = {
        "schema": SCHEMA, "id": cell.id, "status": "running", "suite": spec["suite"],
        "dataset": cell.dataset, "method": cell.method, "method_name": spec["method"]["name"],
        "split": cell.split, "seed": cell.seed, "is_reference": cell.is_reference,
        "config": spec, "config_hash": cell.config_hash, "published": spec["published"],
        "started_at": _now(), "host": socket.gethostname(), "versions": library_versions(),
        "metrics": {}, "train_metrics": {}, "exact_metrics": {}, "cost": None,
        "reference": {"cell": cell.reference, "used": False, "note": "", "certified": None},
        "certification": None, "warnings": [], "artifacts": {}, "error": None,
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
            reference, note = _load_reference(task, data, posterior.model.device)
            record["reference"].update(used=reference is not None, note=note)
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
        atomic_save_npz(folder / ARRAYS, arrays)
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
            artifacts.save_draws(folder / REFERENCE_DRAWS, posterior, n, seed)
            record["artifacts"]["reference_draws"] = REFERENCE_DRAWS
        if spec.get("inference_data", True):
            stage = "inference data"
            try:
                _write_inference_data(folder / INFERENCE_DATA, posterior, data, n)
                record["artifacts"]["inference_data"] = INFERENCE_DATA
            except Exception as e:  # metrics stand; the record says why the netCDF is missing
                record["warnings"].append(f"inference_data: {type(e).__name__}: {e}")
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
    try:
        atomic_write_json(folder / RESULT_FILE, record)
    except Exception as e:  # e.g. an unserialisable diagnostic: keep a record of the failure
        record = {k: record[k] for k in ("schema", "id", "dataset", "method", "split", "seed", "config_hash", "config")}
        record.update(status="failed", error={"type": type(e).__name__, "message": f"writing the record: {e}",
                                              "stage": "write record", "traceback": traceback.format_exc()})
        atomic_write_json(folder / RESULT_FILE, record)
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
    """
    started = time.perf_counter()
    executor = executor or InProcessExecutor()
    data_dir = data_dir or suite.data_dir
    device = device or suite.device
    if device is not None:
        from .._validation import resolve_device

        resolve_device(device, torch.device("cpu"))
    cells = select(expand(suite, data_dir), only or {})
    check_plan(suite, cells, data_dir)
    out = Path(out)
    cells_root = out / "cells"
    cells_root.mkdir(parents=True, exist_ok=True)
    if log is None:
        log = (lambda s: _tqdm_write(s)) if progress else (lambda s: None)
    removed = clean_tmp(cells_root)
    if removed:
        log(f"removed {removed} temporary file(s) left by an interrupted run")
    states = {c.id: cell_state(cells_root / c.id, c.config_hash, c.reference is not None) for c in cells}
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
        atomic_write(out / "suite.toml", lambda tmp: shutil.copyfile(suite.path, tmp))
    skipped = tuple(c.id for c in cells if states[c.id][0] == "ok")
    todo = [c for c in cells if states[c.id][0] != "ok"]
    log(f"{suite.name}: {describe(cells)}; {len(skipped)} done, {len(todo)} to run")
    by_id = {c.id: c for c in cells}

    def task(c: Cell) -> CellTask:
        ref = by_id.get(c.reference) if c.reference else None
        return CellTask(
            c, str(out), data_dir, str(suite.path.parent), device, progress and executor.in_process,
            dict(ref.spec["model"]) if ref else None, ref.spec["method"]["name"] if ref else None,
        )

    ok: list[str] = []
    failed: list[str] = []
    errors: dict[str, str] = {}
    bar = _tqdm(total=len(todo), desc=suite.name, unit="cell", disable=not progress, position=0)
    try:
        # Reference cells first: the others read their draws.
        for stage in ([c for c in todo if c.is_reference], [c for c in todo if not c.is_reference]):
            for outcome in executor.map_unordered(run_cell, [task(c) for c in stage]):
                (ok if outcome.status == "ok" else failed).append(outcome.cell_id)
                if outcome.error:
                    errors[outcome.cell_id] = outcome.error
                log(f"{outcome.status:6s} {outcome.cell_id} ({outcome.wall_time_s:.1f} s)"
                    + (f": {outcome.error}" if outcome.error else ""))
                bar.update(1)
    finally:
        bar.close()
    return RunSummary(out, len(cells), skipped, tuple(ok), tuple(failed), errors, time.perf_counter() - started)


def _tqdm_write(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line)
