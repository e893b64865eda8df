"""``%dist_status``: one row per rank, as text and as HTML, and where the kernel's output log is."""

from __future__ import annotations

import asyncio
import html
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from dist_kernel.options import KernelConfig
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


class StatusCall(Protocol):
    """What ``%dist_status`` is given (:class:`~dist_kernel.parent.magics.MagicContext` is one)."""

    @property
    def ranks(self) -> Ranks: ...
    @property
    def publish(self) -> Callable[[str, dict], None]: ...
    @property
    def starting(self) -> Collection[int]:
        """The ranks ``--respawn on`` is starting anew now: shown so, without waiting for them."""
    @property
    def output_log(self) -> str:
        """Where the kernel's output log is."""


async def dist_status(call: StatusCall, arg: str) -> None:
    """``%dist_status``: each rank's row, with ``%dist_top``'s columns as a snapshot."""
    ranks = call.ranks
    table, loads = await asyncio.gather(ranks.status(), status_loads(ranks))
    # n/a where unknown (no NVML, no GPU)
    table = {r: {**row, **status_columns(loads.get(r, {})), **({"state": STARTING} if r in call.starting else {})}
             for r, row in table.items()}
    call.publish("display_data", status_bundle(table, ranks.config, call.output_log))
