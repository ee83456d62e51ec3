"""Reports: stored results -> tables and figures -> one self-contained HTML page + Markdown.

See ``docs/compare.md``.  ``pyrobdl report DIR`` calls :func:`build_report`.
"""

from .build import ReportFiles, build_model, build_report
from ..compare.published import PUBLISHED, PublishedRow

__all__ = ["PUBLISHED", "PublishedRow", "ReportFiles", "build_model", "build_report"]
