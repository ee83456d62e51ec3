r"""The runner: plan a suite's grid, run its cells through an executor, record each atomically.

:func:`run_suite` validates everything it can before the first fit (the suite file, the
``--only`` filter, data loading, model construction and each method's own ``check_model``),
decides from the results folder which cells are already done (see :mod:`pyrobdl.compare.store`
for the resume policy), runs the reference cells first and then the rest, and returns a
:class:`~pyrobdl.compare.tasks.RunSummary`.  :func:`~pyrobdl.compare.compute.compute_cell` is the
unit of work, run by a worker (in this process, another process or a Ray node); it writes nothing.
:func:`write_cell`, in the driver only, writes its result into the results folder.  A cell that
raises is recorded with its error and the others go on.  Nothing here depends on which method a
cell runs: methods are looked up in the registry and only used through the posterior contract.
The tasks and results passed between driver and workers live in :mod:`pyrobdl.compare.tasks`
and are importable from here as before.

The results folder is guarded as :mod:`pyrobdl.compare.store` and :mod:`pyrobdl.compare.lock`
describe: ``--out`` is checked before any work, the run holds the folder's lock throughout,
every artifact's checksum goes into the record, a dependent cell records the checksum of the
reference draws it was scored against (and is redone when they change), and a file that cannot be
written (:class:`~pyrobdl.compare.store.WriteError`) stops the run instead of failing the cell.
"""

from __future__ import annotations

import glob
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..inference.registry import get_method
from .compute import compute_cell, crashed_result
from .config import Suite
from .executors import Executor, InProcessExecutor
from .grid import Cell, check_plan, describe, expand, select
from .lock import RunLock, check_out_contents, check_out_folder
from .reference_cells import REFERENCE_DRAWS, ReferencePayload, combined_sha, reference_payload
from .sources import load_dataset
from .store import (
    RESULT_FILE,
    ResultsError,
    WriteError,
    atomic_write_bytes,
    atomic_write_json,
    cell_state,
    clean_tmp,
    new_run_id,
    reference_draws_sha256,
    set_aside,
    write_manifest,
)
from .tasks import (
    CHECKPOINTS,
    CellOutcome,
    CellResult,
    CellTask,
    RunSummary,
    library_versions,
)

__all__ = [
    "CellOutcome", "CellResult", "CellTask", "ReferencePayload", "RunSummary", "compute_cell", "crashed_result",
    "library_versions", "reference_payload", "run_cell", "run_suite", "write_cell",
]


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
    states = _plan_states(suite, grid, cells, out, run_id, rerun_invalid, log)
    # the references and their replicates: independent runs, the first stage
    todo_refs = [c for c in cells if (c.is_reference or c.is_replicate) and states[c.id][0] != "ok"]
    log(f"{suite.name}: {describe(cells, only)}; {sum(s == 'ok' for s, _ in states.values())} done, "
        f"{sum(s != 'ok' for s, _ in states.values())} to run")
    task = _TaskMaker(suite, cells, out, run_id, data_dir, device, executor, progress, ship_data, threads)
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
                stage = _second_stage(cells, cells_root, states, skipped, log)
                bar.total = len(todo_refs) + len(stage)
                bar.refresh()
            task.payloads.clear()  # references are final once their stage is over
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


def _plan_states(suite: Suite, grid: list[Cell], cells: list[Cell], out: Path, run_id: str, rerun_invalid: bool,
                 log: Callable[[str], None]) -> dict[str, tuple[str, str]]:
    """Each cell's stored state (:func:`~pyrobdl.compare.store.cell_state`), once the folder is
    cleaned of temporary files, invalid records refused or set aside, and the suite and manifest
    written."""
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
    return states


def _second_stage(cells: list[Cell], cells_root: Path, states: Mapping[str, tuple[str, str]], skipped: list[str],
                  log: Callable[[str], None]) -> list[Cell]:
    """The cells that are neither references nor replicates and still have to run, decided once the
    references are final (their done ones are appended to ``skipped``)."""
    stage = []
    for c in (c for c in cells if not (c.is_reference or c.is_replicate)):
        state, why = _state(c, cells_root)
        if state == "ok":
            skipped.append(c.id)
            continue
        if state == "stale_reference" and states[c.id][0] != state:
            log(f"{state}: {c.id}: {why}; it runs again")
        stage.append(c)
    return stage


class _TaskMaker:
    """Makes each cell's :class:`CellTask`: its reference's payload (read once per stage, shared by its
    dependents), its shipped data (loaded once per dataset and split) and its checkpoint file."""

    def __init__(self, suite: Suite, cells: list[Cell], out: Path, run_id: str, data_dir: str | None,
                 device: str | None, executor: Executor, progress: bool, ship_data: bool,
                 threads: int | None) -> None:
        self.suite, self.out, self.run_id, self.data_dir, self.device = suite, out, run_id, data_dir, device
        self.executor, self.progress, self.ship_data, self.threads = executor, progress, ship_data, threads
        self.by_id = {c.id: c for c in cells}
        self.shipped: dict[tuple[str, int], Any] = {}
        self.payloads: dict[str, ReferencePayload] = {}
        self.remote = not executor.in_process

    def data_of(self, c: Cell) -> Any:
        if not self.ship_data:
            return None
        key = (c.dataset, c.split)
        if key not in self.shipped:  # once per (dataset, split): its cells share one object
            ds = c.spec["dataset"]
            self.shipped[key] = load_dataset(ds["source"], ds["options"], c.split, self.data_dir,
                                             self.suite.path.parent)
        return self.shipped[key]

    def reference_of(self, ref_id: str) -> ReferencePayload:
        if ref_id not in self.payloads:  # read once per stage; its dependents share one object
            self.payloads[ref_id] = reference_payload(self.out, ref_id)
        return self.payloads[ref_id]

    def checkpoint_of(self, c: Cell) -> str | None:
        # a method that can resume inside a fit gets a file of its own, when the cell runs here; named
        # by the configuration's hash, so a changed configuration starts afresh
        takes = "checkpoint" in get_method(c.spec["method"]["name"]).options
        return str(self.out / CHECKPOINTS / f"{c.id}--{c.config_hash[:16]}.pt") if takes and not self.remote else None

    def __call__(self, c: Cell) -> CellTask:
        ref = self.by_id.get(c.reference) if c.reference else None
        return CellTask(
            c, str(self.out), self.data_dir, str(self.suite.path.parent), self.device,
            self.progress and self.executor.in_process,
            dict(ref.spec["model"]) if ref else None, ref.spec["method"]["name"] if ref else None, self.run_id,
            reference=self.reference_of(c.reference) if c.reference else None,
            data=self.data_of(c), threads=self.threads, capture_output=self.remote, checkpoint=self.checkpoint_of(c),
            replicate=self.reference_of(c.replicate) if c.replicate else None,
        )


def _tqdm_write(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line)
