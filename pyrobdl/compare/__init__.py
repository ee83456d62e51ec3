"""Comparison suites: TOML config -> validated grid -> runner -> one atomic record per cell.

See ``docs/compare.md`` for the suite format, the results folder and the resume policy.
"""

from .config import ConfigError, DatasetEntry, MethodEntry, Suite, load_suite, parse_suite
from .executors import Executor, FuturesExecutor, InProcessExecutor
from .grid import Cell, build_model, expand, parse_only, select
from .runner import CellOutcome, CellTask, RunSummary, library_versions, run_cell, run_suite
from .sources import SOURCES, Source
from .lock import FolderLockedError, OutFolderError
from .store import ResultsError, WriteError, list_results, read_result

__all__ = [
    "Cell",
    "CellOutcome",
    "CellTask",
    "ConfigError",
    "DatasetEntry",
    "Executor",
    "FuturesExecutor",
    "InProcessExecutor",
    "MethodEntry",
    "FolderLockedError",
    "OutFolderError",
    "ResultsError",
    "WriteError",
    "RunSummary",
    "SOURCES",
    "Source",
    "Suite",
    "build_model",
    "expand",
    "library_versions",
    "list_results",
    "load_suite",
    "parse_only",
    "parse_suite",
    "read_result",
    "run_cell",
    "run_suite",
    "select",
]
