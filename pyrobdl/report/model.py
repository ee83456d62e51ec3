r"""The report as data: sections of preformatted tables and embedded figures.

:mod:`pyrobdl.report.tables` and :mod:`pyrobdl.report.figures` compute everything (means,
standard errors, verdicts against published numbers, PNG images); the renderers in
:mod:`pyrobdl.report.render` only lay these objects out, so the HTML and the Markdown can never
disagree and the templates compute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Figure", "ReportModel", "Section", "Table"]


@dataclass(frozen=True)
class Table:
    """A table of strings, ready to print.

    Attributes
    ----------
    title : str
    columns : tuple of str
        Header.
    rows : tuple of tuple of str
        One tuple per row, same length as ``columns``.
    row_kinds : tuple of str
        Per row: ``"ours"``, ``"published"``, ``"failed"``, ``"reference"`` (the reference
        posterior's method) or ``""`` (used for styling only).
    note : str
        A sentence under the table (sources, how to read it).
    cell_kinds : tuple of tuple of str
        Per row, per cell: ``"uncertified"`` for a number computed against a reference that is
        not certified (greyed; its text already carries the ``†`` marker), or ``""``.  Rows or
        cells beyond its length are plain.
    preface : str
        A sentence above the table (e.g. that the reference is not certified).
    preface_kind : str
        ``"warning"`` or ``""`` (styling of the preface only).
    collapsed : bool
        Long tables for the curious: shown folded (HTML ``<details>``) under their title.
    """

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    row_kinds: tuple[str, ...] = ()
    note: str = ""
    cell_kinds: tuple[tuple[str, ...], ...] = ()
    preface: str = ""
    preface_kind: str = ""
    collapsed: bool = False

    def cell_kind(self, row: int, col: int) -> str:
        """The kind of one cell (``""`` when none is set)."""
        kinds = self.cell_kinds[row] if row < len(self.cell_kinds) else ()
        return kinds[col] if col < len(kinds) else ""


@dataclass(frozen=True)
class Figure:
    """A figure already encoded as PNG.

    Attributes
    ----------
    title : str
    png_base64 : str
        The image, base64-encoded (embedded as a ``data:`` URI, so the page needs no network).
    caption : str
    """

    title: str
    png_base64: str
    caption: str = ""


@dataclass(frozen=True)
class Section:
    """One part of the report (a dataset, or the run overview).

    Attributes
    ----------
    title : str
    paragraphs : tuple of str
    tables : tuple of Table
    figures : tuple of Figure
    verdict : tuple of str
        Sentences that open the section (best method, cost, reference status, flagged methods),
        shown before anything else.
    """

    title: str
    paragraphs: tuple[str, ...] = ()
    tables: tuple[Table, ...] = ()
    figures: tuple[Figure, ...] = ()
    verdict: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReportModel:
    """The whole report.

    Attributes
    ----------
    title : str
    summary : tuple of str
        Lines at the top (suite, cells, machine, versions, generation time).
    sections : tuple of Section
    """

    title: str
    summary: tuple[str, ...]
    sections: tuple[Section, ...] = field(default_factory=tuple)
