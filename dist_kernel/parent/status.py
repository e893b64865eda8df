"""``%dist_status``: one row per rank, as text and as an HTML table."""

from __future__ import annotations

import html

from dist_kernel.options import KernelConfig

COLUMNS = [("rank", "rank"), ("pid", "pid"), ("host", "host"), ("device", "device"), ("state", "state"), ("group", "group"),
           ("rss_mb", "RSS MB"), ("cuda_allocated_mb", "CUDA alloc MB"), ("cuda_reserved_mb", "CUDA reserved MB"),
           ("empty_cache", "empty_cache")]


def status_bundle(table: dict[int, dict], config: KernelConfig) -> dict:
    """A display_data content for the ranks' status."""
    cols = [(k, h) for k, h in COLUMNS if k == "rank" or any(k in row for row in table.values())]
    rows = [[str(rank)] + [_cell(row.get(k)) for k, _ in cols[1:]] for rank, row in sorted(table.items())]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (_, h) in enumerate(cols)]
    line = "  ".join(h.ljust(w) for (_, h), w in zip(cols, widths, strict=True))
    text = [config.describe(), line] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return {"data": {"text/plain": "\n".join(text),
                     "text/html": f"<p>{html.escape(config.describe())}</p><table><tr>{head}</tr>{body}</table>"},
            "metadata": {}}


def _cell(value: object) -> str:
    return "" if value is None else str(value)
