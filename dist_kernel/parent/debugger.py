"""JupyterLab's debugger on one rank (``%dist_debug``).

Each rank is a stock ipykernel, whose control channel answers ``debug_request`` with its own
debugger (debugpy). The parent answers none itself: it forwards each ``debug_request`` of the
frontend to one chosen rank (rank 0 unless ``%dist_debug N`` chose another; none after
``%dist_debug off``) and returns that rank's ``debug_reply``. The rank's ``debug_event``s (its
IOPub, under whatever control request it handled last) reach the frontend on the parent's IOPub
as they are, not merged and not labelled, under the frontend's latest ``debug_request``, as
ipykernel publishes them.

The parent follows the ``stopped`` and ``continued`` events it relays: while the rank is stopped
at a breakpoint, the other ranks run on until they wait for it in a collective, and the fault
policy waits too (``fault_policy.Cell.debug_stopped``): neither the stall detector nor the hang
grace calls such a rank stuck. The stop button ends the cell as in ipykernel: the SIGINT reaches
the stopped rank too (debugpy waits in Python), and the ranks waiting for it in a collective are
freed as after any interrupt (fault rule 4).

A debug session (the frontend's ``initialize``, ``attach``, breakpoints and
``configurationDone``) is kept, so that ``%dist_debug N`` moves it to rank N: the old rank's
session ends (``disconnect``), the new rank gets the same requests. Shutdown and restart end it.

The session lives in one process. When the debugged rank dies, it is no longer stopped (a stale
"stopped" would keep the fault policy waiting for good) and the frontend hears its threads go on;
when a new process takes the rank's place (``%dist_respawn``, ``--respawn on``, ``%dist_ranks``),
the session is set up there again before the next cell or debug request reaches it
(:meth:`DebugSession.follow`), and nothing is asked of a process that never had it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from dist_kernel.exceptions import UsageError

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks

#: how long a rank's debugger may take to answer one request (attach starts debugpy)
DEBUG_TIMEOUT = 60.0
#: how long ending a session (shutdown, `%dist_debug N`) waits for each answer of the debugged rank
END_TIMEOUT = 3.0
#: the requests that make a session, replayed on a newly chosen rank (in this order)
SETUP = ("initialize", "attach")

#: ipykernel's seed for the cell file names' Murmur2 hash (``ipykernel.compiler.get_tmp_hash_seed``)
HASH_SEED = 0xC70F6907

#: publish an IOPub message of the parent: (parent request, msg_type, content)
Publish = Callable[[dict, str, dict], None]
#: a rank stopped at a breakpoint (the kernel says so in the running cell)
OnStopped = Callable[[int], None]

log = logging.getLogger("dist_kernel")


def debugpy_available() -> bool:
    """Can the ranks' Python (this one: the parent starts them with ``sys.executable``) debug?"""
    return importlib.util.find_spec("debugpy") is not None


def parse_dist_debug(arg: str, world_size: int) -> int | str:
    """``%dist_debug`` ARG: ``"show"`` (no argument), ``"off"``, or the rank to debug.
    ValueError, in words for the user, when ARG is none of them."""
    text = arg.split("#", 1)[0].strip().lower()
    if not text:
        return "show"
    if text == "off":
        return "off"
    if text == "on":
        return 0
    if text.isascii() and text.isdigit():
        rank = int(text)
        if rank < world_size:
            return rank
        raise ValueError(f"%dist_debug {arg.strip()}: rank {rank} does not exist; this kernel has ranks "
                         f"0-{world_size - 1}.")
    raise ValueError(f"%dist_debug {arg.strip()!r}: use `%dist_debug N` to debug rank N (0-{world_size - 1}), "
                     "`%dist_debug off`, or `%dist_debug` alone to see which rank is debugged.")


class DebugCall(Protocol):
    """What ``%dist_debug`` is given (:class:`~dist_kernel.parent.magics.MagicContext` is one)."""

    @property
    def ranks(self) -> Ranks: ...
    @property
    def debug(self) -> DebugSession: ...
    def say(self, text: str) -> None: ...


async def dist_debug(call: DebugCall, arg: str) -> None:
    """``%dist_debug N|off``: debug rank N, or no rank; alone, say which rank is debugged."""
    session, ranks = call.debug, call.ranks
    try:
        choice = parse_dist_debug(arg, ranks.config.world_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if choice in ("show", session.rank):
        await session.follow(ranks)  # the rank's process was replaced: its session is set up again
    else:
        await session.choose(ranks, None if choice == "off" else int(choice))
    call.say(session.describe())


def error_response(request: dict, message: str) -> dict:
    """A DAP error response to ``request`` (what the frontend shows when a request fails)."""
    return {"type": "response", "request_seq": request.get("seq", 0), "seq": 0, "success": False,
            "command": request.get("command", ""), "message": message,
            "body": {"error": {"id": 1, "format": message, "showUser": True}}}


def not_started(request: dict) -> dict:
    """The ``debugInfo`` reply of a rank whose debugger has not started, given while the ranks
    start (the control channel must not wait for them: the stop button travels on it). The
    cell files are named as the ranks name them (``rank/kernel.py``: ``cell_dir``)."""
    return {"type": "response", "request_seq": request.get("seq", 0), "seq": 0, "success": True,
            "command": request.get("command", "debugInfo"),
            "body": {"isStarted": False, "hashMethod": "Murmur2", "hashSeed": HASH_SEED,
                     "tmpFilePrefix": os.path.join(tempfile.gettempdir(), f"ipykernel_{os.getpid()}") + os.sep,
                     "tmpFileSuffix": ".py", "breakpoints": [], "stoppedThreads": [], "richRendering": True,
                     "exceptionPaths": ["Python Exceptions"], "copyToGlobals": True}}


class DebugSession:
    """Which rank the frontend's debugger talks to, what it set up there, and whether that rank
    is stopped. Lives on the parent's main loop (the control thread hands requests over)."""

    def __init__(self, publish: Publish, on_stopped: OnStopped | None = None, rank: int | None = 0) -> None:
        self.publish = publish
        self.on_stopped = on_stopped
        self.rank = rank  # the debugged rank; None: off
        self.stopped: set[Any] = set()  # the debugged rank's thread ids stopped (``"all"``: every one)
        self._parent: dict = {}  # the frontend's latest debug_request: events are published under it
        self._setup: dict[str, dict] = {}  # initialize, attach, as the frontend sent them
        self._breakpoints: dict[str, dict] = {}  # source path -> the latest setBreakpoints request
        self._configured: dict | None = None  # the configurationDone request, once sent
        self._on: int | None = None  # the pid of the process that holds the session

    # --------------------------------------------------------------- state
    @property
    def active(self) -> bool:
        """Has the frontend started a session (``initialize``) that it has not ended?"""
        return "initialize" in self._setup

    def stopped_ranks(self) -> tuple[int, ...]:
        """The ranks stopped at a breakpoint now (the fault policy waits for them)."""
        return (self.rank,) if self.rank is not None and self.stopped else ()

    def describe(self) -> str:
        if self.rank is None:
            return "debugger: off (`%dist_debug N` debugs rank N)\n"
        state = ", stopped at a breakpoint" if self.stopped else ""
        return f"debugger: rank {self.rank}{state}\n"

    # ------------------------------------------------------- frontend side
    async def request(self, ranks: Ranks | None, parent: dict) -> dict:
        """One ``debug_request`` of the frontend: the chosen rank's reply content."""
        content = dict(parent.get("content") or {})
        self._parent = parent
        command = content.get("command", "")
        if self.rank is None:
            return error_response(content, "The debugger is off in this kernel: run `%dist_debug 0` "
                                  "(or another rank) to debug a rank.")
        if ranks is None or not ranks.ready.is_set() or ranks.start_error or not ranks.alive(self.rank):
            if command == "debugInfo":  # JupyterLab asks as the kernel starts: no session yet
                return not_started(content)
            return error_response(content, f"rank {self.rank} is not running (yet): the debugger "
                                  "talks to it once it is.")
        if command == "disconnect":
            if self.active and ranks.pid(self.rank) != self._on:  # its process, and the session, are gone
                self._forget()
                return {"type": "response", "request_seq": content.get("seq", 0), "seq": 0, "success": True,
                        "command": command}
            # never end the rank's process (a frontend may ask): the group would lose a rank
            content["arguments"] = dict(content.get("arguments") or {}, terminateDebuggee=False)
        else:
            await self.follow(ranks)
        reply = await self._forward(ranks, self.rank, content)
        if command in SETUP and reply.get("success", True):
            self._on = ranks.pid(self.rank)
        self._remember(content, reply)
        return reply

    async def _forward(self, ranks: Ranks, rank: int, content: dict, timeout: float = DEBUG_TIMEOUT) -> dict:
        try:
            return await ranks.shell_request(rank, "debug_request", content, timeout=timeout, channel="control")
        except asyncio.TimeoutError:
            return error_response(content, f"rank {rank}'s debugger did not answer "
                                  f"{content.get('command')!r} in {timeout:g} s")
        except Exception as e:  # noqa: BLE001 - a dead rank: the frontend is told
            return error_response(content, f"rank {rank}: {e}")

    def _remember(self, content: dict, reply: dict) -> None:
        """Keep what a session set up on the rank, to set it up again on another."""
        command = content.get("command", "")
        ok = bool(reply.get("success", True))
        if command in SETUP and ok:
            self._setup[command] = content
        elif command == "setBreakpoints":
            path = ((content.get("arguments") or {}).get("source") or {}).get("path")
            if path:
                self._breakpoints[path] = content
        elif command == "configurationDone":
            self._configured = content
        elif command == "disconnect":
            self._forget()

    def _forget(self) -> None:
        self._setup.clear()
        self._breakpoints.clear()
        self._configured = None
        self.stopped.clear()
        self._on = None

    # ------------------------------------------------- the rank replaced
    def rank_died(self, rank: int) -> None:
        """A rank's process is gone. The debugged one is stopped no longer (the fault policy
        must not wait for it), and the frontend hears its stopped threads go on."""
        if rank != self.rank or not self.stopped:
            return
        threads = [t for t in self.stopped if t != "all"]
        self.stopped.clear()
        self.publish(self._parent, "debug_event", {
            "seq": 0, "type": "event", "event": "continued",
            "body": {"threadId": threads[0] if threads else 1, "allThreadsContinued": True}})

    async def follow(self, ranks: Ranks) -> None:
        """Set the session up again on a process that took the debugged rank's place (a respawn,
        ``%dist_ranks``), so that its breakpoints hit and its requests are answered: the
        frontend does not know the process changed."""
        rank = self.rank
        if rank is None or not self.active or not ranks.alive(rank) or ranks.pid(rank) == self._on:
            return
        self.stopped.clear()
        await self._set_up(ranks, rank)

    async def _set_up(self, ranks: Ranks, rank: int) -> None:
        """The session's requests, replayed on ``rank`` (moved there, or its process replaced)."""
        requests = [*(self._setup[c] for c in SETUP if c in self._setup), *self._breakpoints.values(),
                    *([self._configured] if self._configured is not None else [])]
        self._on = ranks.pid(rank)
        for content in requests:
            reply = await self._forward(ranks, rank, content)
            if not reply.get("success", True):
                log.warning("debugger: %s on rank %d failed: %s", content.get("command"), rank, reply.get("message"))

    # ---------------------------------------------------------- rank side
    def routing(self, other: Callable[[int, dict], None]) -> Callable[[int, dict], None]:
        """The ranks' unrouted IOPub handler: debug events here, the rest to ``other``."""
        def route(rank: int, msg: dict) -> None:
            if msg["header"]["msg_type"] == "debug_event":
                self.on_event(rank, msg["content"])
            else:
                other(rank, msg)

        return route

    def on_event(self, rank: int, event: dict) -> None:
        """A rank's ``debug_event``: the chosen rank's reaches the frontend, as it is."""
        if rank != self.rank:
            return  # a rank left behind by %dist_debug N: its session is over
        name = event.get("event")
        body = event.get("body") or {}
        if name == "stopped":
            self.stopped.add("all" if body.get("allThreadsStopped") else body.get("threadId"))
        elif name == "continued":
            if body.get("allThreadsContinued", True):
                self.stopped.clear()
            else:
                self.stopped.discard(body.get("threadId"))
                self.stopped.discard("all")
        elif name in ("terminated", "exited"):
            self.stopped.clear()
        self.publish(self._parent, "debug_event", event)
        if name == "stopped" and self.on_stopped is not None:
            self.on_stopped(rank)

    # ------------------------------------------------------------ control
    async def choose(self, ranks: Ranks, rank: int | None) -> None:
        """``%dist_debug N`` / ``off``: move the session (if any) to rank N, or end it."""
        if rank == self.rank:
            return
        old, self.rank = self.rank, rank
        was_stopped = bool(self.stopped)
        self.stopped.clear()
        if not self.active:
            return
        if old is not None:
            await self._end_on(ranks, old, was_stopped)
        if rank is None:
            self._forget()
            return
        # the same session on the new rank: the frontend does not know it moved
        await self._set_up(ranks, rank)

    async def _end_on(self, ranks: Ranks, rank: int, stopped: bool) -> None:
        """End the session on ``rank`` (debugpy lets stopped threads go on); nothing is asked of
        a process that never had it (one that took the place of the rank's dead one).

        Each request is waited for END_TIMEOUT at most, and ``disconnect`` is always sent: the
        session is over for the frontend either way, and a rank slow to answer (a loaded machine)
        must not hold up the magic or the shutdown (``%dist_debug 0`` once gave no output for
        120 s), nor keep a session that a later ``attach`` would find started."""
        if not ranks.alive(rank) or ranks.pid(rank) != self._on:
            return
        if stopped:
            await self._forward(ranks, rank, {"type": "request", "seq": 0, "command": "continue",
                                              "arguments": {"threadId": 1}}, timeout=END_TIMEOUT)
        await self._forward(ranks, rank, {"type": "request", "seq": 0, "command": "disconnect",
                                          "arguments": {"restart": False, "terminateDebuggee": False}},
                            timeout=END_TIMEOUT)

    async def end(self, ranks: Ranks | None) -> None:
        """Shutdown or restart: end the session on the debugged rank (END_TIMEOUT per answer)."""
        if ranks is None or self.rank is None or not self.active:
            return
        with contextlib.suppress(Exception):
            await self._end_on(ranks, self.rank, bool(self.stopped))
        self._forget()
