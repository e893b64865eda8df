"""Merge the outputs of N ranks into the outputs of one cell.

Pure logic, no I/O: the parent feeds each rank's IOPub outputs in, with the time they
arrived, and takes back the messages to publish.

Each rank's outputs form an ordered queue of *items* (:mod:`.units`): a stream line (text up to
and including ``\\n``), a rich output, a display update or a ``clear_output``. The merger aligns
the queues like a diff (:mod:`.alignment`), and hands each item, with the ranks that gave it, to
rendering (:mod:`.rendering`):

- an item that every participating rank produced identically is published once, unlabelled,
  so the saved notebook reads like a single-process run;
- an item that differs, or that only some ranks produced, is published labelled with the
  ranks that produced it (``[rank 1] ...``, or ``[rank 0,2] ...`` for a subset; :mod:`.labels`);
- items are aligned by sequence, not by the clock: the k-th item of a rank is the candidate
  twin of the k-th item of the others (after the insertions a diff finds), however late it
  arrives. An item waits for a rank that has not reached its place yet while that rank is
  running the cell, has been silent for less than :data:`LAG_BOUND` (in send times: what
  waited between the rank and the merger does not count), and has not kept giving
  different items (:data:`DIVERGE_AFTER`); it waits for no rank that finished, is past its
  place, or gave something else there; a rank alone is never delayed; memory bounds the wait
  too (``max_pending``, ``max_bytes``). Each rank's own order is always kept; nothing is dropped.
- an item the rank made inside a branch on the rank (``if rank == 0:``, marked by
  :mod:`dist_kernel.rank.branches`) waits only the window for its twins: the cell's code says
  the other ranks may never make it. It takes no place in the rank's sequence (an extra, as a
  diff sees it), so the ranks' later identical items still align.

In a cell run by several ranks, a rank that calls ``clear_output`` on its own (the others
have not reached the same point) would erase the other ranks' output. Instead, that output goes
to an *area*: one display per group of ranks, updated in place with ``update_display_data`` (what
ipyparallel does per engine). A line rewritten with ``\\r`` (a progress bar) is one display, a
line per rank, redrawn in place, one shared line where the ranks agree (:mod:`.bars`). What a
rank makes inside an ipywidgets ``Output`` goes into the widget plainly, and nothing else does
(:mod:`.captures`).

Display ids: a display shows, for every rank, the newest content that rank gave it; ranks that
agree share one unlabelled rendering, ranks that differ are shown side by side, labelled, in
the same display, so updates still land in place (:class:`DisplayRegistry`).

An item waits longer for its twins the larger it is (:data:`SIZE_RATE`): a large output takes
each rank a while to serialise and send, and an identical one must still be sent once.

Errors: the cell's status and its one merged error come from the ranks' ``execute_reply``
(:meth:`CellMerger.rank_replied`); :func:`merge_errors` turns them into the one ``error`` output
a cell may have, published at the end (:mod:`.errors`). An IOPub ``error`` that is not the one its
rank's reply reports (an exception an ipywidgets ``Output`` swallowed, or ``showtraceback()``) is
an ordinary output. A rank publishes its cell error before its reply, so its ``error`` items are
held until the reply says which one it was, or :data:`ERROR_HOLD` after later output of the
rank shows it is still running.

The work per output and per reply does not grow with the number of ranks (issue 26): the
alignment keeps the ranks with output queued and counts of ranks by place and by item, instead of
looking at every rank (:mod:`.queues`).
"""

from dist_kernel.parent.merge.alignment import DIVERGE_AFTER, LAG_BOUND
from dist_kernel.parent.merge.cell import ERROR_HOLD, CellMerger
from dist_kernel.parent.merge.errors import merge_errors, strip_ansi
from dist_kernel.parent.merge.labels import label, label_lines, namespaced_display_id, unmarked
from dist_kernel.parent.merge.rendering import WIDGET_VIEW, DisplayRegistry, Emit
from dist_kernel.parent.merge.units import SIZE_RATE, render_cr, split_units

__all__ = [
    "DIVERGE_AFTER", "ERROR_HOLD", "LAG_BOUND", "SIZE_RATE", "WIDGET_VIEW", "CellMerger",
    "DisplayRegistry", "Emit", "label", "label_lines", "merge_errors", "namespaced_display_id", "render_cr",
    "split_units", "strip_ansi", "unmarked",
]
