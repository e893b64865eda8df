"""Rank supervision: launch the ranks, form their group, watch them, end them.

A rank is a :class:`~dist_kernel.parent.launch.base.RankHandle` that a
:class:`~dist_kernel.parent.launch.base.GangLauncher` handed out (how it was started, on this
machine or another) and a :class:`~dist_kernel.parent.channels.RankChannel` (how the parent
talks to it). The supervisor never asks which launcher it has. Formation and every other
rank-side action are typed requests of :mod:`dist_kernel.protocol`.

What the Jupyter side asks of the ranks (cells and their routes, where, status, options) is
:class:`~dist_kernel.parent.ranks.SupervisedRanks`, built on this class. A node's grouped replies
and outputs reach it through the supervisor's own hooks (:meth:`RankSupervisor.grouped_reply`,
:meth:`~RankSupervisor.grouped_output`), which the supervisor hands its launcher.

Everything here runs on the parent's main event loop; other threads cross over with
``asyncio.run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from dist_kernel import protocol
from dist_kernel.exceptions import ConfigError, RankDiedError, RankRequestError, RankStartError
from dist_kernel.options import KernelConfig
from dist_kernel.parent import limits
from dist_kernel.parent import membership_words as words
from dist_kernel.parent.channels import RankChannel, Routes
from dist_kernel.parent.fault_policy import RemoteCause
from dist_kernel.parent.gang_fault import GangFault
from dist_kernel.parent.launch import RankHandle, make_gang_launcher
from dist_kernel.parent.reaper import RuntimeDir
from dist_kernel.processes import state_words

LOG_TAIL_LINES = 30
#: how long a rank may take to answer a quick typed request (where, status, teardown)
ANSWER_TIMEOUT = 2.0
#: /proc states of a process that will not run until someone resumes it
STOPPED = ("T", "t")


@dataclass
class Rank:
    """One rank, as the parent knows it."""

    rank: int
    process: RankHandle
    channel: RankChannel | None = None
    exit_reason: str | None = None
    device: str = ""
    stopped: str = ""  # the OS state words while the process is stopped (SIGSTOP, a debugger)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.exit_reason is None

    @property
    def host(self) -> str:
        """The machine of a rank on another machine ("" on this one)."""
        return self.process.host

    @property
    def host_address(self) -> str:
        return self.process.address

    @property
    def where(self) -> str:
        """The words that find the process: its pid, and its host when it is elsewhere."""
        return f"pid {self.pid} on {self.host}" if self.host else f"pid {self.pid}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return self.process.log_tail(lines)


class RankSupervisor:
    """Owns the rank processes of one kernel: starts them (in waves), forms and breaks their group,
    watches them (exit, SIGSTOP, a fault that takes every rank) and ends them."""

    def __init__(self, config: KernelConfig, on_unrouted: Callable[[int, dict], None],
                 on_death: Callable[[int, str], None], log: logging.Logger | None = None,
                 on_stdin: Callable[[int, dict], None] | None = None,
                 on_stopped: Callable[[int, str], None] | None = None,
                 extra_argv: list[str] | None = None, on_note: Callable[[str], None] | None = None) -> None:
        self.config = config  # the options now: %dist_ranks and the rank switches' magics change them
        #: what a rank joining for the first time installs; formation switches it as config says after
        self.switches_at_start = config.rank_switches()
        self.on_unrouted = on_unrouted
        #: msg_id -> the handlers of a request sent to many ranks (a cell): its IOPub, its replies
        self.routes = Routes()
        self.on_stdin = on_stdin or (lambda rank, msg: None)
        self.on_death = on_death
        self.on_stopped = on_stopped or (lambda rank, state: None)
        self.log = log or logging.getLogger("dist_kernel")
        self._dir = RuntimeDir()  # swept first; its reaper cleans up if this process is SIGKILLed
        self.runtime_dir = self._dir.path
        # where the ranks run (--launcher): this machine, or nodes a node starter starts
        self.launcher = make_gang_launcher(config, self.runtime_dir, list(extra_argv or []), self.log,
                                           on_note or (lambda text: None))
        self.launcher.on_fault = self._on_fault
        self.launcher.on_change = self._changed
        self.launcher.on_replies = self.grouped_reply
        self.launcher.on_outputs = self.grouped_output
        self.ranks: dict[int, Rank] = {}
        self.generation = 0
        # one seed for all ranks of this start (a fresh one per restart, unless --seed)
        self.seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**31)
        self.ready = asyncio.Event()
        self.start_error: str | None = None
        self.closing = False
        self._watch_task: asyncio.Task | None = None
        # faults on other machines, heard for a moment before one is named (fault_policy rule 6)
        self.fault = GangFault(self._hold_replies, self._report_fault)
        # ranks seen stopped: looked at on every turn of _watch until they run again, so a
        # continue is noticed even if its event was lost (a handful of ranks, never all)
        self.seen_stopped: set[int] = set()
        #: when each rank died (monotonic), for --respawn's "keeps dying" rule
        self.deaths: dict[int, list[float]] = {}

    # ------------------------------------------------------------- hooks
    def grouped_reply(self, ranks: list[int], msg: dict) -> bool:
        """A reply that several of a node's ranks sent alike, as their node agent summarised it
        (the launcher's ``on_replies``): True once it is taken whole, for its cell's run. Here
        nothing takes it, so each rank's channel gets it; :class:`~dist_kernel.parent.ranks.SupervisedRanks`,
        which sends the cells, takes its cells' replies."""
        return False

    def grouped_output(self, ranks: list[int], msg: dict) -> bool:
        """Likewise an IOPub message that several of a node's ranks sent alike (``print(1)`` on
        every rank: the launcher's ``on_outputs``)."""
        return False

    # ------------------------------------------------------------- startup
    async def start(self) -> None:
        """Start every rank and form the group; never raises, sets ``start_error``."""
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self._start(), timeout=self.config.startup_timeout)
            self.log.info("ranks ready in %.2fs", time.monotonic() - t0)
        except asyncio.TimeoutError:
            self.start_error = (
                f"The ranks did not start and form the process group within "
                f"{self.config.startup_timeout:.0f}s. {self._rank_states()}Fix: look at the ranks' "
                "state above; on a slow or busy machine raise --startup-timeout; then restart the kernel.")
        except Exception as e:  # noqa: BLE001 - reported to the user in the first cell
            self.start_error = str(e) if isinstance(e, (RankStartError, ConfigError)) else f"{type(e).__name__}: {e}"
        if self.start_error:
            await self.shutdown(now=True)
        else:
            # what start-up made lives as long as the kernel: out of the collector's way, so that the
            # collections that a cell's per-rank objects set off do not walk it each time
            gc.freeze()
        self.ready.set()

    async def _start(self) -> None:
        """Ranks start in waves of at most ``launcher.wave`` that are starting at once (process
        start to answering ``kernel_info``): many ranks on one machine must not starve this
        process, which answers the frontend meanwhile. Each rank joins the group (imports torch)
        as soon as *it* is up."""
        if not self.config.remote:
            limits.make_room(self.config.world_size)  # or a ConfigError naming the limit, before any rank
        self._watch_task = asyncio.ensure_future(self._watch())
        self.generation = 1
        slots = asyncio.Semaphore(self.launcher.wave)
        tasks: list[asyncio.Task] = []

        async def bring_up(handle: RankHandle) -> None:
            try:
                await self.connect(handle)
            finally:
                slots.release()
            await self.join(handle.rank, first=True)

        ranks = self.launcher.start(self.config.world_size)
        try:
            while True:
                await slots.acquire()
                failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
                if failed is not None:
                    raise failed.exception()  # type: ignore[misc]
                try:
                    handle = await anext(ranks)
                except StopAsyncIteration:
                    break
                tasks.append(asyncio.ensure_future(bring_up(handle)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def connect(self, process: RankHandle) -> None:
        """Know a launched rank, and wait until it answers (also for a rank started anew)."""
        rank = process.rank
        r = Rank(rank=rank, process=process)
        self.ranks[rank] = r
        self._changed(process)  # a change the launcher heard before the rank was known here
        connection, wire = process.wire()

        async def alive() -> bool:
            return await process.poll() is None and not process.exit_reason()

        channel = RankChannel(rank, connection, self.log, self.on_unrouted, self.on_stdin, wire=wire, alive=alive,
                              routes=self.routes)
        channel.start()
        r.channel = channel
        try:
            await channel.wait_for_ready(timeout=self.config.startup_timeout)
        except RuntimeError as e:
            raise RankStartError(
                f"rank {rank} ({r.where}) did not start: {e}\n{r.log_tail()}\n"
                f"{self._start_fix(r)}") from None

    def _start_fix(self, r: Rank) -> str:
        """The advice for a rank that failed to start: blame the install only when it is at fault;
        once the kernel runs (a respawn), ``%dist_respawn`` tries again."""
        reason = (r.exit_reason or r.process.exit_reason()) if not r.alive or r.process.returncode is not None else ""
        tail = r.log_tail() if reason else ""
        return words.start_fix(reason, "Error" in tail or "Traceback" in tail, self.ready.is_set(), sys.executable)

    async def join(self, rank: int, first: bool) -> None:
        """One rank joins the group of the current generation (:mod:`~dist_kernel.parent.formation`
        forms it on every rank)."""
        cfg = self.config
        r = self.ranks[rank]
        assert r.channel is not None
        req = protocol.Join(rank=rank, world_size=cfg.world_size, local_rank=cfg.local_rank_of(rank),
                            backend=cfg.backend, store=self.launcher.store(self.generation),
                            timeout=cfg.timeout, use_cuda=cfg.uses_cuda, first=first,
                            seed=self.seed if first else None, switches=self.switches_at_start,
                            local_world_size=cfg.ranks_per_node)
        try:
            reply = await r.channel.request(req, timeout=cfg.startup_timeout)
        except RankRequestError as e:
            raise RankStartError(words.join_failed(rank, cfg.backend, str(e), sys.executable)) from None
        except RankDiedError:
            raise RankStartError(f"rank {rank} ({r.where}) {r.exit_reason or 'died'} while joining the "
                                 f"process group.\n{r.log_tail()}\n{self._start_fix(r)}") from None
        except asyncio.TimeoutError:  # no empty message: which rank, how long, what to do
            raise RankStartError(words.not_joined(rank, cfg.startup_timeout, self.ready.is_set())) from None
        r.device = reply.device

    # ------------------------------------------------------------ requests
    def channel(self, rank: int) -> RankChannel:
        r = self.ranks[rank]
        if not r.alive or r.channel is None:
            raise RankDiedError(f"rank {rank} {r.exit_reason or 'is not running'}")
        return r.channel

    async def ask(self, rank: int, req: protocol.Request, timeout: float = ANSWER_TIMEOUT) -> object | None:
        """A typed request to one rank; None when the rank is gone or does not answer in time."""
        try:
            return await self.channel(rank).request(req, timeout)
        except (asyncio.TimeoutError, RankDiedError, RankRequestError, protocol.ProtocolError) as e:
            self.log.warning("rank %d: %s: %s", rank, req.op, e or "no answer")
            return None

    async def teardown(self, ranks: list[int] | tuple[int, ...]) -> list[int]:
        """Break the group on these ranks, so that collectives blocked on it raise; the ranks
        that did not confirm (the caller says so: their peers may stay blocked)."""
        pids = {r: rk.pid for r, rk in self.ranks.items() if rk.alive and rk.pid}
        asked = [r for r in ranks if r in pids]

        def teardown(r: int) -> protocol.Teardown:
            # a pid means something only on its own machine: peers elsewhere are named by address
            me = self.ranks[r].host_address
            return protocol.Teardown(
                peer_pids=[p for q, p in pids.items() if q != r and self.ranks[q].host_address == me],
                peer_hosts=sorted({self.ranks[q].host_address for q in pids if self.ranks[q].host_address != me}))

        replies = await asyncio.gather(*(self.ask(r, teardown(r), timeout=5.0) for r in asked))
        return [r for r, reply in zip(asked, replies, strict=True) if reply is None]

    # ------------------------------------------------------------ liveness
    async def _watch(self, interval: float = 0.2) -> None:
        """Notice the launcher failing; and, where the launcher cannot tell of each rank's changes
        (:attr:`GangLauncher.watches`), a rank process that exits or is stopped. Where it can, a
        rank is looked at only when it changed (:meth:`_changed`): an idle parent does no work
        per rank, however many there are."""
        while not self.closing:
            if self.ready.is_set():
                failure = self.launcher.failure()  # the node starter ended: a cancelled job, a time limit, a lost link
                if failure:
                    self._on_fault(RemoteCause("launcher", failure))
            for rank in list(self.seen_stopped):
                await self._look_at(self.ranks[rank])
            if not self.launcher.watches:
                for r in list(self.ranks.values()):
                    await self._look_at(r)
            await asyncio.sleep(interval)

    def _changed(self, handle: RankHandle) -> None:
        """The launcher heard a rank's process change (exit, stop, continue): look at it."""
        r = self.ranks.get(handle.rank)
        if r is not None and r.process is handle and not self.closing:
            asyncio.ensure_future(self._look_at(r))

    async def _look_at(self, r: Rank) -> None:
        """Tell the kernel of a rank that exited, was stopped, or runs again."""
        if not r.alive:
            self.seen_stopped.discard(r.rank)
            return
        await r.process.poll()
        reason = r.process.exit_reason()
        # while a fault that takes the gang settles (a cancelled job SIGTERMs every rank), the
        # ranks die of its cause, named once it is known (_report_fault)
        if reason and not self.fault.settling:
            self._died(r, reason)
            return
        state = r.process.os_state()
        stopped = state_words(state) if state in STOPPED else ""
        if stopped:
            self.seen_stopped.add(r.rank)
        else:
            self.seen_stopped.discard(r.rank)
        if stopped != r.stopped:
            r.stopped = stopped
            with contextlib.suppress(Exception):
                self.on_stopped(r.rank, stopped)  # "" when it runs again

    def _died(self, r: Rank, reason: str) -> None:
        """A rank is gone: fail what waits on it and tell the kernel (once)."""
        if not r.alive:
            return
        r.exit_reason = reason
        self.deaths.setdefault(r.rank, []).append(time.monotonic())
        if r.channel is not None:
            r.channel.fail_pending(f"rank {r.rank} ({r.where}) {reason}")
        self.launcher.died(r.process)  # what it started dies with it (its group, what left it)
        with contextlib.suppress(Exception):
            self.on_death(r.rank, reason)

    def _on_fault(self, cause: RemoteCause) -> None:
        """Something took the whole gang (on another machine: a node lost, its agent ending, a
        rank that exited, the launcher ended): heard, and named once it settled (:class:`GangFault`)."""
        if not self.closing:
            self.fault.heard(cause)

    def _hold_replies(self) -> None:
        """A rank's reply that comes while a fault settles (gloo's "Read error" on a peer of the
        rank that died) is not its part of the story: every rank's part is the cause, once named."""
        for r in self.ranks.values():
            if r.channel is not None:
                r.channel.hold_replies()

    def _report_fault(self, cause: RemoteCause) -> None:
        """Name the cause on the ranks it took, stop the survivors on every node: nothing is
        left running anywhere."""
        if self.closing:
            return
        for rank in cause.ranks:
            if rank in self.ranks:
                self._died(self.ranks[rank], f"is gone: {cause.text}")
        for r in self.ranks.values():
            self._died(r, f"was stopped on {r.host}: {cause.text}" if r.host else f"was stopped: {cause.text}")
        if not self.ready.is_set() and self.start_error is None:
            self.start_error = f"{cause.text}. Restart the kernel to try again."
        asyncio.ensure_future(self.launcher.stop(now=True))

    def _rank_states(self) -> str:
        return words.rank_states({r.rank: (r.where, r.exit_reason or state_words(r.process.os_state()))
                                  for r in self.ranks.values()})

    # ------------------------------------------------------------ the end
    async def shutdown(self, now: bool = False) -> None:
        """End every rank process and remove the runtime directory."""
        self.closing = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        for r in self.ranks.values():
            if r.channel is not None:
                r.channel.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.launcher.stop(now=now), 10)
        # what the ranks started outside their process groups (os.setsid, daemons) too
        await asyncio.get_running_loop().run_in_executor(None, self._dir.end, self._rank_pids())

    def cleanup_sync(self) -> None:
        """Last-resort cleanup when the parent exits without a shutdown request (at exit, from any
        thread): the launcher's last resort, then every process of the kernel (the ranks'
        sessions and groups included)."""
        self.closing = True
        self.launcher.stop_now()
        self._dir.end(self._rank_pids())

    def _rank_pids(self) -> list[int]:
        """The rank processes on this machine (their sessions and groups are the kernel's).
        Ranks on other machines have pids that mean nothing here: their agents end them, and
        the node starter records what it started for the reaper."""
        return [p for p in (r.pid for r in self.ranks.values() if not r.host) if p]
