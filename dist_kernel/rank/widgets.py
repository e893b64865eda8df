"""Widgets made the same way on every rank are one widget in the frontend (issue 19).

ipywidgets, ``tqdm.notebook`` and anything else that opens a comm from the kernel name it with a
random uuid, so N ranks running ``IntSlider()`` would open N comms and the notebook would show N
sliders. In a rank, a comm opened while a request runs is named instead after

- the frontend's request (its msg_id, which the parent gives every rank as ``dist_kernel.cell``),
- what the comm opens with (target, data, metadata, buffers),
- and how many comms the rank opened with exactly these before, in that request.

Identical widgets created in the same order therefore get the same id on every rank, and the
parent shows one comm for them (:class:`dist_kernel.parent.comms.CommRouter`); widgets that
differ between ranks (``IntSlider(value=rank)``) get different ids and stay separate. A comm
opened outside any request (a background thread) keeps its random id: nothing else can tell
the ranks' copies apart.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from dist_kernel.protocol import META_CELL, meta_of

#: requests whose counters are remembered (comms opened late by a cell's thread still count on)
_CELLS = 64


class CommIds:
    """Deterministic comm ids: one counter per request and content digest."""

    def __init__(self, current_cell: Callable[[], str | None]) -> None:
        self.current_cell = current_cell
        self._counts: OrderedDict[str, dict[str, int]] = OrderedDict()

    def next_id(self, target_name: str, data: Any, metadata: Any, buffers: Any) -> str | None:
        """The id for a comm opened now with this content; None outside a request."""
        cell = self.current_cell()
        if not cell:
            return None
        digest = hashlib.sha256()
        digest.update(json.dumps([cell, target_name, data, metadata], sort_keys=True, default=repr).encode())
        for buf in buffers or ():
            digest.update(bytes(buf))
        key = digest.hexdigest()
        counts = self._counts.setdefault(cell, {})
        self._counts.move_to_end(cell)
        while len(self._counts) > _CELLS:
            self._counts.popitem(last=False)
        n = counts.get(key, 0)
        counts[key] = n + 1
        # 32 hex digits, like the uuid4().hex it replaces
        return hashlib.sha256(f"{key}:{n}".encode()).hexdigest()[:32]


def cell_of(parent: dict | None) -> str | None:
    """The frontend request a rank's request stands for (``dist_kernel.cell``), if the parent said."""
    cell = meta_of((parent or {}).get("metadata")).get(META_CELL)
    return cell if isinstance(cell, str) and cell else None


def install(current_parent: Callable[[], dict | None]) -> CommIds:
    """Make ``comm.create_comm`` (what ipywidgets calls) name the comms it opens deterministically."""
    import comm

    ids = CommIds(lambda: cell_of(current_parent()))
    create = comm.create_comm

    def create_comm(target_name: str = "comm", data: Any = None, metadata: Any = None, buffers: Any = None,
                    comm_id: str | None = None, primary: bool = True, **kwargs: Any) -> Any:
        if not comm_id and primary:
            comm_id = ids.next_id(target_name, data, metadata, buffers)
        return create(target_name=target_name, data=data, metadata=metadata, buffers=buffers,
                      comm_id=comm_id, primary=primary, **kwargs)

    comm.create_comm = create_comm
    return ids
