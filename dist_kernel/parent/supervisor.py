"""Rank supervision: start the N child ipykernels, talk to them, watch them, end them.

Each rank is a stock ipykernel started with ``sys.executable`` through jupyter_client, on
IPC sockets in a private runtime directory (mode 0700), with its own HMAC key. Everything
here runs on the parent's main event loop; other threads cross over with
``asyncio.run_coroutine_threadsafe``.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

from dist_kernel.exceptions import RankDiedError, RankStartError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.merge import strip_ansi
from dist_kernel.parent.reaper import write_pids
from dist_kernel.rank.agent import probe_paths
from dist_kernel.rank.rendezvous import LOOPBACK_ENV, store_path

LOG_TAIL_LINES = 30


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class _RankSpecManager(KernelSpecManager):
    """Hands jupyter_client the plain ipykernel spec, bound to this interpreter."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name="dist_kernel rank", language="python", interrupt_mode="signal",
        )


def describe_exit(code: int | None) -> str:
    """Human words for a process exit status."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (often the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


@dataclass
class Rank:
    """One child ipykernel."""

    rank: int
    km: AsyncKernelManager
    log_path: str
    kc: object = None
    exit_reason: str | None = None
    device: str = ""
    tasks: list[asyncio.Task] = field(default_factory=list)
    pending: dict[str, asyncio.Future] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        proc = getattr(self.km.provisioner, "process", None)
        return proc.pid if proc is not None else None

    @property
    def alive(self) -> bool:
        return self.exit_reason is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The end of what the rank process wrote outside Jupyter (C-level crashes land here)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


RUNTIME_PREFIX = "dist_kernel-"


def sweep_stale_runtime_dirs(base: str | None = None) -> list[str]:
    """Remove runtime dirs left by kernels whose cleanup never ran.

    When a parent dies, its reaper process removes the dir; only if the reaper was killed as
    well (``kill -9`` of every process, the OOM killer) is one left. A dir is stale when the
    pid in its name is gone.
    """
    removed = []
    base = base or tempfile.gettempdir()
    for name in os.listdir(base):
        head, _, rest = name.partition("-")
        pid = rest.split("-", 1)[0]
        path = os.path.join(base, name)
        if f"{head}-" != RUNTIME_PREFIX or not pid.isdigit() or not os.path.isdir(path):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # still alive (or someone else's): keep
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:
            continue
    return removed


class RankSupervisor:
    """Owns the rank processes of one kernel."""

    def __init__(self, config: KernelConfig, on_iopub: Callable[[int, dict], None],
                 on_death: Callable[[int, str], None], log: logging.Logger | None = None,
                 on_stdin: Callable[[int, dict], None] | None = None) -> None:
        self.config = config
        self.on_iopub = on_iopub
        self.on_stdin = on_stdin
        self.on_death = on_death
        self.log = log or logging.getLogger("dist_kernel")
        sweep_stale_runtime_dirs()
        # 0700 by mkdtemp; the owner's pid in the name lets a later kernel sweep it up
        self.runtime_dir = tempfile.mkdtemp(prefix=f"{RUNTIME_PREFIX}{os.getpid()}-")
        self.ranks: dict[int, Rank] = {}
        self.generation = 0
        # one seed for all ranks of this start (a fresh one per restart, unless --seed)
        self.seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**31)
        self.ready = asyncio.Event()
        self.start_error: str | None = None
        self._closing = False
        self._watch_task: asyncio.Task | None = None
        # cleans up if this process is SIGKILLed (see reaper.py); exits when the dir is gone
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "dist_kernel.parent.reaper", str(os.getpid()), self.runtime_dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    # ------------------------------------------------------------- startup
    async def start(self) -> None:
        """Start every rank in parallel and form the group; never raises, sets ``start_error``."""
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self._start(), timeout=self.config.startup_timeout)
            self.log.info("ranks ready in %.2fs", time.monotonic() - t0)
        except asyncio.TimeoutError:
            self.start_error = (
                f"The ranks did not start and form the process group within "
                f"{self.config.startup_timeout:.0f}s. {self._rank_states()}Fix: check the "
                "environment (import torch works?), or raise --startup-timeout; then restart the kernel.")
        except Exception as e:  # noqa: BLE001 - reported to the user in the first cell
            self.start_error = str(e) if isinstance(e, RankStartError) else f"{type(e).__name__}: {e}"
        if self.start_error:
            await self.shutdown(now=True)
        self.ready.set()

    async def _start(self) -> None:
        self._watch_task = asyncio.ensure_future(self._watch())
        self.generation = 1
        store = store_path(self.runtime_dir, self.generation)

        async def launch_and_join(rank: int) -> None:
            # each rank starts importing torch and joining as soon as *it* is up
            await self._launch(rank)
            await self._join(rank, store, first=True)

        await asyncio.gather(*(launch_and_join(r) for r in range(self.config.world_size)))

    def _env(self, rank: int) -> dict[str, str]:
        cfg = self.config
        env = dict(os.environ)  # KernelManager(env=...) replaces the whole environment
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_WORLD_SIZE": str(cfg.world_size), "GROUP_RANK": "0", "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "JPY_PARENT_PID": str(os.getpid()),
            "DIST_KERNEL_RANK": str(rank), "PYTHONUNBUFFERED": "1",
            # inherited by everything a rank starts (DataLoader workers, subprocesses): lets a
            # clean-up find them even after the rank, its parent and the reaper are gone
            "DIST_KERNEL_RUNTIME_DIR": self.runtime_dir,
        })
        for key, value in LOOPBACK_ENV.items():
            env.setdefault(key, value)
        # as torchrun does: N ranks each using every core would oversubscribe the CPU N-fold
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.world_size)))
        if cfg.gpus:
            # the same mask for every rank, so LOCAL_RANK indexes it (what accelerate expects)
            parent_mask = [p.strip() for p in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if p.strip()]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                parent_mask[g] if parent_mask else str(g) for g in cfg.gpus)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
            # accelerate (and fastai's distrib_ctx, built on it) only trains data-parallel on CPU
            # when told to; otherwise it would see "no GPU" and train each rank alone
            env.setdefault("ACCELERATE_USE_CPU", "true")
        return env

    async def _launch(self, rank: int) -> None:
        km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=_RankSpecManager())
        km.transport = "ipc"
        km.ip = os.path.join(self.runtime_dir, f"rank{rank}")
        km.connection_file = os.path.join(self.runtime_dir, f"rank{rank}.json")
        km.autorestart = False  # a restarted rank could not silently rejoin the group
        log_path = os.path.join(self.runtime_dir, f"rank{rank}.log")
        r = Rank(rank=rank, km=km, log_path=log_path)
        self.ranks[rank] = r
        with open(log_path, "wb") as log_file:  # noqa: ASYNC230 - tiny local file
            await km.start_kernel(env=self._env(rank), cwd=os.getcwd(), stdout=log_file,
                                  stderr=log_file, stdin=asyncio.subprocess.DEVNULL)
        write_pids(self.runtime_dir, [p for p in (x.pid for x in self.ranks.values()) if p])
        kc = km.client()
        kc.start_channels()
        r.kc = kc
        try:
            await kc.wait_for_ready(timeout=self.config.startup_timeout)
        except RuntimeError as e:
            tail = r.log_tail()
            raise RankStartError(
                f"rank {rank} (pid {r.pid}) did not start: {e}\n{tail}\nFix: check that ipykernel "
                f"works in {sys.executable}, then restart the kernel.") from None
        self._start_pumps(r)

    async def form_group(self) -> None:
        """Every rank joins a fresh process group (a new store file per formation): used to
        re-form the group after a failure tore it down."""
        self.generation += 1
        store = store_path(self.runtime_dir, self.generation)
        await asyncio.gather(*(self._join(r, store, first=False) for r in self.ranks))

    async def _join(self, rank: int, store: str, first: bool) -> None:
        """One rank joins the group at ``store``. The first formation also installs the rank
        agent, seeds every rank alike and turns on the fastai integration."""
        cfg = self.config
        args = dict(rank=rank, world_size=cfg.world_size, backend=cfg.backend, store=store,
                    timeout=cfg.timeout, use_cuda=cfg.uses_cuda, seed=self.seed if first else None,
                    fastai=cfg.fastai and first)
        agent = dict(rank=rank, parent_pid=os.getpid(), runtime_dir=self.runtime_dir,
                     empty_cache=cfg.empty_cache)
        code = ("import dist_kernel.rank.agent as _dk_agent, dist_kernel.rank.rendezvous as _dk_rdzv\n"
                f"_dk_agent.setup(**{agent!r})\n_dk_rdzv.join(**{args!r})")
        reply = await self.run_silent(rank, code, {"device": "str(device)"})
        if reply.get("status") != "ok":
            tb = strip_ansi("\n".join(reply.get("traceback", [])[-6:])) or f"{reply.get('ename')}: {reply.get('evalue')}"
            raise RankStartError(
                f"rank {rank} could not join the {cfg.backend} process group:\n{tb}\n"
                f"Fix: make sure `import torch` works in {sys.executable} and the options suit this "
                "machine, then restart the kernel.")
        dev = reply.get("user_expressions", {}).get("device", {})
        self.ranks[rank].device = dev.get("data", {}).get("text/plain", "").strip("'")

    async def where(self, rank: int, wait: float = 1.5) -> dict:
        """Where a rank's cell is, read by its watchdog thread (works while it is blocked in C++)."""
        request, answer = probe_paths(self.runtime_dir, rank)
        if not self.ranks[rank].alive:
            return {}
        with contextlib.suppress(OSError):
            os.unlink(answer)
        with open(request, "w"):  # noqa: ASYNC230 - touching a local file
            pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            text = _read(answer)
            if text:
                try:
                    return json.loads(text)
                except ValueError:
                    return {}
        return {}

    async def teardown(self, ranks: list[int]) -> None:
        """Destroy the group on idle ranks, so peers blocked in a collective with them raise."""
        code = "_dk_agent.teardown_group()"
        await asyncio.gather(*(self.run_silent(r, code) for r in ranks if self.ranks[r].alive),
                             return_exceptions=True)

    async def status(self, timeout: float = 2.0) -> dict[int, dict]:
        """Each rank's ``rank_agent.status()``; a rank that does not answer in time is busy."""

        async def one(rank: int) -> dict:
            r = self.ranks[rank]
            base = {"pid": r.pid, "device": r.device}
            if not r.alive:
                return {**base, "state": r.exit_reason}
            try:
                reply = await asyncio.wait_for(
                    self.run_silent(rank, "", {"s": "__import__('dist_kernel.rank.agent').rank.agent.status()"}),
                    timeout)
            except (asyncio.TimeoutError, RankDiedError):
                return {**base, "state": "busy"}
            raw = reply.get("user_expressions", {}).get("s", {}).get("data", {}).get("text/plain", "{}")
            try:
                info = ast.literal_eval(raw)  # a dict of plain values; never unpickled
            except (ValueError, SyntaxError):
                info = {}
            return {**base, **info, "state": "idle"}

        results = await asyncio.gather(*(one(r) for r in self.ranks))
        return dict(zip(self.ranks, results, strict=True))

    # ------------------------------------------------------------ messaging
    async def _pump(self, r: Rank, channel: str, receive: Callable, handle: Callable[[dict], None]) -> None:
        """Read one channel of a rank forever, handing each message on; a message with a bad
        HMAC signature (or malformed) is dropped, and one bad message never stops the pump."""
        while True:
            try:
                msg = await receive()
            except asyncio.CancelledError:
                raise
            except ValueError as e:
                self.log.warning("rank %d: dropped a %s message: %s", r.rank, channel, e)
                continue
            except Exception:  # noqa: BLE001 - the socket closes at shutdown
                if self._closing:
                    return
                self.log.exception("rank %d: %s reader failed", r.rank, channel)
                await asyncio.sleep(0.05)
                continue
            try:
                handle(msg)
            except Exception:  # noqa: BLE001
                self.log.exception("rank %d: error handling %s %s", r.rank, channel, msg.get("msg_type"))

    def _start_pumps(self, r: Rank) -> None:
        def on_reply(msg: dict) -> None:
            fut = r.pending.pop(msg["parent_header"].get("msg_id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

        def on_stdin(msg: dict) -> None:
            if self.on_stdin is not None and msg["msg_type"] == "input_request":
                self.on_stdin(r.rank, msg)

        r.tasks = [
            asyncio.ensure_future(self._pump(r, "IOPub", r.kc.get_iopub_msg, lambda m: self.on_iopub(r.rank, m))),
            asyncio.ensure_future(self._pump(r, "shell", r.kc.get_shell_msg, on_reply)),
            asyncio.ensure_future(self._pump(r, "stdin", r.kc.get_stdin_msg, on_stdin)),
        ]

    def reply_input(self, rank: int, value: str) -> None:
        r = self.ranks[rank]
        if r.alive and r.kc is not None:
            r.kc.input(value)

    def send(self, rank: int, msg_type: str, content: dict, metadata: dict | None = None,
             expect_reply: bool = True, buffers: list | None = None) -> tuple[str, asyncio.Future | None]:
        """Send a shell message to one rank; returns its msg_id and a future for the reply."""
        r = self.ranks[rank]
        if not r.alive:
            raise RankDiedError(f"rank {rank} {r.exit_reason}")
        msg = r.kc.session.msg(msg_type, content, metadata=metadata or {})
        if buffers:
            msg["buffers"] = list(buffers)
        fut = None
        if expect_reply:
            fut = asyncio.get_running_loop().create_future()
            r.pending[msg["header"]["msg_id"]] = fut
        r.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"], fut

    async def request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        """Round trip of one shell request; returns the reply content."""
        _, fut = self.send(rank, msg_type, content)
        reply = await asyncio.wait_for(fut, timeout)
        return reply["content"]

    async def run_silent(self, rank: int, code: str, user_expressions: dict | None = None) -> dict:
        """Execute setup code on one rank outside the user's history; returns the reply content."""
        content = {"code": code, "silent": True, "store_history": False,
                   "user_expressions": user_expressions or {}, "allow_stdin": False, "stop_on_error": False}
        _, fut = self.send(rank, "execute_request", content)
        return (await fut)["content"]

    # ------------------------------------------------------------ liveness
    async def _watch(self, interval: float = 0.2) -> None:
        """Notice a rank process that exits, fail its requests, tell the kernel."""
        while not self._closing:
            for r in list(self.ranks.values()):
                if r.alive and r.km.has_kernel and not await r.km.is_alive():
                    proc = r.km.provisioner.process if r.km.provisioner else None
                    code = proc.poll() if proc is not None else None
                    r.exit_reason = describe_exit(code)
                    err = RankDiedError(f"rank {r.rank} (pid {r.pid}) {r.exit_reason}")
                    for fut in r.pending.values():
                        if not fut.done():
                            fut.set_exception(err)
                    r.pending.clear()
                    with contextlib.suppress(Exception):
                        self.on_death(r.rank, r.exit_reason)
            await asyncio.sleep(interval)

    def _rank_states(self) -> str:
        dead = [f"rank {r.rank} {r.exit_reason}" for r in self.ranks.values() if not r.alive]
        return ("; ".join(dead) + ". ") if dead else ""

    # ------------------------------------------------------------ control
    async def interrupt(self, ranks: list[int] | None = None) -> None:
        """SIGINT each named live rank (its whole process group, as Jupyter does)."""
        for rank in ranks if ranks is not None else list(self.ranks):
            r = self.ranks.get(rank)
            if r is not None and r.alive and r.km.has_kernel:
                with contextlib.suppress(Exception):
                    await r.km.interrupt_kernel()

    async def shutdown(self, now: bool = False) -> None:
        """End every rank process and remove the runtime directory."""
        self._closing = True
        if self._watch_task is not None:
            self._watch_task.cancel()

        async def stop(r: Rank) -> None:
            for task in r.tasks:
                task.cancel()
            if r.kc is not None:
                with contextlib.suppress(Exception):
                    r.kc.stop_channels()
            if r.km.has_kernel:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(r.km.shutdown_kernel(now=now), timeout=5 if not now else 3)
            self.kill_now(r)

        await asyncio.gather(*(stop(r) for r in self.ranks.values()), return_exceptions=True)
        self._remove_runtime_dir()

    def kill_now(self, r: Rank | None = None) -> None:
        """SIGKILL rank process groups synchronously (used at exit, from any thread)."""
        for rank in [r] if r is not None else list(self.ranks.values()):
            pid = rank.pid
            if pid is None:
                continue
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # each rank leads its own process session
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def cleanup_sync(self) -> None:
        """Last-resort cleanup when the parent exits without a shutdown request."""
        self._closing = True
        self.kill_now()
        self._remove_runtime_dir()

    def _remove_runtime_dir(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        try:  # the reaper sees the dir gone within 0.1 s and exits; collect it (no zombie)
            self._reaper.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._reaper.kill()
            self._reaper.wait()
