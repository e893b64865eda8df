"""Fake ranks for driving the parent kernel in-process (``tests/unit`` only).

:class:`FakeRanks` implements :class:`dist_kernel.parent.ranks.Ranks`, the one seam between
the parent's Jupyter side and the rank processes, and nothing else: the kernel, its cell runs,
the merger, the fault policy, ipykernel's dispatch and the Jupyter session under test are the
real ones. Tests that use it claim only the parent's logic; that the ranks really behave so is
proven by the real-kernel lanes (``tests/kernel``, ``tests/cluster``).

Each fake rank runs a cell by a script: a function ``(rank, code) -> Act`` that says what
the rank publishes and how its cell ends (a reply, an error, blocked in a collective until
the group is torn down, or running until interrupted).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dist_kernel.exceptions import ConfigError, RankDiedError, RankRequestError
from dist_kernel.options import KernelConfig
from dist_kernel.protocol import META_GROUP_BROKEN, META_IOPUB, Place, Synced, with_meta


@dataclass
class Act:
    """What one fake rank does with a cell."""

    out: list[tuple[str, dict]] = field(default_factory=list)  # IOPub messages, in order
    error: tuple[str, str] | None = None  # (ename, evalue): the cell raises
    blocked_in: str | None = None  # blocked in this collective until the group is torn down
    runs: bool = False  # computes until interrupted (SIGINT raises KeyboardInterrupt)
    count: bool = True  # the reply says how many IOPub messages came before it (else: idle)


def stdout(text: str) -> tuple[str, dict]:
    return ("stream", {"name": "stdout", "text": text})


Script = Callable[[int, str], Act]


class FakeRanks:
    """N fake ranks behind the :class:`~dist_kernel.parent.ranks.Ranks` seam."""

    def __init__(self, kernel, world_size: int = 2, script: Script | None = None, hang_grace: float = 0.2,
                 runtime_dir: str = "") -> None:
        self.kernel = kernel  # receives the rank events, as from a RankSupervisor
        self.config = KernelConfig(world_size=world_size, backend="gloo", merge_window=0.01, hang_grace=hang_grace)
        self.ready = asyncio.Event()
        self.start_error: str | None = None
        self.runtime_dir = runtime_dir
        self.script: Script = script or (lambda rank, code: Act())
        self.sent: list[tuple[int, str, dict, dict]] = []  # (rank, msg_type, content, metadata)
        self.msg_ids: list[tuple[int, str, str]] = []  # (rank, msg_type, msg_id) of each send
        self.signalled: list[int] = []
        self.torn_down: list[int] = []
        self.formations = 0
        self.respawned: list[int] = []
        self.sampling: list[bool] = []  # sample_remote's calls (%dist_top)
        self.options: list[tuple[str, bool]] = []  # set_option's calls (the rank switches' magics)
        self.events: list[str] = []  # what the magics did to the ranks, in order (%dist_ranks, set_option)
        self.inputs: list[tuple[int, str]] = []
        self.groups: list[list[int]] = []  # the ranks of each reply group handed to a cell (send_cell)
        self._ids = itertools.count()
        self._dead: dict[int, str] = {}
        self._stopped: dict[int, str] = {}
        self._listeners: dict[str, Callable[[dict], None]] = {}
        self._running: dict[int, tuple[str, asyncio.Future, Act]] = {}  # rank -> its unfinished cell
        self._started = asyncio.Event()  # a rank started a cell
        self._sync: tuple[list[str], int] = ([], 0)  # the names and source of the last %dist_sync

    # ---------------------------------------------------------- the seam
    async def start(self) -> None:
        self.ready.set()

    def send(self, rank, msg_type, content, metadata=None, buffers=None, expect_reply=True, header=None):
        if rank in self._dead:
            raise RankDiedError(f"rank {rank} {self._dead[rank]}")
        msg_id = f"r{rank}_{next(self._ids)}"
        self.sent.append((rank, msg_type, content, metadata or {}))
        self.msg_ids.append((rank, msg_type, msg_id))
        fut = asyncio.get_running_loop().create_future() if expect_reply else None
        if msg_type == "execute_request":
            asyncio.get_running_loop().call_soon(self._run, rank, msg_id, fut, content["code"])
        return msg_id, fut

    def send_cell(self, ranks, content, metadata, on_replies):
        """The ranks answer as one node agent's would: the replies that come in one turn of the
        loop go to ``on_replies`` once per distinct reply, with the ranks that sent it. A rank
        that dies is told to the kernel only (``die``)."""
        sent, lost, turn = [], {}, []

        def replied(rank, fut):
            if fut.cancelled() or fut.exception() is not None:
                return
            turn.append((rank, fut.result()))
            if len(turn) == 1:
                asyncio.get_running_loop().call_soon(summary)

        def summary():
            groups: dict[str, tuple[list[int], dict]] = {}
            for rank, msg in turn:
                groups.setdefault(json.dumps([msg["content"], msg["metadata"]], sort_keys=True), ([], msg))[0].append(rank)
            turn.clear()
            self.groups.extend(ranks for ranks, _ in groups.values())
            for ranks, msg in groups.values():
                on_replies(ranks, msg)

        for rank in ranks:
            try:
                msg_id, fut = self.send(rank, "execute_request", content, metadata)
            except RankDiedError as e:
                lost[rank] = str(e)
                continue
            sent.append(msg_id)
            fut.add_done_callback(functools.partial(replied, rank))
        return sent, lost

    def listen(self, rank, msg_id, handler) -> None:
        self._listeners[msg_id] = handler

    def listen_all(self, msg_id, handler, on_group=None) -> None:
        rank = next(r for r, _, m in self.msg_ids if m == msg_id)
        self._listeners[msg_id] = functools.partial(handler, rank)

    async def where(self, rank):
        if self._stopped.get(rank):
            return None  # a stopped process does not answer
        cell = self._running.get(rank)
        collective = cell[2].blocked_in if cell else None
        return Place(collective=collective, group_ranks=list(range(self.config.world_size)), peer=None, seq=1,
                     stack=[f"  in cell: dist.{collective}(t)"] if collective else [], line="", busy=cell is not None)

    async def interrupt(self, ranks) -> None:
        for rank in ranks:
            self.signalled.append(rank)
            cell = self._running.get(rank)
            if cell and cell[2].runs and not self._stopped.get(rank):  # a blocked collective ignores SIGINT
                self._finish(rank, ("KeyboardInterrupt", ""))

    async def teardown(self, ranks) -> list[int]:
        self.torn_down.extend(ranks)
        for rank, cell in list(self._running.items()):
            if cell[2].blocked_in:
                self._finish(rank, ("DistBackendError", "Connection closed by peer"), broken=True)
        return []

    async def form_group(self) -> None:
        self.formations += 1

    def sync(self, names, src):
        """``%dist_sync``: each rank does what the script says of the code ``%dist_sync NAMES``
        (blocked in a collective until a teardown, running until interrupted, or ending); a rank
        that ends answers a ``Synced`` (each name copied), or its error as a failed request."""
        if self._dead:
            raise ConfigError(f"rank {min(self._dead)} is dead: run %dist_respawn first, then %dist_sync.")
        self._sync = (list(names), src)
        futures = {}
        for rank in range(self.config.world_size):
            futures[rank] = asyncio.get_running_loop().create_future()
            act = self.script(rank, "%dist_sync " + " ".join(names))
            self._running[rank] = (f"sync_{rank}", futures[rank], act)
            self._started.set()
            if not (act.blocked_in or act.runs):
                self._finish(rank, act.error)
        return futures

    async def respawn(self, ranks=None, auto: bool = False) -> list[int]:
        """Dead ranks come back (fresh: the test tells apart by ``respawned``), the group forms."""
        started = sorted(self._dead if ranks is None else ranks)
        for r in started:
            self._dead.pop(r, None)
        self.respawned.extend(started)
        self.formations += 1
        return started

    def alive(self, rank: int) -> bool:
        return rank not in self._dead

    def gone(self) -> list[int]:
        return sorted(self._dead)

    def stopped_ranks(self) -> list[int]:
        return sorted(r for r, state in self._stopped.items() if state)

    def live(self) -> list[int]:
        return [r for r in range(self.config.world_size) if r not in self._dead]

    def exit_reason(self, rank: int) -> str:
        return self._dead.get(rank, "")

    def stopped(self, rank: int) -> str:
        return self._stopped.get(rank, "")

    def pid(self, rank: int) -> int:
        return 1000 + rank

    def describe(self, rank: int) -> str:
        return f"pid {self.pid(rank)}"

    def os_state(self, rank: int) -> str:
        return "stopped" if self._stopped.get(rank) else "running"

    def log_tail(self, rank: int, lines: int = 15) -> str:
        return f"rank {rank}'s last words" if rank in self._dead else ""

    async def shell_request(self, rank, msg_type, content, timeout=10.0, channel="shell") -> dict:
        self.sent.append((rank, msg_type, content, {}))
        if msg_type == "comm_info_request":
            return {"status": "ok", "comms": {f"comm-of-{rank}": {"target_name": "jupyter.widget"}}}
        return {"status": "ok", "matches": [f"from_rank_{rank}"], "cursor_start": 0, "cursor_end": 0, "metadata": {}}

    def reply_input(self, rank: int, value: str) -> None:
        self.inputs.append((rank, value))

    async def status(self) -> dict[int, dict]:
        return {r: {"pid": self.pid(r), "state": "idle"} for r in range(self.config.world_size)}

    async def set_option(self, name: str, on: bool) -> list[int]:
        """Every live rank switched, as the supervisor's: the kernel's option from now on."""
        self.options.append((name, on))
        self.events.append(f"set_option {name} {on}")
        self.config = self.config.with_switch(name, on)
        return []

    async def resize(self, n: int) -> tuple[list[int], list[int]]:
        """``%dist_ranks N``: the world is ``n`` ranks from now on (fresh ones run the script too)."""
        old = self.config.world_size
        self.config = replace(self.config, world_size=n, ranks_per_node=n)
        self.events.append(f"resize {old} -> {n}")
        self.formations += 1
        return list(range(old, n)), list(range(n, old))

    def host(self, rank: int) -> str:
        return ""

    def agent_load(self, rank: int) -> dict | None:
        return None

    def sample_remote(self, on: bool) -> None:
        self.sampling.append(on)

    async def shutdown(self, now: bool = False) -> None:
        pass

    def cleanup_sync(self) -> None:
        pass

    # ---------------------------------------------- what the test makes happen
    def die(self, rank: int, reason: str = "exited with code -9 (SIGKILL)") -> None:
        """The rank's process is gone: its pending reply fails, the kernel is told."""
        self._dead[rank] = reason
        cell = self._running.pop(rank, None)
        if cell is not None and not cell[1].done():
            cell[1].set_exception(RankDiedError(f"rank {rank} {reason}"))
        self.kernel.on_rank_death(rank, reason)

    async def running(self, n: int) -> None:
        """Wait until ``n`` ranks are in the middle of a cell."""
        while len(self._running) < n:
            self._started.clear()
            await self._started.wait()

    def stop(self, rank: int) -> None:
        """SIGSTOP: the rank neither answers nor runs."""
        self._stopped[rank] = "stopped (SIGSTOP)"
        self.kernel.on_rank_stopped(rank, self._stopped[rank])

    def iopub(self, rank: int, msg_id: str, msg_type: str, content: dict) -> None:
        """The rank publishes one IOPub message for request ``msg_id``."""
        handler = self._listeners.get(msg_id)
        if handler is not None:
            handler({"header": {"msg_type": msg_type, "msg_id": f"{msg_id}_out"}, "msg_type": msg_type,
                     "parent_header": {"msg_id": msg_id}, "content": content, "metadata": {}})

    # ------------------------------------------------------------- inside
    def _run(self, rank: int, msg_id: str, fut: asyncio.Future, code: str) -> None:
        act = self.script(rank, code)
        for msg_type, content in act.out:
            self.iopub(rank, msg_id, msg_type, content)
        self._running[rank] = (msg_id, fut, act)
        self._started.set()
        if not (act.blocked_in or act.runs):
            self._finish(rank, act.error)

    def _finish(self, rank: int, error: tuple[str, str] | None, broken: bool = False) -> None:
        msg_id, fut, act = self._running.pop(rank)
        if msg_id.startswith("sync_"):  # a %dist_sync request, answered as a rank's typed reply
            names, src = self._sync
            if fut.done():
                return
            if error is not None:
                fut.set_exception(RankRequestError(f"rank {rank}: sync failed: {error[0]}: {error[1]}", *error))
            else:
                fut.set_result(Synced(copied={n: "sent from rank 0" if rank == src else "tensor 2 float32"
                                              for n in names}, failed={}))
            return
        published = len(act.out)
        if error is not None:
            ename, evalue = error
            err = {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}
            self.iopub(rank, msg_id, "error", err)  # as ipykernel: the error output, then the reply
            published += 1
            content = {"status": "error", **err, "execution_count": 1}
        else:
            content = {"status": "ok", "execution_count": 1, "user_expressions": {}, "payload": []}
        meta = {META_IOPUB: published} if act.count else {}
        if broken:
            meta[META_GROUP_BROKEN] = True
        if not fut.done():
            fut.set_result({"content": content, "metadata": with_meta({}, meta)})
        if not act.count:
            self.iopub(rank, msg_id, "status", {"execution_state": "idle"})
