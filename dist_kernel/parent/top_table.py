"""``%dist_top``'s table, pure: one row per rank (host, state, CPU, memory, GPU, the cell's
line) as text, as HTML with bars, and as the columns ``%dist_status`` adds. No I/O: the rows
come from :mod:`dist_kernel.parent.top`, which samples and publishes."""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field

from dist_kernel.protocol import Place

NA = "n/a"
#: the longest cell line shown; the rest is cut (a table row must stay one line)
LINE_MAX = 60
GIB = 1024 ** 3
MIB = 1024 ** 2
HEADERS = ("rank", "host", "state", "CPU %", "RSS", "GPU %", "GPU mem", "temp", "line")


@dataclass(frozen=True)
class TopRow:
    """One rank, as ``%dist_top`` shows it; ``load`` is a sample of :mod:`dist_kernel.load`."""

    rank: int
    host: str
    state: str
    load: Mapping[str, float | int | None] = field(default_factory=dict)
    line: str = ""


def state_of(*, alive: bool, stopped: str = "", at_breakpoint: bool = False, busy: bool = False,
             place: Place | None = None) -> str:
    """A rank's state in words: ``dead``, ``stopped`` (SIGSTOP; ``stopped at a breakpoint``
    under the debugger), ``idle``, ``in all_reduce`` (a collective, or torch's C++ call that
    started one), ``running``, or ``not answering`` (busy, and its control thread did not
    answer: C code holding the GIL)."""
    if not alive:
        return "dead"
    if at_breakpoint:
        return "stopped at a breakpoint"
    if stopped:
        return "stopped"
    if not busy:
        return "idle"
    if place is None:
        return "not answering"
    if place.collective:
        return f"in {place.collective}"
    if place.native:
        return f"in {place.native.split(' / ')[0]}"
    return "running"


# ------------------------------------------------------------------ cells
def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fmt_bytes(value: object) -> str:
    """``1.5 GiB``, ``300 MiB``; n/a when unknown."""
    n = _num(value)
    if n is None:
        return NA
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def fmt_pct(value: object) -> str:
    n = _num(value)
    return NA if n is None else f"{n:.0f}"


def fmt_gpu_mem(load: Mapping[str, object]) -> str:
    """``used/total GiB``; n/a when either is unknown."""
    used, total = _num(load.get("gpu_used")), _num(load.get("gpu_total"))
    if used is None or total is None:
        return NA
    return f"{used / GIB:.1f}/{total / GIB:.1f} GiB"


def fmt_temp(value: object) -> str:
    n = _num(value)
    return NA if n is None else f"{n:.0f} C"


def short_line(line: str) -> str:
    """The cell line, stripped and cut to :data:`LINE_MAX` characters."""
    text = " ".join(line.split())
    return text if len(text) <= LINE_MAX else text[:LINE_MAX - 3] + "..."


def cells(row: TopRow) -> list[str]:
    """A row's cells as text, in :data:`HEADERS` order."""
    load = row.load
    return [str(row.rank), row.host or NA, row.state, fmt_pct(load.get("cpu")), fmt_bytes(load.get("rss")),
            fmt_pct(load.get("gpu_util")), fmt_gpu_mem(load), fmt_temp(load.get("gpu_temp")), short_line(row.line)]


def status_columns(load: Mapping[str, object]) -> dict[str, str]:
    """What ``%dist_status`` adds to a rank's row (``rss_mb`` it has already)."""
    return {"cpu": fmt_pct(load.get("cpu")), "gpu_util": fmt_pct(load.get("gpu_util")),
            "gpu_mem": fmt_gpu_mem(load), "gpu_temp": fmt_temp(load.get("gpu_temp"))}


# ----------------------------------------------------------------- forms
def render_text(rows: list[TopRow]) -> str:
    """The table as aligned plain text, a header line first."""
    table = [list(HEADERS)] + [cells(r) for r in sorted(rows, key=lambda r: r.rank)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADERS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table)


def _bar(fraction: float | None, text: str, color: str) -> str:
    """A cell with a bar filled to ``fraction`` (0..1) behind its text; the text alone if unknown."""
    if fraction is None:
        return html.escape(text)
    pct = max(0.0, min(1.0, fraction)) * 100
    return (f'<div style="position:relative;min-width:6em;background:#e8e8e8;border-radius:2px">'
            f'<div style="position:absolute;left:0;top:0;bottom:0;width:{pct:.0f}%;background:{color};'
            f'border-radius:2px"></div><span style="position:relative;padding:0 4px">{html.escape(text)}</span></div>')


def _fraction(value: float | None, whole: float | None) -> float | None:
    return None if value is None or not whole else value / whole


def _html_cells(row: TopRow) -> list[str]:
    text = cells(row)
    load = row.load
    cpu, util = _num(load.get("cpu")), _num(load.get("gpu_util"))
    used, total = _num(load.get("gpu_used")), _num(load.get("gpu_total"))
    state = html.escape(row.state)
    if row.state.startswith("in "):
        state = f'<span style="color:#b36b00">{state}</span>'
    elif row.state in ("dead", "not answering") or row.state.startswith("stopped"):
        state = f'<span style="color:#c62828">{state}</span>'
    return [html.escape(text[0]), html.escape(text[1]), state,
            _bar(_fraction(cpu, 100.0), text[3], "#90caf9"),  # a full bar is one busy core
            html.escape(text[4]),
            _bar(_fraction(util, 100.0), text[5], "#a5d6a7"),
            _bar(_fraction(used, total), text[6], "#ffcc80"),
            html.escape(text[7]), f"<code>{html.escape(text[8])}</code>" if text[8] else ""]


def render_html(rows: list[TopRow]) -> str:
    """The table as HTML, with bars for CPU, GPU utilisation and GPU memory."""
    head = "".join(f'<th style="text-align:left;padding:2px 8px;white-space:nowrap">{html.escape(h)}</th>' for h in HEADERS)
    body = "".join("<tr>" + "".join(f'<td style="text-align:left;padding:2px 8px;white-space:nowrap">{c}</td>' for c in _html_cells(r)) + "</tr>"
                   for r in sorted(rows, key=lambda r: r.rank))
    return f'<table class="dist-top"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def bundle(rows: list[TopRow], title: str = "") -> dict:
    """The display's data (text/plain and text/html), ``title`` above the table."""
    text = render_text(rows)
    page = render_html(rows)
    if title:
        text = f"{title}\n{text}"
        page = f"<p>{html.escape(title)}</p>{page}"
    return {"text/plain": text, "text/html": page}
