"""What passes between the runner's driver and its workers: tasks, results, outcomes, the summary.

:class:`CellTask` is everything a worker needs to run one cell (picklable, so it can go to another
process or a Ray node); :class:`CellResult` is what the worker sends back (the record and its
files' bytes, written by the driver); :class:`CellOutcome` is what the driver makes of it once
written; :class:`RunSummary` is what :func:`~pyrobdl.compare.runner.run_suite` returns.  Also the
names of a cell's files and :func:`library_versions`, recorded in every cell.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from .. import __version__
from .grid import Cell
from .reference_cells import ReferencePayload

__all__ = ["ARRAYS", "CELL_LOG", "CHECKPOINTS", "INFERENCE_DATA", "CellOutcome", "CellResult", "CellTask",
           "RunSummary", "library_versions"]

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
