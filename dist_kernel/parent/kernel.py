"""The parent kernel: speaks Jupyter to the frontend, routes cells to ranks, merges outputs.

It never imports torch. Handlers follow ipykernel's naming (``do_execute``, ...). Rank
traffic lives on the main event loop; control-channel handlers (interrupt, shutdown) run on
ipykernel's control thread and cross over with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import atexit
import signal
import sys
import time
from collections import OrderedDict
from typing import Any

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel
from traitlets import Any as AnyTrait

from dist_kernel import __version__
from dist_kernel.exceptions import ConfigError, RankDiedError, RankSpecError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.execution import OUTPUT_TYPES, CellRun
from dist_kernel.parent.magics import format_ranks, plan_cell
from dist_kernel.parent.merge import error_content, label_lines
from dist_kernel.parent.status import status_bundle
from dist_kernel.parent.stdin import InputBroker
from dist_kernel.parent.supervisor import RankSupervisor

#: how many finished cells' child msg_ids are remembered, to place late output
_RECENT = 64


def _group_failure(error: dict | None) -> bool:
    """Does this error mean the process group itself broke (so it must be re-formed)?"""
    if not error:
        return False
    text = f"{error.get('ename')} {error.get('evalue')} " + " ".join(error.get("traceback", [])[-3:])
    return any(m in text for m in ("DistBackendError", "DistNetworkError", "Connection closed by peer",
                                   "CollectiveHangError", "Connection reset by peer"))


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
        self.output_policy = "all"
        self.supervisor: RankSupervisor | None = None
        self._runs: OrderedDict[str, tuple[CellRun, int]] = OrderedDict()  # child msg_id -> (run, rank)
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._current: CellRun | None = None
        self._stdin: InputBroker | None = None
        self._comm_owner: dict[str, int] = {}  # comm_id -> the rank that holds the comm
        self._forwarded: OrderedDict[str, dict] = OrderedDict()  # msg_id sent to a rank -> frontend message

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
            self.supervisor = RankSupervisor(cfg, self._on_rank_iopub, self._on_rank_death, log=self.log,
                                             on_stdin=self._on_rank_stdin)
            atexit.register(self.supervisor.cleanup_sync)
            self.io_loop.add_callback(self.supervisor.start)

    async def _ready_error(self) -> dict | None:
        """Wait for the ranks; the error to show if the kernel cannot run cells."""
        cfg = self.dist_config
        if isinstance(cfg, ConfigError):
            return error_content("ConfigError", str(cfg))
        if self.supervisor is None:
            return error_content("ConfigError", "the kernel has no configuration")
        await self.supervisor.ready.wait()
        if self.supervisor.start_error:
            return error_content("RankStartError", self.supervisor.start_error)
        dead = [r for r in self.supervisor.ranks.values() if not r.alive]
        if dead:
            what = "; ".join(f"rank {r.rank} {r.exit_reason}" for r in dead)
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
        err = await self._ready_error()
        if err:
            return self._fail(parent, err, silent)
        assert self.supervisor is not None
        try:
            plan = plan_cell(code, self.supervisor.config.world_size)
        except RankSpecError as e:
            return self._fail(parent, error_content("RankSpecError", str(e)), silent)
        if plan.magics:
            err = await self._run_parent_magics(parent, plan.magics)
            if err:
                return self._fail(parent, err, silent)
            if not plan.code.strip():
                return {"status": "ok", "execution_count": self.execution_count, "user_expressions": {},
                        "payload": []}

        cfg = self.supervisor.config
        run = CellRun(plan.ranks, lambda t, c: self._publish(parent, t, c), self.execution_count,
                      world=range(cfg.world_size),
                      window=cfg.merge_window, on_stall=self._on_stall, hang_grace=cfg.hang_grace,
                      rich_from=plan.ranks[0] if self.output_policy == "rank0" else None)
        run.parent = parent
        content = {"code": plan.code, "silent": silent, "store_history": store_history,
                   "user_expressions": user_expressions or {}, "allow_stdin": allow_stdin,
                   "stop_on_error": False}
        ident = self._get_shell_context_var(self._shell_parent_ident)
        self._stdin = InputBroker(lambda prompt, pw: self._ask_frontend(prompt, pw, ident, parent),
                                  self.supervisor.reply_input) if allow_stdin else None
        for rank in plan.ranks:
            try:
                # the cell's ranks travel along: rank-side code (fastai's show_batch) shows
                # what one process would show once, from the cell's first rank
                meta = {"dist_kernel": {"ranks": list(plan.ranks)}, **({"cellId": cell_id} if cell_id else {})}
                msg_id, fut = self.supervisor.send(rank, "execute_request", content, metadata=meta)
            except RankDiedError as e:
                run.on_rank_lost(rank, "RankDiedError", str(e))
                continue
            self._runs[msg_id] = (run, rank)
            fut.add_done_callback(lambda f, rank=rank: self._on_reply(run, rank, f))
        self._current = run
        try:
            error = await run.wait()
        finally:
            self._current = None
            self._stdin = None
            while len(self._runs) > _RECENT * max(1, len(plan.ranks)):
                self._runs.popitem(last=False)

        if error is not None or run.group_broken:
            await self._recover_group(run, error)
        first = plan.ranks[0]
        reply0 = run.replies.get(first, {})
        if error is not None:
            error = dict(error, traceback=error["traceback"] + run.notes)
            if not silent:
                self._publish(parent, "error", error)
            return {"status": "error", "execution_count": self.execution_count, **error}
        return {"status": "ok", "execution_count": self.execution_count,
                "user_expressions": reply0.get("user_expressions", {}),
                # payloads (pager, set_next_input) from one rank only, or the frontend acts N times
                "payload": reply0.get("payload", [])}

    async def _on_stall(self, run: CellRun, busy: list[int], idle: list[int]) -> None:
        """Some ranks are idle, others still busy: are the busy ones stuck in a collective?"""
        sup = self.supervisor
        assert sup is not None
        places = dict(zip(busy, await asyncio.gather(*(sup.where(r) for r in busy)), strict=True))
        dead = [r for r in idle if not sup.ranks[r].alive]
        if dead:
            # the group cannot continue: stop the survivors instead of letting them hang
            for r in busy:
                what = places[r].get("collective")
                where = f" while waiting in torch.distributed.{what}()" if what else ""
                run.mark_stuck(r, "RankDiedError", f"rank {r} was stopped{where}: rank {format_ranks(dead)} died",
                               ["Where it was:", *places[r].get("stack", [])])
            await sup.interrupt(busy)
            await asyncio.sleep(3)
            for r in run.busy_ranks:
                run.on_rank_lost(r, "RankDiedError", f"rank {r} did not stop after rank {format_ranks(dead)} died")
            return
        if all(p.get("collective") and p.get("world") for p in places.values()) and run.busy_ranks:
            # every busy rank waits on the whole group, and some ranks will never join: tear
            # the group down on an idle rank, which makes the blocked ranks raise at once; it
            # is re-formed after the cell
            for r in busy:
                run.mark_stuck(
                    r, "CollectiveHangError",
                    f"rank {r} was blocked in torch.distributed.{places[r]['collective']}(), which rank "
                    f"{format_ranks(idle)} never entered (idle: finished or not selected by %%rank)",
                    ["Where it was waiting:", *places[r].get("stack", [])])
            self.log.warning("ranks %s stuck in collectives; tearing down the group", busy)
            run.group_broken = True
            await sup.teardown(idle)

    async def _recover_group(self, run: CellRun, error: dict | None) -> None:
        """After a torn-down or failed collective, form a fresh group on every rank."""
        sup = self.supervisor
        assert sup is not None
        if not run.group_broken and not _group_failure(error):
            return
        if any(not r.alive for r in sup.ranks.values()):
            run.notes.append("A rank died, so the process group cannot be re-formed: restart the kernel.")
            return
        try:
            await asyncio.wait_for(sup.form_group(), sup.config.startup_timeout)
        except Exception as e:  # noqa: BLE001
            run.notes.append(f"Re-forming the process group failed ({e}); restart the kernel.")
            return
        run.notes.append(
            "\x1b[1;33mdist_kernel:\x1b[0m the process group was re-formed; every rank's variables survived. "
            "Objects bound to the old group (DistributedDataParallel wrappers, new_group() handles) must be "
            "created again.")

    def _on_reply(self, run: CellRun, rank: int, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            run.on_rank_lost(rank, "RankDiedError", str(exc),
                             "Restart the kernel to start fresh ranks (the group cannot continue without it).")
        else:
            run.on_reply(rank, fut.result()["content"])

    def _on_rank_iopub(self, rank: int, msg: dict) -> None:
        parent_id = msg.get("parent_header", {}).get("msg_id")
        msg_type = msg["header"]["msg_type"]
        entry = self._runs.get(parent_id)
        if msg_type in ("comm_open", "comm_msg", "comm_close"):
            self._track_comm(msg_type, msg["content"].get("comm_id"), rank)
            # comms bypass merging: the frontend needs comm_open before the widget's display
            parent = entry[0].parent if entry else self._forwarded.get(parent_id, {})
            # message metadata carries the widget protocol version; buffers carry binary state
            self._publish(parent, msg_type, msg["content"], msg.get("metadata"), msg.get("buffers"))
            return
        if entry is not None:
            entry[0].on_iopub(rank, msg)
        elif parent_id in self._forwarded and msg_type in OUTPUT_TYPES:
            # output of a comm callback (a widget's on_click, say): label it with its rank
            self._publish_labelled(self._forwarded[parent_id], rank, msg_type, msg["content"])

    def _publish_labelled(self, parent: dict, rank: int, msg_type: str, content: dict) -> None:
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

    def _track_comm(self, msg_type: str, comm_id: str, rank: int) -> None:
        """Which rank owns a comm: set by comm_open (from either side), dropped by comm_close."""
        if msg_type == "comm_open":
            self._comm_owner[comm_id] = rank
        elif msg_type == "comm_close":
            self._comm_owner.pop(comm_id, None)

    def _route_comm(self, parent: dict) -> None:
        """A frontend comm message goes to the rank that owns the comm (rank 0 for new ones)."""
        asyncio.ensure_future(self._forward_comm(parent))

    async def _forward_comm(self, parent: dict) -> None:
        if self.supervisor is None:
            return
        await self.supervisor.ready.wait()  # in a task: never delays other requests
        if self.supervisor.start_error:
            return
        msg_type = parent["header"]["msg_type"]
        content = parent["content"]
        comm_id = content.get("comm_id")
        rank = self._comm_owner.get(comm_id, 0)
        self._track_comm(msg_type, comm_id, rank)
        try:
            msg_id, _ = self.supervisor.send(rank, msg_type, content, metadata=parent.get("metadata"),
                                             expect_reply=False, buffers=parent.get("buffers"))
        except RankDiedError:
            return
        self._forwarded[msg_id] = parent
        while len(self._forwarded) > 4 * _RECENT:
            self._forwarded.popitem(last=False)

    async def comm_info_request(self, stream: Any, ident: Any, parent: dict) -> None:
        """The comms of every rank, merged."""
        comms: dict[str, dict] = {}
        sup = self.supervisor
        if sup is not None and sup.ready.is_set() and not sup.start_error:
            live = [r for r, rk in sup.ranks.items() if rk.alive]
            replies = await asyncio.gather(*(sup.request(r, "comm_info_request", parent["content"], 5)
                                             for r in live), return_exceptions=True)
            for rank, reply in zip(live, replies, strict=True):
                if isinstance(reply, dict):
                    for comm_id, info in reply.get("comms", {}).items():
                        comms[comm_id] = info
                        self._comm_owner.setdefault(comm_id, rank)
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
                await asyncio.gather(*(sup.run_silent(r, f"_dk_agent.set_empty_cache({arg == 'on'})")
                                       for r in sup.ranks))
                self._publish(parent, "stream", {"name": "stdout", "text": f"empty_cache after each cell: {arg}\n"})
        return None

    def _on_rank_death(self, rank: int, reason: str) -> None:
        self.log.error("rank %d %s", rank, reason)
        run = self._current
        if run is not None:
            r = self.supervisor.ranks[rank] if self.supervisor else None
            tail = r.log_tail(15) if r else ""
            run.on_rank_lost(rank, "RankDiedError", f"rank {rank} (pid {r.pid if r else '?'}) {reason}",
                             (f"Last output of the rank process:\n{tail}\n" if tail.strip() else "")
                             + "Restart the kernel to start fresh ranks; the group cannot continue without it.")

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
        if self.supervisor is not None:
            try:
                await asyncio.wait_for(self._on_main(self._interrupt_busy()), 5)
            except Exception as e:  # noqa: BLE001
                content = {"status": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": []}
        self.session.send(stream, "interrupt_reply", content, parent, ident=ident)

    async def _interrupt_busy(self) -> None:
        run = self._current
        assert self.supervisor is not None
        if run is not None:
            run.interrupted_at = run.clock()  # ranks still blocked in a collective get looked at soon
        await self.supervisor.interrupt(run.busy_ranks if run is not None else None)

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
            return await sup.request(rank, msg_type, content)
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


class DistributedKernelApp(IPKernelApp):
    """IPKernelApp that runs :class:`DistributedKernel` and keeps its own prints off IOPub."""

    name = "dist-kernel"
    kernel_class = DistributedKernel
    outstream_class = None  # the parent's own prints go to its log, never into a cell
    dist_config = AnyTrait(None)

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


def launch(connection_file: str, config: KernelConfig | ConfigError, extra_argv: list[str] | None = None) -> None:
    """Start the parent kernel (what kernel.json's argv runs)."""
    app = DistributedKernelApp.instance(dist_config=config)
    app.initialize(["-f", connection_file, *(extra_argv or [])])
    started = time.monotonic()
    app.log.info("dist_kernel parent up in %.3fs", time.monotonic() - started)
    app.start()
