"""``%dist_top``: live per-rank load in one display, updated in place about once a second while
a cell runs; ``%dist_top off`` stops it. And the same columns for ``%dist_status``'s snapshot.

Where each number comes from, so that nothing runs on the ranks' Python main threads:

- state and the cell's line: the ``where`` request the fault policy already uses (answered by the
  rank's control thread), asked of the cell's busy ranks only; the idle ones are idle;
- CPU and RSS: psutil, read from ``/proc`` by the parent for the ranks on its machine, and by each
  node agent for its node's ranks, which it adds to its beat only while the parent asks (a cell
  runs with ``%dist_top`` on);
- the GPU: NVML (:mod:`dist_kernel.load`), in the same two places.

No cell running, no sampling. A cell shorter than :data:`INTERVAL` shows no table.

A live view is not output: frontends save a display's last state into the notebook (nbclient,
papermill and ``nbconvert --execute`` as they run it, JupyterLab when it is saved). So the table
is shown only to a frontend where a person watches the cell run: one whose cells allow stdin
(:func:`watched`), or ``python -m dist_kernel run`` on a terminal (``META_LIVE``; it draws the
table as a status line and keeps it out of the notebook it saves). When the cell ends the display
is emptied, so a notebook saved afterwards keeps no table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dist_kernel.exceptions import UsageError
from dist_kernel.load import LoadSampler, clean, gpu_target
from dist_kernel.parent.top_table import TopRow, bundle, state_of
from dist_kernel.protocol import META_LIVE, meta_of

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks
    from dist_kernel.protocol import Place

#: seconds between two updates of the display
INTERVAL = 1.0
#: how long a ``%dist_status`` snapshot measures CPU over (on this machine)
SNAPSHOT_WINDOW = 0.25
#: marks the display's content metadata, so ``python -m dist_kernel run`` can tell it apart
META = {"dist_kernel": {"top": True}}
#: ``%dist_top`` where no person watches the cells run (nbclient, papermill, nbconvert)
NOT_SHOWN = ("dist_top: on, but not shown here: this frontend runs cells with no one to answer input() "
             "(nbclient, papermill, nbconvert), and a live view is kept out of the notebook it saves. "
             "`python -m dist_kernel run` shows it on a terminal.\n")

#: publish an IOPub message in the running cell: (msg_type, content)
Publish = Callable[[str, dict], None]


def watched(request: dict) -> bool:
    """Does a person watch this execute request run? Its cells allow stdin (JupyterLab, Notebook,
    VS Code: no person, no ``input()``, as with nbclient), or its frontend says it shows the table
    live (``META_LIVE``)."""
    return bool(request.get("content", {}).get("allow_stdin")) or \
        meta_of(request.get("metadata")).get(META_LIVE) is True


def local_loads(ranks: Ranks, sampler: LoadSampler, which: list[int]) -> dict[int, dict]:
    """Samples of the ranks in ``which``: taken here for this machine's ranks, the node agents'
    latest for the others (empty until one came)."""
    cfg = ranks.config
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    out: dict[int, dict] = {}
    for r in which:
        if cfg.remote:
            out[r] = clean(ranks.agent_load(r))
        elif ranks.alive(r):
            out[r] = sampler.sample(ranks.pid(r), gpu_target(cfg.gpus, cfg.local_rank_of(r), mask))
        else:
            out[r] = clean(None)
    if not cfg.remote:
        sampler.forget({p for r in which if (p := ranks.pid(r)) is not None})
    return out


def host_of(ranks: Ranks, rank: int) -> str:
    """The machine a rank runs on, by name (this one's for local ranks)."""
    return ranks.host(rank) or socket.gethostname()


class TopMonitor:
    """Whether ``%dist_top`` is on, and the live display of the cell running now."""

    def __init__(self, sampler: LoadSampler | None = None, interval: float = INTERVAL) -> None:
        self.on = False
        self.sampler = sampler if sampler is not None else LoadSampler()
        self.interval = interval
        self._task: asyncio.Task | None = None
        self._display_id: str | None = None
        self._end: Callable[[], None] | None = None

    # ---------------------------------------------------------- live table
    def start_cell(self, ranks: Ranks, busy: Callable[[], list[int]], at_breakpoint: Callable[[], tuple[int, ...]],
                   publish: Publish, live: bool = True) -> None:
        """A cell starts: while ``%dist_top`` is on and a person watches (``live``, :func:`watched`),
        show and update its table until :meth:`end_cell`."""
        self.end_cell()
        if not self.on or not live:
            return
        ranks.sample_remote(True)
        self._display_id = None

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.interval)  # first after one interval: short cells show nothing
                places = await self._places(ranks, busy())
                self._show(publish, self.rows(ranks, busy(), at_breakpoint(), places))

        def end() -> None:
            ranks.sample_remote(False)
            if self._display_id is not None:  # the cell is over: the live view goes, and no saved notebook keeps it
                publish("update_display_data", {"data": {}, "metadata": META,
                                                 "transient": {"display_id": self._display_id}})

        self._end = end
        self._task = asyncio.ensure_future(loop())

    def end_cell(self) -> None:
        """The cell ended: stop updating, and empty the table's display."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        end, self._end = self._end, None
        if end is not None:
            with contextlib.suppress(Exception):  # the table must never fail a cell
                end()
        self._display_id = None

    async def _places(self, ranks: Ranks, busy: list[int]) -> dict[int, Place | None]:
        """Where each busy, live, running rank is (None: it did not answer)."""
        asked = [r for r in busy if ranks.alive(r) and not ranks.stopped(r)]
        answers = await asyncio.gather(*(ranks.where(r) for r in asked), return_exceptions=True)
        return {r: a if not isinstance(a, BaseException) else None for r, a in zip(asked, answers, strict=True)}

    def rows(self, ranks: Ranks, busy: list[int], at_breakpoint: tuple[int, ...],
             places: dict[int, Place | None]) -> list[TopRow]:
        """Every rank's row now."""
        world = list(range(ranks.config.world_size))
        loads = local_loads(ranks, self.sampler, world)
        rows = []
        for r in world:
            place = places.get(r)
            state = state_of(alive=ranks.alive(r), stopped=ranks.stopped(r), at_breakpoint=r in at_breakpoint,
                             busy=r in busy, place=place)
            rows.append(TopRow(rank=r, host=host_of(ranks, r), state=state, load=loads[r],
                               line=place.line if place is not None and r in busy else ""))
        return rows

    def _show(self, publish: Publish, rows: list[TopRow]) -> None:
        """The first table of a cell is a display; the later ones update it in place."""
        first = self._display_id is None
        if first:
            self._display_id = f"dist-top-{uuid.uuid4().hex}"
        content = {"data": bundle(rows), "metadata": META, "transient": {"display_id": self._display_id}}
        publish("display_data" if first else "update_display_data", content)


class TopCall(Protocol):
    """What ``%dist_top`` is given (:class:`~dist_kernel.parent.magics.MagicContext` is one)."""

    @property
    def top(self) -> TopMonitor: ...
    @property
    def live(self) -> bool: ...  # a person watches this request run (:func:`watched`)
    def say(self, text: str) -> None: ...


async def dist_top(call: TopCall, arg: str) -> None:
    """``%dist_top`` (on) and ``%dist_top off``."""
    word = arg.split("#", 1)[0].strip().lower()
    if word not in ("", "on", "off"):
        raise UsageError(f"%dist_top {arg.strip()!r}: use `%dist_top` to show each rank's load while cells run, "
                         "`%dist_top off` to stop.")
    call.top.on = word != "off"
    call.say("dist_top: off" if not call.top.on
             else "dist_top: on (a table of each rank's load, updated while cells run)" if call.live else NOT_SHOWN)


async def status_loads(ranks: Ranks) -> dict[int, dict]:
    """``%dist_status``'s snapshot of every rank's load: CPU over :data:`SNAPSHOT_WINDOW` here,
    the node agents' latest beat for remote ranks."""
    sampler = LoadSampler()
    world = list(range(ranks.config.world_size))
    local_loads(ranks, sampler, world)  # starts the CPU counts
    if not ranks.config.remote:
        await asyncio.sleep(SNAPSHOT_WINDOW)
    return local_loads(ranks, sampler, world)
