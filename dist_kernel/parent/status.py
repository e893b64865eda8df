"""The parent's own magics, run (``%dist_status``, ``%dist_output``, ``%dist_empty_cache``;
read from a cell by :mod:`dist_kernel.parent.magics`), and ``%dist_status``'s table: one row
per rank, as text and as HTML."""

from __future__ import annotations

import asyncio
import html
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from dist_kernel.exceptions import RankRequestError, UsageError, error_content
from dist_kernel.options import KernelConfig
from dist_kernel.parent.magics import format_ranks
from dist_kernel.parent.top import status_loads
from dist_kernel.parent.top_table import status_columns

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks

COLUMNS = [("rank", "rank"), ("pid", "pid"), ("host", "host"), ("device", "device"), ("state", "state"), ("group", "group"),
           ("cpu", "CPU %"), ("rss_mb", "RSS MB"), ("gpu_util", "GPU %"), ("gpu_mem", "GPU mem"), ("gpu_temp", "temp"),
           ("cuda_allocated_mb", "CUDA alloc MB"), ("cuda_reserved_mb", "CUDA reserved MB"),
           ("empty_cache", "empty_cache")]


def status_bundle(table: dict[int, dict], config: KernelConfig, output_log: str = "") -> dict:
    """A display_data content for the ranks' status (and where the kernel's output log is)."""
    cols = [(k, h) for k, h in COLUMNS if k == "rank" or any(k in row for row in table.values())]
    rows = [[str(rank)] + [_cell(row.get(k)) for k, _ in cols[1:]] for rank, row in sorted(table.items())]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (_, h) in enumerate(cols)]
    line = "  ".join(h.ljust(w) for (_, h), w in zip(cols, widths, strict=True))
    text = [config.describe(), line] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    log = f"<p>output log: <code>{html.escape(output_log)}</code></p>" if output_log else ""
    return {"data": {"text/plain": "\n".join(text + ([f"output log: {output_log}"] if output_log else [])),
                     "text/html": f"<p>{html.escape(config.describe())}</p><table><tr>{head}</tr>{body}</table>{log}"},
            "metadata": {}}


def _cell(value: object) -> str:
    return "" if value is None else str(value)


#: the state ``%dist_status`` shows for a rank that ``--respawn on`` is starting anew
STARTING = "being started anew (--respawn on)"


async def run_parent_magics(ranks: Ranks, magics: tuple[tuple[str, str], ...],
                            publish: Callable[[str, dict], None],
                            set_output: Callable[[str], None], starting: Collection[int] = (),
                            output_log: str = "") -> dict | None:
    """Run a cell's parent magics in order (``(name, argument)`` each); the first one's error
    content ends them. ``publish(msg_type, content)`` shows their output in the cell;
    ``set_output`` takes ``%dist_output``'s policy; ``starting``: the ranks ``--respawn on`` is
    starting anew now (``%dist_status`` shows them so, without waiting); ``output_log`` is where
    the kernel's output log is (``%dist_status`` says)."""
    for name, arg in magics:
        if name == "dist_status":
            table, loads = await asyncio.gather(ranks.status(), status_loads(ranks))
            # %dist_top's columns as a snapshot; n/a where unknown (no NVML, no GPU)
            table = {r: {**row, **status_columns(loads.get(r, {})), **({"state": STARTING} if r in starting else {})}
                     for r, row in table.items()}
            publish("display_data", status_bundle(table, ranks.config, output_log))
        elif name == "dist_output":
            if arg not in ("all", "rank0"):
                return error_content(UsageError, f"%dist_output {arg!r}: use `%dist_output all` "
                                      "(rich output from every rank, merged) or `%dist_output rank0`.")
            set_output(arg)
            publish("stream", {"name": "stdout", "text": f"rich output from: {arg}\n"})
        elif name == "dist_empty_cache":
            if arg not in ("on", "off"):
                return error_content(UsageError, f"%dist_empty_cache {arg!r}: use on or off.")
            missing = await ranks.set_option("empty_cache", arg == "on")
            if missing:
                return error_content(RankRequestError, f"rank {format_ranks(missing)} did not confirm "
                                     "%dist_empty_cache; run it again, or restart the kernel.")
            publish("stream", {"name": "stdout", "text": f"empty_cache after each cell: {arg}\n"})
    return None
