"""Renderers: lay a :class:`~pyrobdl.report.model.ReportModel` out as HTML or Markdown.

These are the report's templates.  They compute nothing: every string and image is already in
the model; they only escape text and place it.  The HTML is one self-contained file: inline CSS,
images as ``data:`` URIs, no scripts, no external links or requests.
"""

from __future__ import annotations

import html

from .model import ReportModel, Section, Table

__all__ = ["to_html", "to_markdown"]

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
h3 { font-size: 1.05em; margin-top: 1.5em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .85em; }
th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: right; vertical-align: top; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
tr.published td { color: #555; font-style: italic; background: #fafafa; }
tr.failed td { background: #fde8e8; }
tr.reference td { font-weight: 600; }
td.uncertified { color: #999; background: #f4f4f4; }
p.preface { font-size: .9em; max-width: 60em; }
p.preface.warning { border-left: 4px solid #c0392b; padding-left: .6em; color: #7b241c; }
p.note { font-size: .8em; color: #555; max-width: 60em; }
figure { margin: 1em 0; } figcaption { font-size: .8em; color: #555; }
img { max-width: 100%; border: 1px solid #eee; }
ul.summary { font-size: .9em; } nav ul { columns: 3; font-size: .9em; }
div.verdict { border: 1px solid #9ab; background: #f4f8fb; padding: .2em 1em; margin: 1em 0; max-width: 70em; }
div.verdict h3 { margin: .4em 0; } div.verdict li { margin: .25em 0; }
details { margin: .8em 0; } summary { cursor: pointer; font-weight: 600; }
"""


def _anchor(title: str) -> str:
    return "s-" + "".join(c if c.isalnum() else "-" for c in title.lower())


def _html_table(t: Table) -> str:
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in t.columns)
    body = []
    for i, row in enumerate(t.rows):
        kind = t.row_kinds[i] if i < len(t.row_kinds) else ""
        cls = f' class="{e(kind)}"' if kind else ""
        cells = []
        for j, c in enumerate(row):
            ck = t.cell_kind(i, j)
            cells.append(f'<td class="{e(ck)}">{e(c)}</td>' if ck else f"<td>{e(c)}</td>")
        body.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    note = f'<p class="note">{e(t.note)}</p>' if t.note else ""
    preface = ""
    if t.preface:
        pcls = f"preface {t.preface_kind}" if t.preface_kind else "preface"
        preface = f'<p class="{e(pcls)}">{e(t.preface)}</p>\n'
    table = f"{preface}<table>\n<tr>{head}</tr>\n" + "\n".join(body) + f"\n</table>\n{note}"
    if t.collapsed:
        return f"<details>\n<summary>{e(t.title)} ({len(t.rows)} rows)</summary>\n{table}</details>"
    return f"<h3>{e(t.title)}</h3>\n{table}"


def _html_section(s: Section) -> str:
    e = html.escape
    parts = [f'<section id="{_anchor(s.title)}">\n<h2>{e(s.title)}</h2>']
    if s.verdict:
        items = "".join(f"<li>{e(v)}</li>" for v in s.verdict)
        parts.append(f'<div class="verdict">\n<h3>Verdict</h3>\n<ul>{items}</ul>\n</div>')
    parts += [f"<p>{e(p)}</p>" for p in s.paragraphs]
    parts += [_html_table(t) for t in s.tables]
    for f in s.figures:
        parts.append(
            f'<figure>\n<h3>{e(f.title)}</h3>\n<img alt="{e(f.title)}" src="data:image/png;base64,{f.png_base64}">\n'
            f"<figcaption>{e(f.caption)}</figcaption>\n</figure>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def to_html(report: ReportModel) -> str:
    """The report as one self-contained HTML page."""
    e = html.escape
    summary = "".join(f"<li>{e(line)}</li>" for line in report.summary)
    nav = "".join(f'<li><a href="#{_anchor(s.title)}">{e(s.title)}</a></li>' for s in report.sections)
    sections = "\n".join(_html_section(s) for s in report.sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{e(report.title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{e(report.title)}</h1>\n<ul class=\"summary\">{summary}</ul>\n<nav><ul>{nav}</ul></nav>\n"
        f"{sections}\n</body>\n</html>\n"
    )


def _md_text(text: str) -> str:
    """Text for Markdown: HTML metacharacters escaped, so a label or an error message holding
    ``<script>`` or ``<img ...>`` stays text in any Markdown viewer (``>`` alone opens no tag)."""
    return text.replace("&", "&amp;").replace("<", "&lt;")


def _md_cell(text: str) -> str:
    return _md_text(text).replace("|", "\\|").replace("\n", " ")


def _md_table(t: Table) -> str:
    lines = [f"### {_md_text(t.title)}" + (" (details)" if t.collapsed else ""), ""]
    if t.preface:
        lines += [f"**{_md_text(t.preface)}**" if t.preface_kind == "warning" else _md_text(t.preface), ""]
    lines += ["| " + " | ".join(_md_cell(c) for c in t.columns) + " |",
              "|" + "|".join("---" for _ in t.columns) + "|"]
    for i, row in enumerate(t.rows):
        kind = t.row_kinds[i] if i < len(t.row_kinds) else ""
        cells = [_md_cell(c) for c in row]
        if kind == "published" and cells:
            cells[0] = f"*{cells[0]}*"
        if kind == "reference" and cells:
            cells[0] = f"**{cells[0]}**"
        lines.append("| " + " | ".join(cells) + " |")
    if t.note:
        lines += ["", _md_text(t.note)]
    return "\n".join(lines)


def to_markdown(report: ReportModel) -> str:
    """The report's tables as Markdown (figures are in the HTML page; their titles are listed)."""
    out = [f"# {_md_text(report.title)}", ""] + [f"- {_md_text(line)}" for line in report.summary] + [""]
    for s in report.sections:
        out += [f"## {_md_text(s.title)}", ""]
        if s.verdict:
            out += ["**Verdict**", ""] + [f"- {_md_text(v)}" for v in s.verdict] + [""]
        for p in s.paragraphs:
            out += [_md_text(p), ""]
        for t in s.tables:
            out += [_md_table(t), ""]
        if s.figures:
            out += ["Figures (in report.html): " + "; ".join(_md_text(f.title) for f in s.figures) + ".", ""]
    return "\n".join(out).rstrip() + "\n"
