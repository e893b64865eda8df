"""The parent kernel: speaks Jupyter to the frontend, routes cells to ranks, merges outputs.

It never imports torch. Handlers follow ipykernel's naming (``do_execute``, ...). Rank
traffic lives on the main event loop; control-channel handlers (interrupt, shutdown) run on
ipykernel's control thread and cross over with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import signal
import sys
import threading
import time
from collections import deque
from datetime import datetime
from typing import Any

from ipykernel.kernelbase import Kernel
from traitlets import Any as AnyTrait

from dist_kernel import __version__
from dist_kernel.exceptions import ConfigError, RankDiedError, RankSpecError
from dist_kernel.iopub import UnboundedIOPubApp
from dist_kernel.options import KernelConfig
from dist_kernel.parent import fault_policy
from dist_kernel.parent.comms import CommRouter
from dist_kernel.parent.execution import OUTPUT_TYPES, CellRun
from dist_kernel.parent.launcher import state_words
from dist_kernel.parent.magics import format_ranks, plan_cell
from dist_kernel.parent.merge import DisplayRegistry, error_content, label_lines
from dist_kernel.parent.status import status_bundle
from dist_kernel.parent.stdin import InputBroker
from dist_kernel.parent.supervisor import RankSupervisor
from dist_kernel.parent.throttle import OutputBudget

#: how many finished requests' listeners are kept, to place late output (background threads)
_RECENT = 64


class DistributedKernel(Kernel):
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
    _execute_sleep = 0.0  # the base class sleeps 0.5 ms per reply, blocking the event loop
    # comms (widgets, tqdm.notebook) are not in the base Kernel's message types
    msg_types = [*Kernel.msg_types, "comm_open", "comm_msg", "comm_close"]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.output_policy = KernelConfig.rich_output
        self.supervisor: RankSupervisor | None = None
        self.extra_argv: list[str] = []  # kernel arguments from the frontend, passed to every rank
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._current: CellRun | None = None
        self._stdin: InputBroker | None = None
        self.comms = CommRouter()
        self._output_budget = OutputBudget()  # replaced in start(): spill files in the runtime dir
        self._displays = DisplayRegistry()  # display ids live across cells
        self._listening: deque[tuple[int, str]] = deque()  # (rank, msg_id) of recent requests
        self._start_interrupted = asyncio.Event()  # the stop button while the ranks start
        self._waiting: dict | None = None  # the request of a cell waiting for the ranks to start
        self._start_notes: list[str] = []  # what the launcher said while the ranks start (the Slurm queue)
        self._warnings: list[str] = []  # the configuration's warnings, shown once, in the first cell
        self._left_running: set[int] = set()  # ranks whose cell was given up on (abandoned)
        self._exiting = False
        self._reform_pending = False  # a re-formation waits for a rank that was left running
        # a cell's busy and execute_input, held back until its requests are on their way to the
        # ranks (see _publish_status): the ranks start sooner, and nothing is published before them
        self._held: list[tuple] = []
        self._held_lock = threading.RLock()
        # every request gets a reply, even when its handler raises (a plain handler would not)
        self.shell_handlers = {t: self._always_reply(t, h) for t, h in self.shell_handlers.items()}
        self.control_handlers = {t: self._always_reply(t, h) for t, h in self.control_handlers.items()}

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
        info["supported_features"] = []  # no debugger, no subshells: the parent cannot honour them
        return info

    # ------------------------------------------------------------- startup
    def start(self) -> None:
        super().start()
        self._main_loop = asyncio.get_event_loop()
        cfg = self.dist_config
        if isinstance(cfg, KernelConfig):
            self.output_policy = cfg.rich_output
            self._warnings = list(cfg.warnings)
            self.supervisor = RankSupervisor(cfg, self._on_unrouted, self._on_rank_death, log=self.log,
                                             on_stdin=self._on_rank_stdin, on_stopped=self._on_rank_stopped,
                                             extra_argv=self.extra_argv, on_note=self._on_start_note)
            atexit.register(self.supervisor.cleanup_sync)
            # one output budget for the kernel's life (late output of background threads
            # counts too); spill files live in the private runtime dir, removed at shutdown
            self._output_budget = OutputBudget(spill_dir=self.supervisor.runtime_dir)
            self.io_loop.add_callback(self.supervisor.start)

    def _always_reply(self, msg_type: str, handler: Any) -> Any:
        """Wrap a handler so that a request it fails on still gets an error reply.

        The handler gets the stream's socket itself: a reply sent through tornado's ZMQStream
        is queued and sent on a later turn of the loop (or by the flush after the request),
        at a cost in CPU per request (issue 14). The handler runs on the stream's own thread."""
        async def handle(stream: Any, ident: Any, parent: dict) -> None:
            stream = getattr(stream, "socket", stream)
            try:
                result = handler(stream, ident, parent)
                if asyncio.iscoroutine(result):
                    await result
            except Exception as e:  # noqa: BLE001 - answered, logged, and the kernel goes on
                self.log.exception("handler for %s failed", msg_type)
                if msg_type.endswith("_request"):
                    reply = {"status": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": []}
                    self.session.send(stream, msg_type.replace("_request", "_reply"), reply, parent, ident=ident)
        return handle

    async def _ready_error(self) -> dict | None:
        """Wait for the ranks; the error to show if the kernel cannot run cells."""
        cfg = self.dist_config
        if isinstance(cfg, ConfigError):
            return error_content("ConfigError", str(cfg))
        sup = self.supervisor
        if sup is None:
            return error_content("ConfigError", "the kernel has no configuration")
        if not sup.ready.is_set():
            # the stop button while the ranks start ends this cell, never a starting rank
            self._start_interrupted.clear()
            self._waiting = self.get_parent("shell")
            for text in self._start_notes:
                self._publish(self._waiting, "stream", {"name": "stderr", "text": f"[dist_kernel] {text}\n"})
            ready = asyncio.ensure_future(sup.ready.wait())
            stop = asyncio.ensure_future(self._start_interrupted.wait())
            await asyncio.wait([ready, stop], return_when=asyncio.FIRST_COMPLETED)
            for task in (ready, stop):
                task.cancel()
            self._waiting = None
            if not sup.ready.is_set():
                return error_content("KeyboardInterrupt", "interrupted while the ranks were starting; they "
                                     "go on starting, and the next cell runs on them")
        if sup.start_error:
            return error_content("RankStartError", sup.start_error)
        dead = [r for r in sup.ranks.values() if not r.alive]
        if dead:
            what = "; ".join(f"rank {r.rank} ({r.where}) {r.exit_reason}" for r in dead)
            return error_content(
                "RankDiedError", what,
                ["The process group cannot continue without it. Restart the kernel "
                 "(Kernel > Restart) to start fresh ranks; variables are lost."])
        return None

    # ------------------------------------------------------------- execute
    def _publish(self, parent: dict, msg_type: str, content: dict, metadata: dict | None = None,
                 buffers: list | None = None) -> None:
        # explicit parent: relayed output is published from tasks outside the handler context;
        # re-signed with the parent's session (frontends ignore a foreign header.session)
        if self._held:
            self._release_held()
        self.session.send(self.iopub_socket, msg_type, content, parent=parent, ident=self._topic(msg_type),
                          metadata=metadata, buffers=buffers)

    def _fail(self, parent: dict, err: dict, silent: bool) -> dict:
        if not silent:
            self._publish(parent, "error", err)
        return {"status": "error", "execution_count": self.execution_count, **err}

    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict | None = None, allow_stdin: bool = False,
                         *, cell_meta: dict | None = None, cell_id: str | None = None) -> dict:
        parent = self.get_parent("shell")
        if self._warnings and not silent:
            for text in self._warnings:
                self._publish(parent, "stream", {"name": "stderr", "text": f"[dist_kernel] warning: {text}\n"})
            self._warnings = []
        if self.supervisor is None or not self.supervisor.ready.is_set():
            self._release_held()  # the cell waits for the ranks: it is busy meanwhile
        err = await self._ready_error()
        if err:
            return self._fail(parent, err, silent)
        sup = self.supervisor
        assert sup is not None
        try:
            plan = plan_cell(code, sup.config.world_size)
        except RankSpecError as e:
            return self._fail(parent, error_content("RankSpecError", str(e)), silent)
        if plan.magics:
            self._release_held()
            err = await self._run_parent_magics(parent, plan.magics)
            if err:
                return self._fail(parent, err, silent)
            if not plan.code.strip():
                return {"status": "ok", "execution_count": self.execution_count, "user_expressions": {},
                        "payload": []}

        if self._reform_pending and not self._left_running:
            self._release_held()
            self._reform_pending = False
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sup.form_group(), sup.config.startup_timeout)
        cfg = sup.config
        run = CellRun(plan.ranks, lambda t, c: self._publish(parent, t, c), self.execution_count,
                      world=range(cfg.world_size), window=cfg.merge_window, on_look=self._look,
                      hang_grace=cfg.hang_grace, rich_from=plan.ranks[0] if self.output_policy == "rank0" else None,
                      on_comm=lambda rank, msg: self._relay_comm(rank, msg, parent),
                      dead=lambda: [r for r, rk in sup.ranks.items() if not rk.alive],
                      budget=self._output_budget, displays=self._displays)
        run.parent = parent
        content = {"code": plan.code, "silent": silent, "store_history": store_history,
                   "user_expressions": user_expressions or {}, "allow_stdin": allow_stdin,
                   "stop_on_error": False}
        # the cell's ranks travel along: rank-side code (fastai's show_batch) shows what one
        # process would show once, from the cell's first rank
        meta = {"dist_kernel": {"ranks": list(plan.ranks)}, **({"cellId": cell_id} if cell_id else {})}
        ident = self._get_shell_context_var(self._shell_parent_ident)
        self._stdin = InputBroker(lambda prompt, pw: self._ask_frontend(prompt, pw, ident, parent),
                                  sup.reply_input) if allow_stdin else None
        self._current = run
        for rank in plan.ranks:
            try:
                channel = sup.channel(rank)
                msg_id, fut = channel.send("execute_request", content, metadata=meta)
            except RankDiedError as e:
                run.on_rank_lost(rank, "RankDiedError", str(e))
                continue
            run.child_ids[rank] = msg_id
            self.comms.sent(msg_id, parent["header"]["msg_id"])
            self._listen(rank, msg_id, lambda msg, rank=rank: run.on_iopub(rank, msg))
            fut.add_done_callback(lambda f, rank=rank: self._on_reply(run, rank, f))
            if sup.ranks[rank].stopped:
                self._notice_stopped(run, rank)
        self._release_held()
        try:
            error = await run.wait()
        finally:
            self._current = None
            self._stdin = None

        if run.group_broken or self._group_broke(run):
            await self._recover_group(run)
        first = plan.ranks[0]
        reply0 = run.replies.get(first, {})
        payload = reply0.get("payload", [])
        if any(p.get("source") == "ask_exit" and not p.get("keepkernel") for p in payload):
            self._exit_soon()  # exit()/quit(): end like a plain kernel; the frontend restarts it
        if error is not None:
            error = dict(error, traceback=error["traceback"] + run.notes)
            if not silent:
                self._publish(parent, "error", error)
            return {"status": "error", "execution_count": self.execution_count, **error}
        return {"status": "ok", "execution_count": self.execution_count,
                "user_expressions": reply0.get("user_expressions", {}),
                # payloads (pager, set_next_input) from one rank only, or the frontend acts N times
                "payload": payload}

    def _listen(self, rank: int, msg_id: str, handler: Any) -> None:
        """Route a request's IOPub messages to ``handler``; the last ``_RECENT`` stay routed, so
        output a background thread prints after its cell ended still finds its place."""
        assert self.supervisor is not None
        self.supervisor.channel(rank).listen(msg_id, handler)
        self._listening.append((rank, msg_id))
        while len(self._listening) > _RECENT * max(1, self.supervisor.config.world_size):
            old_rank, old_id = self._listening.popleft()
            r = self.supervisor.ranks.get(old_rank)
            if r is not None and r.channel is not None:
                r.channel.unlisten(old_id)

    # ------------------------------------------------------------- faults
    async def _look(self, run: CellRun) -> None:
        """Ask the busy ranks where they are, let the fault policy judge, and act on it."""
        sup = self.supervisor
        assert sup is not None
        busy = [r for r in run.busy_ranks if sup.ranks[r].alive]
        places = dict(zip(busy, await asyncio.gather(*(sup.where(r) for r in busy)), strict=True))
        seen = {r: _seen(p) for r, p in places.items()}
        for r, s in seen.items():
            if not s.answered and not sup.ranks[r].stopped:
                self._notice(run, f"rank {r} ({sup.ranks[r].where}) does not answer "
                                  f"({state_words(sup.ranks[r].process.os_state())}): it may be stuck in C code "
                                  "that holds the GIL. Press stop to end the cell, or restart the kernel.", key=("silent", r))
        verdict = run.judge.judge(run.state(), seen, run.clock())
        if verdict.action == "wait":
            return
        for r, reason in verdict.stuck.items():
            place = places.get(r)
            lines = ["Where it was waiting:", *place.stack] if place is not None and place.stack else []
            if verdict.action == "abandon":
                run.on_rank_lost(r, verdict.ename, reason)
                self._left_running.add(r)
            else:
                run.mark_stuck(r, verdict.ename, reason, lines)
        if verdict.action == "stop":
            await sup.interrupt(list(verdict.stuck))
            await asyncio.sleep(fault_policy.STOP_TIMEOUT)
            for r in run.busy_ranks:
                run.on_rank_lost(r, "RankDiedError", verdict.stuck.get(r, f"rank {r} did not stop"))
        elif verdict.action == "teardown":
            self.log.warning("ranks %s stuck in collectives; tearing down the group", list(verdict.stuck))
            run.group_broken = True
            failed = await sup.teardown(verdict.teardown_on)
            if failed:
                self._notice(run, f"rank {format_ranks(failed)} did not confirm tearing the process group down; "
                                  "ranks blocked with it may stay blocked: press stop, or restart the kernel.",
                             key=("teardown",))

    def _group_broke(self, run: CellRun) -> bool:
        """Did a rank report that its process group broke during the cell?"""
        return any(meta.get("dist_kernel", {}).get("group_broken") for meta in run.reply_metadata.values())

    async def _recover_group(self, run: CellRun) -> None:
        """After a torn-down or broken group, form a fresh one on every rank (policy: after_cell)."""
        sup = self.supervisor
        assert sup is not None

        def decide() -> str:
            return fault_policy.after_cell(run.group_broken, self._group_broke(run),
                                           [r for r, rk in sup.ranks.items() if not rk.alive], self._left_running)

        decision = decide()
        if decision == "reform":
            try:
                await asyncio.wait_for(sup.form_group(), sup.config.startup_timeout)
                run.notes.append(
                    "\x1b[1;33mdist_kernel:\x1b[0m the process group was re-formed; every rank's variables "
                    "survived. Objects bound to the old group (DistributedDataParallel wrappers, new_group() "
                    "handles) must be created again.")
                return
            except Exception as e:  # noqa: BLE001 - a rank died meanwhile, or a join failed
                decision = decide()
                if decision == "reform":
                    run.notes.append(f"Re-forming the process group failed ({e}); restart the kernel.")
                    return
        if decision == "restart":
            run.notes.append("A rank died, so the process group cannot be re-formed: restart the kernel.")
        elif decision == "later":
            self._reform_pending = True
            run.notes.append(f"rank {format_ranks(sorted(self._left_running))} is still running its cell; the "
                             "process group is re-formed before the next cell once it is back (restart the "
                             "kernel if it does not come back).")

    def _on_reply(self, run: CellRun, rank: int, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            run.on_rank_lost(rank, "RankDiedError", str(exc),
                             "Restart the kernel to start fresh ranks (the group cannot continue without it).")
        else:
            msg = fut.result()
            run.reply_metadata[rank] = msg.get("metadata") or {}
            run.on_reply(rank, msg["content"], run.reply_metadata[rank])
            self._left_running.discard(rank)

    def _on_rank_death(self, rank: int, reason: str) -> None:
        if self._exiting:
            return  # exit() ends every rank on purpose
        self.log.error("rank %d %s", rank, reason)
        run = self._current
        if run is not None:
            r = self.supervisor.ranks[rank] if self.supervisor else None
            tail = r.log_tail(15) if r else ""
            run.on_rank_lost(rank, "RankDiedError", f"rank {rank} ({r.where if r else 'pid ?'}) {reason}",
                             (f"Last output of the rank process:\n{tail}\n" if tail.strip() else "")
                             + "Restart the kernel to start fresh ranks; the group cannot continue without it.")

    def _on_start_note(self, text: str) -> None:
        """The launcher's news while the ranks start (waiting in the Slurm queue, job id): shown
        in the cell that waits for them, or in the first cell."""
        self._start_notes.append(text)
        if self._waiting is not None:
            self._publish(self._waiting, "stream", {"name": "stderr", "text": f"[dist_kernel] {text}\n"})

    def _on_rank_stopped(self, rank: int, state: str) -> None:
        """A rank was stopped (``state`` in words) or runs again (``state`` empty)."""
        sup = self.supervisor
        if not state:
            if sup is not None and rank in self._left_running:
                # the interrupt it got while stopped may have gone to another thread on resume:
                # signal it again now that it runs, so its cell ends
                asyncio.ensure_future(sup.interrupt([rank]))
            return
        run = self._current
        if run is not None and rank in run.busy_ranks:
            self._notice_stopped(run, rank)

    def _notice_stopped(self, run: CellRun, rank: int) -> None:
        assert self.supervisor is not None
        r = self.supervisor.ranks[rank]
        self._notice(run, f"rank {rank} ({r.where}) is {r.stopped or 'stopped'} (SIGSTOP or a debugger): "
                          f"the cell waits for it. Resume it with `kill -CONT {r.pid}`, press stop to end the "
                          "cell without it, or restart the kernel.", key=("stopped", rank))

    def _notice(self, run: CellRun, text: str, key: tuple) -> None:
        """A kernel message in the cell's output, once per cell and key."""
        if key in run.noticed:
            return
        run.noticed.add(key)
        run.flush(force=True)
        self._publish(run.parent, "stream", {"name": "stderr", "text": f"[dist_kernel] {text}\n"})

    # -------------------------------------------------------------- output
    def _on_unrouted(self, rank: int, msg: dict) -> None:
        """IOPub messages no request listens for: dropped (statuses), or comms."""
        msg_type = msg["header"]["msg_type"]
        if msg_type in ("comm_open", "comm_msg", "comm_close"):
            self._relay_comm(rank, msg, {})

    def _relay_comm(self, rank: int, msg: dict, parent: dict) -> None:
        # comms bypass merging: the frontend needs comm_open before the widget's display;
        # message metadata carries the widget protocol version, buffers carry binary state
        msg_type = msg["header"]["msg_type"]
        content = self.comms.from_rank(msg_type, msg["content"], rank)
        self._publish(parent, msg_type, content, msg.get("metadata"), msg.get("buffers"))

    def _on_comm_output(self, rank: int, parent: dict, msg: dict) -> None:
        """Output of a comm callback (a widget's on_click): labelled with its rank."""
        msg_type = msg["header"]["msg_type"]
        if msg_type in ("comm_open", "comm_msg", "comm_close"):
            self._relay_comm(rank, msg, parent)
        elif msg_type in OUTPUT_TYPES:
            content = msg["content"]
            if msg_type == "stream" and self.supervisor and self.supervisor.config.world_size > 1:
                content = dict(content, text=label_lines(content.get("text", ""), [rank]))
            self._publish(parent, msg_type, content)

    def _on_rank_stdin(self, rank: int, msg: dict) -> None:
        broker = self._stdin
        content = msg["content"]
        if broker is None:  # not allowed: ipykernel would not have asked; answer empty
            self.supervisor.reply_input(rank, "")
            return
        broker.on_request(rank, content.get("prompt", ""), bool(content.get("password")))

    async def _ask_frontend(self, prompt: str, password: bool, ident: Any, parent: dict) -> str:
        """One input_request to the frontend, answered off the event loop (the base call blocks)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: self._input_request(prompt, ident, parent, password))

    # -------------------------------------------------------------- comms
    async def comm_open(self, stream: Any, ident: Any, parent: dict) -> None:
        self._route_comm(parent)

    async def comm_msg(self, stream: Any, ident: Any, parent: dict) -> None:
        self._route_comm(parent)

    async def comm_close(self, stream: Any, ident: Any, parent: dict) -> None:
        self._route_comm(parent)

    def _route_comm(self, parent: dict) -> None:
        """A frontend comm message goes to the rank that owns the comm (rank 0 for new ones)."""
        asyncio.ensure_future(self._forward_comm(parent))

    async def _forward_comm(self, parent: dict) -> None:
        sup = self.supervisor
        if sup is None:
            return
        await sup.ready.wait()  # in a task: never delays other requests
        if sup.start_error:
            return
        msg_type = parent["header"]["msg_type"]
        content = parent["content"]
        rank = self.comms.rank_for(content.get("comm_id"))
        self.comms.track(msg_type, content.get("comm_id"), rank)
        try:
            msg_id, _ = sup.channel(rank).send(msg_type, content, metadata=parent.get("metadata"),
                                               expect_reply=False, buffers=parent.get("buffers"))
        except RankDiedError:
            return
        self._listen(rank, msg_id, lambda msg: self._on_comm_output(rank, parent, msg))

    async def comm_info_request(self, stream: Any, ident: Any, parent: dict) -> None:
        """The comms of every rank, merged."""
        comms: dict[str, dict] = {}
        sup = self.supervisor
        if sup is not None and sup.ready.is_set() and not sup.start_error:
            live = sup.live_ranks()
            replies = await asyncio.gather(*(sup.channel(r).shell_request("comm_info_request", parent["content"], 5)
                                             for r in live), return_exceptions=True)
            for rank, reply in zip(live, replies, strict=True):
                if isinstance(reply, dict):
                    for comm_id, info in reply.get("comms", {}).items():
                        comms[comm_id] = info
                        self.comms.owner.setdefault(comm_id, rank)
        self.session.send(stream, "comm_info_reply", {"status": "ok", "comms": comms}, parent, ident=ident)

    # -------------------------------------------------------------- magics
    async def _run_parent_magics(self, parent: dict, magics: tuple[tuple[str, str], ...]) -> dict | None:
        sup = self.supervisor
        assert sup is not None
        for name, arg in magics:
            if name == "dist_status":
                table = await sup.status()
                self._publish(parent, "display_data", status_bundle(table, sup.config))
            elif name == "dist_output":
                if arg not in ("all", "rank0"):
                    return error_content("UsageError", f"%dist_output {arg!r}: use `%dist_output all` "
                                          "(rich output from every rank, merged) or `%dist_output rank0`.")
                self.output_policy = arg
                self._publish(parent, "stream", {"name": "stdout", "text": f"rich output from: {arg}\n"})
            elif name == "dist_empty_cache":
                if arg not in ("on", "off"):
                    return error_content("UsageError", f"%dist_empty_cache {arg!r}: use on or off.")
                missing = await sup.set_option("empty_cache", arg == "on")
                if missing:
                    return error_content("RankRequestError", f"rank {format_ranks(missing)} did not confirm "
                                         "%dist_empty_cache; run it again, or restart the kernel.")
                self._publish(parent, "stream", {"name": "stdout", "text": f"empty_cache after each cell: {arg}\n"})
        return None

    # ---------------------------------------------------------- control
    def _publish_execute_input(self, code: str, parent: dict, execution_count: int) -> None:
        with self._held_lock:
            if self._held:  # the cell's busy is held: its input follows it
                self._held.append(("input", code, parent, execution_count))
                return
        super()._publish_execute_input(code, parent, execution_count)

    def _release_held(self) -> None:
        """Publish the held busy and execute_input of the cell (before anything else of it)."""
        with self._held_lock:
            held, self._held = self._held, []
            for item in held:
                if item[0] == "busy":
                    super()._publish_status("busy", "shell", item[1])
                else:
                    super()._publish_execute_input(*item[1:])

    def _publish_status(self, status: str, channel: str, parent: dict | None = None) -> None:
        if channel == "shell" and parent is None and threading.current_thread() is threading.main_thread():
            if status == "busy" and self.get_parent("shell").get("header", {}).get("msg_type") == "execute_request":
                # held until the cell's requests are sent to the ranks (do_execute), or until
                # anything else is published for it (_publish), whichever comes first
                with self._held_lock:
                    self._release_held()
                    self._held.append(("busy", self.get_parent("shell")))
                return
            if self._held:
                self._release_held()
        # jupyter_client's KernelManager and its client share a session id but count messages
        # separately, so an interrupt_request can carry the very msg_id of the running cell:
        # its busy/idle would read, to nbclient, as the cell's idle. Such a pair is not sent.
        if channel == "control" and parent is None and self._current is not None:
            control_id = self.get_parent("control").get("header", {}).get("msg_id")
            if control_id == self._current.parent.get("header", {}).get("msg_id"):
                return
        super()._publish_status(status, channel, parent)

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
        if self.supervisor is not None:
            try:
                # the stop button acts on what ran when it was pressed: a cell the frontend sent
                # after it (its request can reach the parent first) must not be hit
                await asyncio.wait_for(self._on_main(self._interrupt_busy(_sent(parent))), 5)
            except Exception as e:  # noqa: BLE001
                content = {"status": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": []}
        self.session.send(stream, "interrupt_reply", content, parent, ident=ident)

    async def _interrupt_busy(self, pressed: datetime | None = None) -> None:
        """The stop button. Before the ranks are ready it ends the waiting cell and never
        signals a starting rank; during a cell it signals the busy ranks (the fault policy
        tears the group down for those a collective keeps from reacting); between cells it
        signals only ranks left running by an earlier cell."""
        sup = self.supervisor
        assert sup is not None
        if not sup.ready.is_set():
            if self._waiting is not None and not _before(pressed, self._waiting):
                self._start_interrupted.set()
            return
        run = self._current
        if run is not None and _before(pressed, run.parent):
            return  # pressed before this cell was sent: meant for what ran then, or for nothing
        if run is None:
            await sup.interrupt(sorted(self._left_running))
            return
        stopped = [r for r in run.busy_ranks if sup.ranks[r].stopped]
        for r in stopped:  # a stopped rank cannot react: the cell ends without it
            run.on_rank_lost(r, "RankStoppedError",
                             f"rank {r} (pid {sup.ranks[r].pid}) is {sup.ranks[r].stopped}; resume it with "
                             f"`kill -CONT {sup.ranks[r].pid}` (it then sees the interrupt) or restart the kernel")
            self._left_running.add(r)
        # the stopped ranks are signalled too: the signal waits, and ends their cell once resumed
        await sup.interrupt(stopped + run.interrupt())

    def _abort_queues(self, subshell_id: str | None = None) -> None:
        """After an error, abort the execute requests that had already arrived (Run All), and no
        other. ipykernel clears its flag two turns of the loop later; since replies go out at
        once on the raw socket, a request the frontend sent after it saw the error could land in
        between and be aborted. So the flag is cleared by a task that queues for the shell lock
        behind every request read so far: those are aborted, later ones run."""
        self._aborting = True
        if self.shell_stream is not None:
            self.shell_stream.flush()  # what has arrived now queues for the lock, ahead of the task

        async def stop_aborting() -> None:
            async with self._main_asyncio_lock:
                self._aborting = False

        asyncio.ensure_future(stop_aborting())

    def _exit_soon(self) -> None:
        """``exit()`` in a cell: like a plain kernel, end (after the reply is sent)."""
        self._exiting = True

        async def end() -> None:
            await asyncio.sleep(0.1)
            if self.supervisor is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.supervisor.shutdown(now=True), 10)
            self.io_loop.stop()

        asyncio.ensure_future(end())

    async def do_shutdown(self, restart: bool) -> dict:
        if self.supervisor is not None:
            try:
                await asyncio.wait_for(self._on_main(self.supervisor.shutdown()), 10)
            except Exception:  # noqa: BLE001
                self.log.exception("clean rank shutdown failed; killing ranks")
            self.supervisor.cleanup_sync()
        return {"status": "ok", "restart": restart}

    # ----------------------------------------------------- simple requests
    async def _ask_rank(self, msg_type: str, content: dict, fallback: dict) -> dict:
        """Answer from a live rank: the first one a ``%%rank`` line in the code names, else rank 0.

        The ``%%rank`` line is blanked to the same length, so cursor offsets stay valid.
        """
        sup = self.supervisor
        if sup is None or not sup.ready.is_set() or sup.start_error:
            return fallback
        rank = 0
        if "code" in content:
            try:
                plan = plan_cell(content["code"], sup.config.world_size)
                rank, content = plan.ranks[0], dict(content, code=plan.code)
            except RankSpecError:
                pass
        try:
            return await sup.channel(rank).shell_request(msg_type, content)
        except Exception:  # noqa: BLE001 - a dead or busy rank: answer without it
            return fallback

    async def do_complete(self, code: str, cursor_pos: int) -> dict:
        return await self._ask_rank("complete_request", {"code": code, "cursor_pos": cursor_pos},
                                    {"status": "ok", "matches": [], "cursor_start": cursor_pos,
                                     "cursor_end": cursor_pos, "metadata": {}})

    async def do_inspect(self, code: str, cursor_pos: int, detail_level: int = 0,
                         omit_sections: tuple = ()) -> dict:
        return await self._ask_rank("inspect_request", {"code": code, "cursor_pos": cursor_pos,
                                                        "detail_level": detail_level},
                                    {"status": "ok", "found": False, "data": {}, "metadata": {}})

    async def do_is_complete(self, code: str) -> dict:
        return await self._ask_rank("is_complete_request", {"code": code}, {"status": "unknown"})

    async def do_history(self, hist_access_type: str, output: bool, raw: bool, session: int | None = None,
                         start: int | None = None, stop: int | None = None, n: int | None = None,
                         pattern: str | None = None, unique: bool = False) -> dict:
        content = {"hist_access_type": hist_access_type, "output": output, "raw": raw,
                   "session": session, "start": start, "stop": stop, "n": n, "pattern": pattern,
                   "unique": unique}
        reply = await self._ask_rank("history_request", content, {"status": "ok", "history": []})
        if hist_access_type == "range" and session:
            # IPython answers a range of the current session with session 0 ("this session");
            # echo the session the frontend asked for, as the protocol expects
            reply["history"] = [(session if row[0] == 0 else row[0], *row[1:]) for row in reply.get("history", [])]
        return reply


class DistributedKernelApp(UnboundedIOPubApp):
    """IPKernelApp that runs :class:`DistributedKernel` and keeps its own prints off IOPub."""

    name = "dist-kernel"
    kernel_class = DistributedKernel
    outstream_class = None  # the parent's own prints go to its log, never into a cell
    dist_config = AnyTrait(None)
    rank_argv = AnyTrait(None)  # kernel arguments from the frontend, for the ranks too

    def init_control(self, context: Any) -> None:
        super().init_control(context)
        # no subshells: shell messages are handled on the main loop, where the rank clients live
        self.shell_channel_thread = None

    def init_signal(self) -> None:
        # SIGINT reaching the parent (signal-mode frontends, a terminal) interrupts the ranks
        # instead of killing the parent; SIGTERM ends the ranks before the parent goes.
        def on_sigint(*_: Any) -> None:
            kernel = self.kernel
            if kernel is not None and kernel._main_loop is not None and kernel.supervisor is not None:
                kernel._main_loop.call_soon_threadsafe(
                    lambda: asyncio.ensure_future(kernel._interrupt_busy()))

        def on_sigterm(*_: Any) -> None:
            kernel = self.kernel
            if kernel is not None and kernel.supervisor is not None:
                kernel.supervisor.cleanup_sync()
            raise SystemExit(0)

        signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGTERM, on_sigterm)

    def init_kernel(self) -> None:
        super().init_kernel()
        self.kernel.dist_config = self.dist_config
        self.kernel.extra_argv = list(self.rank_argv or [])


def launch(connection_file: str, config: KernelConfig | ConfigError, extra_argv: list[str] | None = None) -> None:
    """Start the parent kernel (what kernel.json's argv runs)."""
    app = DistributedKernelApp.instance(dist_config=config, rank_argv=list(extra_argv or []))
    app.initialize(["-f", connection_file, *(extra_argv or [])])
    started = time.monotonic()
    app.log.info("dist_kernel parent up in %.3fs", time.monotonic() - started)
    app.start()


def _seen(place: Any) -> fault_policy.Seen:
    """A ``where`` reply as the fault policy sees it (None: the rank did not answer)."""
    if place is None:
        return fault_policy.Seen(answered=False)
    return fault_policy.Seen(answered=True, collective=place.collective, group_ranks=tuple(place.group_ranks),
                             peer=place.peer, seq=place.seq, line=place.line)


def _sent(msg: dict) -> datetime | None:
    """When the frontend sent a request (its header's date), if it says."""
    date = msg.get("header", {}).get("date")
    return date if isinstance(date, datetime) else None


def _before(pressed: datetime | None, request: dict) -> bool:
    """Was the stop button pressed before the frontend sent ``request``? (Both dates are the
    frontend's own clock; unknown dates count as not before.)"""
    sent = _sent(request)
    try:
        return pressed is not None and sent is not None and pressed < sent
    except TypeError:  # one naive, one aware
        return False
