"""The parent kernel: speaks Jupyter to the frontend, routes cells to ranks, merges outputs.

It never imports torch. Handlers follow ipykernel's naming (``do_execute``, ...). Rank
traffic lives on the main event loop; control-channel handlers (interrupt, shutdown) run on
ipykernel's control thread and cross over with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import signal
import sys
from datetime import datetime
from typing import Any, TypeVar

from ipykernel.kernelbase import Kernel
from jupyter_client.session import Session
from traitlets import Any as AnyTrait

from dist_kernel import __version__
from dist_kernel.exceptions import ConfigError, RankSpecError, UsageError, error_content
from dist_kernel.options import KernelConfig
from dist_kernel.parent import magics
from dist_kernel.parent.answers import CaptureAnswers, reply_after_answers
from dist_kernel.parent.comms import COMM_TYPES, CommRequests, CommRouter
from dist_kernel.parent.debugger import DebugSession, debugpy_available
from dist_kernel.parent.execution import CellRun, CellSpec, GroupState
from dist_kernel.parent.group_magics import IdleRespawn
from dist_kernel.parent.held import HoldsBusy, pressed_before, sent_at
from dist_kernel.parent.magics import MagicContext
from dist_kernel.parent.merge import DisplayRegistry
from dist_kernel.parent.one_rank import OneRankRequests
from dist_kernel.parent.output_log import OutputLogging
from dist_kernel.parent.ranks import Ranks, SupervisedRanks
from dist_kernel.parent.relay import Outlet, OutputRelay
from dist_kernel.parent.replies import AbortsAfterError, always_reply
from dist_kernel.parent.selection import plan_cell
from dist_kernel.parent.startup import StartWait, dead_in, unusable
from dist_kernel.parent.stdin import RankInput
from dist_kernel.parent.sync_run import SyncRun
from dist_kernel.parent.throttle import OutputBudget
from dist_kernel.parent.top import TopMonitor, watched
from dist_kernel.protocol import META_CELL, META_COUNT, META_RANKS, META_SOURCE, with_meta

Run = TypeVar("Run", bound=CellRun)
AT_BREAKPOINT = ("rank {rank} is stopped at a breakpoint (debugger): the other ranks run on until they wait for it "
                 "in a collective. Continue in the debugger, or press stop to end the cell on every rank.")


class DistributedKernel(HoldsBusy, OutputLogging, RankInput, AbortsAfterError, OneRankRequests, CommRequests, Kernel):
    """Runs each cell on N ranks that form one torch.distributed process group."""

    implementation = "dist_kernel"
    implementation_version = __version__
    language_info = {
        "name": "python",
        "version": ".".join(map(str, sys.version_info[:3])),
        "mimetype": "text/x-python",
        "codemirror_mode": {"name": "ipython", "version": 3},
        "pygments_lexer": "ipython3",
        "nbconvert_exporter": "python",
        "file_extension": ".py",
    }
    help_links = [{"text": "dist_kernel", "url": "https://pypi.org/project/dist-kernel/"}]

    dist_config = AnyTrait(None)  # KernelConfig, or the ConfigError found at launch
    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    _execute_sleep = 0.0  # the base class sleeps 0.5 ms per reply, blocking the event loop
    # comms (widgets, tqdm.notebook) are not in the base Kernel's message types
    msg_types = [*Kernel.msg_types, *COMM_TYPES]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.output_policy = KernelConfig.rich_output
        self.extra_argv: list[str] = []  # kernel arguments from the frontend, passed to every rank
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._current: CellRun | None = None
        self.ranks: Ranks | None = None  # the ranks' seam (SupervisedRanks: a RankSupervisor's)
        self.comms = CommRouter(self._publish, self._callback_run)
        self.answers = CaptureAnswers()  # a cell's reply waits for nbclient's answers to captured output
        self.debug = DebugSession(self._publish, self._debug_stopped)  # JupyterLab's debugger, on one rank
        self.top = TopMonitor()  # %dist_top: each rank's load, live while cells run
        self._output_budget = OutputBudget()  # replaced in start(): spill files in the runtime dir
        self._displays = DisplayRegistry()  # display ids live across cells
        self._starting = StartWait(self._publish)  # a cell waiting for the ranks to start
        self.group = GroupState()  # ranks left running, a pending re-formation: from cell to cell
        self._warnings: list[str] = []  # the configuration's warnings, shown once, in the first cell
        self._exiting = False
        self._respawning = IdleRespawn()  # --respawn on: a rank that died between cells
        # every request gets a reply, even when its handler raises (a plain handler would not)
        self.shell_handlers = {t: always_reply(self, t, h) for t, h in self.shell_handlers.items()}
        self.control_handlers = {t: always_reply(self, t, h) for t, h in self.control_handlers.items()}

    @property
    def _session(self) -> Session:
        """The kernel's session (ipykernel types it optional: the app sets it before start)."""
        assert self.session is not None
        return self.session

    # ---------------------------------------------------------------- info
    @property
    def banner(self) -> str:  # type: ignore[override]
        cfg = self.dist_config
        if isinstance(cfg, KernelConfig):
            return f"Distributed Python {__version__} (dist_kernel): {cfg.describe()}"
        return f"Distributed Python {__version__} (dist_kernel): configuration error"

    @property
    def kernel_info(self) -> dict:
        info = super().kernel_info
        # the debugger is one rank's (parent/debugger.py); no subshells: the parent cannot honour them
        info["supported_features"] = ["debugger"] if debugpy_available() else []
        return info

    # ------------------------------------------------------------- startup
    def start(self) -> None:
        super().start()
        self._main_loop = asyncio.get_event_loop()
        cfg = self.dist_config
        if isinstance(cfg, KernelConfig):
            ranks = SupervisedRanks(cfg, self.debug.routing(self.comms.on_unrouted), self.on_rank_death, log=self.log,
                                    on_stdin=self.on_rank_stdin, on_stopped=self.on_rank_stopped,
                                    extra_argv=self.extra_argv, on_note=self._starting.note)
            atexit.register(_last_cleanup, ranks)
            self.attach(ranks)
            self.io_loop.add_callback(ranks.start)

    def attach(self, ranks: Ranks) -> None:
        """Run cells on ``ranks`` (their events come back to the ``on_*`` methods below)."""
        self.ranks = ranks
        self.output_policy = ranks.config.rich_output
        self._warnings = list(ranks.config.warnings)
        # one output budget for the kernel's life (late output of background threads
        # counts too); spill files live in the private runtime dir, removed at shutdown
        self._output_budget = OutputBudget(spill_dir=ranks.runtime_dir)

    async def _ready_error(self, code: str = "") -> dict | None:
        """Wait for the ranks (and a rank started anew, unless ``code`` need not: :func:`magics.waits`);
        the error to show, if any."""
        cfg = self.dist_config
        if isinstance(cfg, ConfigError):
            return error_content(ConfigError, str(cfg))
        ranks = self.ranks
        if ranks is None:
            return error_content(ConfigError, "the kernel has no configuration")
        if not ranks.ready.is_set():
            stopped = await self._starting.wait(ranks, self.get_parent("shell"))
            if stopped:
                return stopped
        if self._respawning.pending and magics.waits(code):  # --respawn on: a rank that died between cells comes back first
            self._held.release()
            await self._respawning.settle(functools.partial(self._publish, self.get_parent("shell")))
        return unusable(ranks)

    # ------------------------------------------------------------- execute
    def _publish(self, parent: dict, msg_type: str, content: dict, metadata: dict | None = None,
                 buffers: list | None = None) -> None:
        # explicit parent: relayed output is published from tasks outside the handler context;
        # re-signed with the parent's session (frontends ignore a foreign header.session)
        if self._held:  # without taking its lock: this runs for every output
            self._held.release()
        self.answers.published(parent, msg_type, content)
        # _topic: private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
        self._session.send(self.iopub_socket, msg_type, content, parent=parent, ident=self._topic(msg_type),
                          metadata=metadata, buffers=buffers)
        self.output_log.output(parent, msg_type, content)

    def _fail(self, parent: dict, err: dict, silent: bool) -> dict:
        if not silent:
            self._publish(parent, "error", err)
        return {"status": "error", "execution_count": self.execution_count, **err}

    @reply_after_answers  # nbclient's answers to captured output first: one sent as the reply came hid it
    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict | None = None, allow_stdin: bool = False,
                         *, cell_meta: dict | None = None, cell_id: str | None = None) -> dict:
        parent = self.get_parent("shell")
        if self._warnings and not silent:
            for text in self._warnings:
                self._publish(parent, "stream", {"name": "stderr", "text": f"[dist_kernel] warning: {text}\n"})
            self._warnings = []
        if self.ranks is None or not self.ranks.ready.is_set():
            self._held.release()  # the cell waits for the ranks: it is busy meanwhile
        err = await self._ready_error(code)
        if err:
            return self._fail(parent, err, silent)
        ranks = self.ranks
        assert ranks is not None
        try:  # the kernel's magics first, in the cell's order; then the rest, on the ranks they leave
            calls, rest = magics.read(code)
            if calls:
                self._held.release()  # a magic may take a while (%dist_ranks): the cell is busy meanwhile
                err = await magics.run(self._magic_context(parent), calls)
            plan = plan_cell(rest, ranks.config.world_size) if not err else None
        except (UsageError, RankSpecError) as e:
            err, plan = error_content(type(e), str(e)), None
        if err:
            return self._fail(parent, err, silent)
        assert plan is not None  # planned unless the cell failed before
        if calls and not plan.code.strip():
            return {"status": "ok", "execution_count": self.execution_count, "user_expressions": {}, "payload": []}
        err = dead_in(ranks, plan.ranks)
        if err:
            return self._fail(parent, err, silent)
        await self.group.reform_if_due(ranks, ranks.config.startup_timeout, first=self._held.release)
        await self.debug.follow(ranks)  # the debugged rank's process was replaced: its breakpoints are set there again
        run = self._run(CellRun, plan.ranks, parent)
        content = {"code": plan.code, "silent": silent, "store_history": store_history,
                   "user_expressions": user_expressions or {}, "allow_stdin": allow_stdin,
                   "stop_on_error": False}
        # a selection's ranks travel along (not the whole world's: no request grows with the ranks):
        # rank-side code (fastai's show_batch) shows what one process would once, from the first
        # and the frontend's msg_id: comms the ranks open for it are named after it (widgets as one)
        meta = with_meta({"cellId": cell_id} if cell_id else {},
                         {**({} if plan.ranks == run.world else {META_RANKS: list(plan.ranks)}),
                          META_CELL: parent["header"]["msg_id"], META_COUNT: self.execution_count,
                          # the debugger's file of the cell is named after the source the frontend sent
                          **({META_SOURCE: code} if plan.code != code else {})})
        self._input_for(parent, allow_stdin)
        self._current = run
        for msg_id in run.start(content, meta):
            self.comms.sent(msg_id, parent["header"]["msg_id"])
        self._held.release()
        self.top.start_cell(ranks, lambda: run.busy_ranks, self.debug.stopped_ranks,
                            lambda t, c: self._publish(parent, t, c), live=watched(parent))
        try:
            result = await run.finish()
        finally:
            self.top.end_cell()
            self._current = None
            self._stdin = None

        payload = result.reply.get("payload", [])
        if any(p.get("source") == "ask_exit" and not p.get("keepkernel") for p in payload):
            self._exit_soon()  # exit()/quit(): end like a plain kernel; the frontend restarts it
        if result.error is not None:
            if not silent:
                self._publish(parent, "error", result.error)
            return {"status": "error", "execution_count": self.execution_count, **result.error}
        return {"status": "ok", "execution_count": self.execution_count,
                "user_expressions": result.reply.get("user_expressions", {}),
                # payloads (pager, set_next_input) from one rank only, or the frontend acts N times
                "payload": payload}

    def _run(self, kind: type[Run], on: tuple[int, ...] | None, parent: dict) -> Run:
        """A run of the frontend's request ``parent`` on ``on`` (None: every rank), by the kernel's options."""
        assert self.ranks is not None  # a run needs the ranks
        spec = CellSpec.of(self.ranks.config, on, self.execution_count, parent, self.output_policy == "rank0")
        return kind(spec, self._outlet(parent), self.ranks, self.group, debug_stopped=self.debug.stopped_ranks)

    def _magic_context(self, parent: dict) -> MagicContext:
        """What the magics of the frontend's request ``parent`` are given."""
        assert self.ranks is not None  # magics run once the ranks are ready
        launched = self.dist_config if isinstance(self.dist_config, KernelConfig) else self.ranks.config
        return MagicContext(self.ranks, lambda t, c: self._publish(parent, t, c), launched, self.debug, self.top,
                            functools.partial(setattr, self, "output_policy"), functools.partial(self._copy, parent),
                            self._respawning.starting, self.output_log.note, live=watched(parent))

    async def _copy(self, parent: dict, names: list[str], src: int) -> str:
        """``%dist_sync`` as the current cell (:class:`SyncRun`): the stop button and deaths reach it."""
        self._current = run = self._run(SyncRun, None, parent)
        try:
            return await run.copy(names, src)
        finally:
            self._current = None

    def _outlet(self, parent: dict) -> Outlet:
        """Where the output of the frontend's request ``parent`` goes."""
        return Outlet(lambda t, c: self._publish(parent, t, c), lambda rank, msg: self.comms.relay(rank, msg, parent),
                      budget=self._output_budget, displays=self._displays)

    def _callback_run(self, owners: list[int], parent: dict) -> OutputRelay:
        """What merges what a shared widget's callback prints on its ranks (it sends nothing)."""
        assert self.ranks is not None  # the router calls this only once the ranks are ready
        cfg = self.ranks.config
        return OutputRelay(owners, self._outlet(parent), self.execution_count, cfg.merge_window,
                           world=range(cfg.world_size))

    # ------------------------------------------------------- rank events
    def on_rank_death(self, rank: int, reason: str) -> None:
        """A rank's process is gone (the supervisor noticed); between cells, ``--respawn on`` acts."""
        if self._exiting:
            return  # exit() ends every rank on purpose
        self.log.error("rank %d %s", rank, reason)
        self.debug.rank_died(rank)  # stopped at a breakpoint no longer: the hang checks must not wait for it
        if self._current is not None:
            self._current.on_rank_died(rank, reason)
        elif self.ranks is not None:
            self._respawning.died(self.ranks, rank, reason)

    def on_rank_stopped(self, rank: int, state: str) -> None:
        """A rank was stopped (``state`` in words) or runs again (``state`` empty)."""
        if not state:
            if self.ranks is not None and rank in self.group.left_running:
                # the interrupt it got while stopped may have gone to another thread on resume:
                # signal it again now that it runs, so its cell ends
                asyncio.ensure_future(self.ranks.interrupt([rank]))
            return
        if self._current is not None:
            self._current.on_rank_stopped(rank)

    def _debug_stopped(self, rank: int) -> None:
        """The debugged rank stopped at a breakpoint: the running cell says so, once."""
        if self._current is not None:
            self._current.notice(AT_BREAKPOINT.format(rank=rank), key=("breakpoint", rank))

    async def do_debug_request(self, msg: dict) -> dict:
        """JupyterLab's debugger: answered by one rank's (parent/debugger.py), on the main loop."""
        return await self._on_main(self.debug.request(self.ranks, self.get_parent("control")))

    # -------------------------------------------------------------- comms
    async def comm_info_request(self, stream: Any, ident: Any, parent: dict) -> None:
        """The comms of every rank, merged."""
        reply = await self.comms.info(self.ranks, parent["content"])
        self._session.send(stream, "comm_info_reply", reply, parent, ident=ident)

    # ---------------------------------------------------------- control
    def pre_handler_hook(self) -> None:
        """Keep the parent's SIGINT handler (interrupt the ranks) while handling requests."""

    def post_handler_hook(self) -> None:
        """See :meth:`pre_handler_hook`."""

    def _on_main(self, coro: Any) -> Any:
        """Run a coroutine on the main loop from the control thread; await the result."""
        assert self._main_loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, self._main_loop)
        return asyncio.wrap_future(fut)

    async def interrupt_request(self, stream: Any, ident: Any, parent: dict) -> None:
        """Interrupt every busy rank (interrupt_mode "message": the parent is not signalled)."""
        content: dict = {"status": "ok"}
        if self.ranks is not None:
            try:
                # the stop button acts on what ran when it was pressed: a cell the frontend sent
                # after it (its request can reach the parent first) must not be hit
                await asyncio.wait_for(self._on_main(self._interrupt_busy(sent_at(parent))), 5)
            except Exception as e:  # noqa: BLE001
                content = {"status": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": []}
        self._session.send(stream, "interrupt_reply", content, parent, ident=ident)

    async def _interrupt_busy(self, pressed: datetime | None = None) -> None:
        """The stop button. Before the ranks are ready it ends the waiting cell and never
        signals a starting rank; during a cell it signals the busy ranks (the fault policy
        tears the group down for those a collective keeps from reacting); between cells it
        signals only ranks left running by an earlier cell."""
        ranks = self.ranks
        assert ranks is not None
        if not ranks.ready.is_set():
            self._starting.stop(pressed)
            return
        run = self._current
        if run is not None and pressed_before(pressed, run.parent):
            return  # pressed before this cell was sent: meant for what ran then, or for nothing
        if run is None:
            await ranks.interrupt(sorted(self.group.left_running))
            return
        await run.stop()

    def _exit_soon(self) -> None:
        """``exit()`` in a cell: like a plain kernel, end (after the reply is sent)."""
        self._exiting = True

        async def end() -> None:
            await asyncio.sleep(0.1)
            if self.ranks is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ranks.shutdown(now=True), 10)
            self.io_loop.stop()

        asyncio.ensure_future(end())

    async def do_shutdown(self, restart: bool) -> dict:
        if self.ranks is not None:
            with contextlib.suppress(Exception):
                await self._on_main(self.debug.end(self.ranks))
            try:
                await asyncio.wait_for(self._on_main(self.ranks.shutdown()), 10)
            except Exception:
                self.log.exception("clean rank shutdown failed; killing ranks")
            self.ranks.cleanup_sync()
        return {"status": "ok", "restart": restart}


def ignore_sigterm() -> None:
    """The parent is ending its ranks on its way out: a SIGTERM now (a kernel manager's
    escalation, sent after its shutdown request) would cut that short with SystemExit. SIGKILL
    still ends the parent; its reaper then ends the ranks."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _last_cleanup(ranks: Ranks) -> None:
    ignore_sigterm()
    ranks.cleanup_sync()
