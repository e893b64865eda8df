"""Display ids that IPython makes up agree across the ranks (issue 30).

``display(x, display_id=True)`` and ``DisplayHandle()`` name the display with a random id
(``IPython.core.display_functions._new_id``), so N ranks showing the same progress display
made N displays, each labelled with its rank, and each of its updates N times. In a rank, an
id made while a request runs is named instead after

- the frontend's request (its msg_id, which the parent gives every rank as ``dist_kernel.cell``,
  as for comm ids in :mod:`dist_kernel.rank.widgets`): ids stay unique across cells;
- the call path that asked for it: each frame's code (qualified name, file name, first line)
  and the instruction it is at, from the caller of ``display`` up to the shell's ``run_code``;
- and how many ids this call path made before, in that request.

The same display made by the same code on every rank therefore gets the same id, and the parent
shows one display whose updates land in place (:class:`dist_kernel.parent.merge.DisplayRegistry`
shows ranks that then differ side by side in it). Naming the call path, not only counting,
keeps a display made on one rank only (``if rank == 0:``, fastprogress on rank 0 under fastai)
from shifting the ids of the displays every rank makes later. The content is not part of the id:
it is not known yet when the id is made, and a display that differs per rank is still one
display in a plain kernel. An id made outside any request keeps its random value.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import OrderedDict
from collections.abc import Callable
from types import CodeType, FrameType

from dist_kernel.rank.widgets import cell_of

#: requests whose counters are remembered (a cell's thread may still make ids after it)
_CELLS = 64
#: frames of the call path that name a display (deeper ones are all the kernel's or a library's)
_DEPTH = 64


def call_path(frame: FrameType | None, stop: CodeType | None = None, skip: frozenset[str] = frozenset()) -> str:
    """Where ``frame`` is, and what called it, the same on every rank running the same code:
    no absolute paths (nodes may install elsewhere), no addresses. Frames of files in ``skip``
    (IPython's display functions) are left out; the walk ends at ``stop``'s frame."""
    parts: list[str] = []
    depth = 0
    while frame is not None and depth < _DEPTH:
        code = frame.f_code
        if code is stop:
            break
        if code.co_filename not in skip:
            name = getattr(code, "co_qualname", code.co_name)
            parts.append(f"{os.path.basename(code.co_filename)}:{name}:{code.co_firstlineno}:{frame.f_lasti}")
            depth += 1
        frame = frame.f_back
    return "|".join(parts)


class DisplayIds:
    """Deterministic display ids: one counter per request and call path."""

    def __init__(self, current_cell: Callable[[], str | None]) -> None:
        self.current_cell = current_cell
        self._counts: OrderedDict[str, dict[str, int]] = OrderedDict()

    def next_id(self, path: str) -> str | None:
        """The id for a display asked for now from ``path``; None outside a request."""
        cell = self.current_cell()
        if not cell:
            return None
        counts = self._counts.setdefault(cell, {})
        self._counts.move_to_end(cell)
        while len(self._counts) > _CELLS:
            self._counts.popitem(last=False)
        n = counts.get(path, 0)
        counts[path] = n + 1
        # 32 hex digits, like the b2a_hex(os.urandom(16)) it replaces
        return hashlib.sha256(f"display:{cell}:{path}:{n}".encode()).hexdigest()[:32]


def install(current_parent: Callable[[], dict | None], stop: CodeType | None = None) -> DisplayIds:
    """Make IPython's ``display(..., display_id=True)`` and ``DisplayHandle()`` name their
    displays deterministically; ``stop`` is the shell's ``run_code`` (above it: the kernel)."""
    from IPython.core import display_functions

    ids = DisplayIds(lambda: cell_of(current_parent()))
    random_id = display_functions._new_id
    skip = frozenset({display_functions.__file__, __file__})

    def _new_id() -> str:
        found = ids.next_id(call_path(sys._getframe(1), stop, skip))
        return found if found is not None else random_id()

    # display() and DisplayHandle.__init__ look the name up in their module when they run
    display_functions._new_id = _new_id
    return ids
