"""Runs inside each rank: what the rank kernel answers the parent, besides running cells.

Everything here is called from :class:`dist_kernel.rank.kernel.RankKernel`: the typed
requests of :mod:`dist_kernel.protocol` (where, status, teardown, options) run on the
kernel's control thread, which can read the main thread's frames while that thread is
blocked in a C++ collective. State lives in this module, never in the user's namespace, so
``%reset -f`` or ``globals().clear()`` cannot break it.
"""

from __future__ import annotations

import contextlib
import gc
import linecache
import os
import re
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from types import FrameType

from dist_kernel.protocol import META_RANKS, META_SOLO, Done, Operand, Place, RankStatus, meta_of, ranks_from, with_meta
from dist_kernel.rank import nccl, store

_state: dict[str, object] = {"empty_cache": True, "busy": False}

#: torch.distributed functions that only wrap others (the innermost real call is reported)
_WRAPPERS = {"wrapper", "_wait", "wait"}


def die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this rank when the parent dies (PR_SET_PDEATHSIG).

    Needs no GIL, so it also ends a rank stuck in C code that holds it (a CUDA sync inside
    ``.item()``, a C extension). The parent's reaper process does the same and removes the
    runtime dir; this is the OS-level guard should the reaper itself be killed.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took hold
        os._exit(1)


#: address space held back for the kernel's own work (a teardown's thread, a re-formation):
#: freed when a cell runs out of memory, so that the rank can still take part in recovering
RESERVE = 64 << 20
_reserve: list = []


def keep_reserve() -> None:
    """Hold :data:`RESERVE` of address space (reserved, never touched: it costs no memory, but
    counts against ``RLIMIT_AS``), unless it is held already or cannot be had."""
    if _reserve:
        return
    import mmap

    try:
        _reserve.append(mmap.mmap(-1, RESERVE))
    except (OSError, ValueError, MemoryError, OverflowError):
        return


def out_of_memory() -> None:
    """A cell ran out of memory: give the reserve back, for the traceback, the teardown and the
    re-formation that follow (held again before the next cell)."""
    while _reserve:
        _reserve.pop().close()


def before_cell(info: object = None) -> None:
    keep_reserve()
    _state["busy"] = True
    _state["in_code"] = True
    _state["up_at_start"] = group_up()


def in_code() -> bool:
    """Is the cell's own code still running (not yet showing its traceback, not finished)?

    Only then does the stop button's SIGINT raise: a second one while IPython formats the
    first one's traceback (slow on a loaded machine), or while ipykernel sends the reply,
    would print a second error, or escape the request so that no reply is ever sent."""
    return bool(_state.get("in_code"))


@contextlib.contextmanager
def showing_traceback(cell_failed: bool, error: BaseException | None = None) -> Iterator[None]:
    """While a traceback is shown, the cell's code does not run; when the cell itself failed
    (IPython's ``running_compiled_code``), its code is over for good. A traceback a running
    cell shows and survives (an ipywidgets ``Output``) leaves it interruptible afterwards."""
    before = _state.get("in_code")
    _state["in_code"] = False
    if isinstance(error, MemoryError):
        out_of_memory()
    try:
        yield
    finally:
        _state["in_code"] = before and not cell_failed


@contextlib.contextmanager
def on_request(what: str) -> Iterator[None]:
    """A request the parent runs on the main thread as it runs a cell (``%dist_sync``): the rank
    is busy meanwhile (a teardown then cuts its connections instead of destroying the group
    under it), the stop button's SIGINT raises in it, and ``where`` names its step (:func:`doing`)."""
    before = (_state.get("busy"), _state.get("in_code"))
    _state.update(busy=True, in_code=True, doing=what)
    try:
        yield
    finally:
        _state["busy"], _state["in_code"] = before
        _state.pop("doing", None)


def doing(what: str) -> None:
    """The step the running request is at, in words: ``where``'s ``line`` while no cell line is
    on the stack (``%dist_sync: copying model``)."""
    if "doing" in _state:
        _state["doing"] = what


def group_seq() -> int | None:
    """The default group's collective sequence number (None without a group): ranks that
    disagree after an interrupted cell are out of step (one enqueued a collective the others
    never will), and every later collective would pair with the wrong one."""
    if not group_up():
        return None
    import torch.distributed as dist

    return _group_info(dist.GroupMember.WORLD)[1]


def group_up() -> bool:
    """Is this rank's default process group initialised?"""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported torch: no group
        return False


def group_destroyed() -> bool:
    """Did the cell that just ran take the group down (``dist.destroy_process_group()``)?"""
    return bool(_state.get("up_at_start")) and not group_up()


def where() -> Place:
    """Where the main thread is: its cell frames, and the torch.distributed call it is in."""
    main = threading.main_thread().ident
    assert main is not None  # the main thread has run since the interpreter started
    frame = sys._current_frames().get(main)
    busy = bool(_state.get("busy"))
    if frame is None:
        return Place(collective=None, group_ranks=[], peer=None, seq=None, stack=[], line="", busy=busy,
                     group_seq=group_seq())
    collective, dist_frame, public, backward = None, None, None, False
    f: FrameType | None = frame
    while f is not None:  # the innermost torch.distributed call, with its arguments
        if f.f_code.co_name == "_engine_run_backward" and "/torch/autograd/" in f.f_code.co_filename:
            backward = True  # in C++ autograd, where DDP starts its gradient all_reduce
        if f.f_code.co_filename.endswith("distributed_c10d.py") and f.f_code.co_name not in _WRAPPERS:
            collective, dist_frame = f.f_code.co_name, f
        if "/torch/distributed/" in f.f_code.co_filename and not f.f_code.co_name.startswith("_") \
                and f.f_code.co_name not in _WRAPPERS:
            public = f.f_code.co_name  # the outermost public call: new_subgroups, not its new_group
        f = f.f_back
    store_wait = store.waiting() and public is not None
    if store_wait:  # group creation: name what the user called, never a private helper
        collective = public
    group_ranks: list[int] = []
    peer = seq = None
    native = ""
    if dist_frame is None and busy:
        native, native_group = _native_call(frame)
        if native:
            group_ranks, seq = _group_info(native_group)
    if dist_frame is not None:
        args = dist_frame.f_locals
        group_ranks, seq = _group_info(args.get("group"))
        for name in ("src", "dst", "group_src", "group_dst"):
            value = args.get(name)
            if isinstance(value, int) and collective in ("send", "recv", "isend", "irecv"):
                peer = value
    cuda_wait, pending = "", []
    if dist_frame is None and busy and not store_wait and nccl.recording():
        cuda_wait = nccl.cuda_wait(frame)
        pending = nccl.pending() if cuda_wait else []  # the recorder is read only then
        if pending and not native:  # a C++ wait for a collective: looked at as DDP's is (idle counts, stop)
            native, group_ranks, seq = cuda_wait, pending[0].group_ranks, pending[0].seq
    summary = [fs for fs in traceback.extract_stack(frame) if _user_frame(fs.filename)] if busy else []
    stack = [f'  File "{_short(fs.filename)}", line {fs.lineno}, in {fs.name}\n    {fs.line or ""}' for fs in summary]
    cell = [fs for fs in summary if _short(fs.filename) == "cell"]
    line = f"line {cell[-1].lineno}: {cell[-1].line}" if cell else str(_state.get("doing") or "")
    if not cell and _state.get("doing"):  # a request, not a cell (%dist_sync): its step, not torch's frames
        stack = [f"  {_state['doing']}"]
    return Place(collective=collective, group_ranks=group_ranks, peer=peer, seq=seq, stack=stack,
                 line=line, busy=busy, store_wait=store_wait, in_code=in_code(), group_seq=group_seq(),
                 in_backward=backward, native=native, cuda_wait=cuda_wait, pending=pending,
                 operands=operands(dist_frame) if dist_frame is not None else [])


#: torch's code that starts collectives in C++, with no torch.distributed collective on the stack
#: (DDP's constructor verifies and broadcasts the parameters through dist._verify_params_across_processes
#: and dist._broadcast_coalesced)
_NATIVE_CODE = ("/torch/distributed/", "/torch/nn/parallel/")
#: the local names under which torch's code holds the process group it works on
_GROUP_NAMES = ("process_group", "group", "pg")
_CALLEE = re.compile(r"([A-Za-z_]\w*)\s*\(")


def _native_call(frame: FrameType) -> tuple[str, object]:
    """The torch call the main thread is in when its innermost Python frame is torch's
    distributed code (so it is in a C++ call that code made), named from the outermost torch
    frame inwards: ``DistributedDataParallel(...) / _verify_param_shape_across_processes /
    _verify_params_across_processes``; and the process group found on the way (None: the
    default one). ``""`` when the main thread is elsewhere."""
    if not any(p in frame.f_code.co_filename for p in _NATIVE_CODE):
        return "", None
    group: object = None
    outer = frame
    f: FrameType | None = frame
    while f is not None and "/torch/" in f.f_code.co_filename:
        if group is None:
            group = _group_in(f.f_locals)
        outer, f = f, f.f_back
    names = [_frame_call(outer)]
    if frame is not outer:
        names.append(frame.f_code.co_name)
    callee = _callee(frame)
    if callee and callee not in names:
        names.append(callee)
    return " / ".join(names), group


def _callee(frame: FrameType) -> str:
    """The function a frame is calling now, read from its source: the call expression of the
    instruction it is at (``self.reducer._rebuild_buckets()`` in ``if torch.is_grad_enabled()
    and self.reducer._rebuild_buckets():``), else the first call on its line; "" when neither is
    known."""
    source = ""
    positions = getattr(frame.f_code, "co_positions", None)  # Python 3.11+
    try:
        if positions is None or frame.f_lasti < 0:  # not started: no instruction
            raise IndexError
        line, end, col, end_col = list(positions())[frame.f_lasti // 2]
        if line is not None and line == end and col is not None and end_col is not None:
            source = linecache.getline(frame.f_code.co_filename, line)[col:end_col]
    except (IndexError, ValueError):
        pass
    # f_lineno is None while a frame runs an instruction that has no line (seen once, in a look
    # at a rank in DDP's code): no callee to name then, never a failed look
    found = _CALLEE.search(source) or _CALLEE.search(linecache.getline(frame.f_code.co_filename,
                                                                       frame.f_lineno or 0))
    return found[1] if found else ""


#: nn.Module's frames that call a module (``model(x)``): named after the module's forward
_MODULE_CALLS = ("_wrapped_call_impl", "_call_impl")


def _frame_call(f: FrameType) -> str:
    """What the user called to enter this frame: a class's name for its constructor, a
    module's forward for a call of the module."""
    if f.f_code.co_name == "__init__" and "self" in f.f_locals:
        return f"{type(f.f_locals['self']).__name__}(...)"
    if f.f_code.co_name in _MODULE_CALLS and "self" in f.f_locals:
        return f"{type(f.f_locals['self']).__name__}.forward"
    return f"{f.f_code.co_name}(...)"


def operands(frame: FrameType) -> list[Operand]:
    """The tensors a torch.distributed call holds (its frame's tensor arguments and locals, in
    their order), by name, dtype and shape: what the fault policy compares between ranks blocked
    in the same collective (rule 3). Read only in a ``where`` look, never on a cell's way."""
    torch = sys.modules.get("torch")
    kind = getattr(torch, "Tensor", None)
    if kind is None:
        return []
    found = []
    for name, value in list(frame.f_locals.items()):
        if isinstance(value, kind):
            found.append(Operand(name=name, dtype=str(value.dtype).removeprefix("torch."), shape=list(value.shape)))
    return found


def _group_in(names: dict) -> object:
    """A process group held under one of :data:`_GROUP_NAMES`, or None."""
    dist = sys.modules.get("torch.distributed")
    kind = getattr(dist, "ProcessGroup", None)
    for name in _GROUP_NAMES:
        value = names.get(name)
        if kind is not None and isinstance(value, kind):
            return value
    return None


def _group_info(group: object) -> tuple[list[int], int | None]:
    """The global ranks of a collective's group (the world for None) and its sequence number."""
    try:
        import torch.distributed as dist

        pg = group if group is not None else dist.GroupMember.WORLD
        assert pg is None or isinstance(pg, dist.ProcessGroup)  # _group_in found it by this type
        ranks = list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a torn-down group: no ranks to name
        return [], None
    seq = None
    if pg is not None:
        with contextlib.suppress(Exception):
            seq = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]  # private torch API, not in its stubs
    return ranks, seq


#: what gloo says when a connection of the group breaks (it raises a plain RuntimeError)
_GLOO_BROKEN = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def group_broke(exc: BaseException | None) -> bool:
    """Did this error (or one it was raised from) come from a broken process group? Or was a
    wait in the rendezvous store given up (the ranks then disagree on which groups exist)?"""
    if store.abandoned():
        return True
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    for _ in range(10):
        if exc is None or dist_error is None:
            return False
        if isinstance(exc, (dist_error, nccl.GroupAborted)):
            return True
        if isinstance(exc, RuntimeError) and "gloo" in str(exc) and any(w in str(exc) for w in _GLOO_BROKEN):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _user_frame(filename: str) -> bool:
    return not any(p in filename for p in ("site-packages/IPython", "site-packages/ipykernel", "asyncio",
                                           "site-packages/tornado", "site-packages/traitlets", "<frozen",
                                           "threading.py", "runpy.py", "ipykernel_launcher",
                                           "dist_kernel/rank/"))


def _short(filename: str) -> str:
    return "cell" if ("/ipykernel_" in filename or filename.startswith("<ipython-input")) else filename


def after_cell(result: object = None) -> None:
    """Return cached CUDA memory after each cell, so long sessions don't run out through the cache."""
    _state["busy"] = False
    _state["in_code"] = False
    if not _state.get("empty_cache"):
        return
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def solo_output(streams: bool = False) -> Iterator[None]:
    """Rich output shown while this is active is this rank's alone (say, rank 0's progress bar
    while the other ranks hide theirs): the parent shows it unlabelled, as one process would.
    With ``streams``, so is text printed meanwhile (rank 0's log line that the others never
    print): it goes out in stream messages of its own, marked alike (see
    :class:`dist_kernel.rank.kernel.RankOutStream`)."""
    from IPython import get_ipython

    pub = getattr(get_ipython(), "display_pub", None)
    original = getattr(pub, "publish", None)
    if original is not None and not getattr(original, "__dist_kernel_solo__", False):  # nested: marked already
        assert pub is not None  # it has the publish found above
        wrapped: Callable[..., None] = original

        def publish(data: dict, metadata: dict | None = None, *args: object, **kwargs: object) -> None:
            metadata = with_meta(metadata, {META_SOLO: True})
            wrapped(data, metadata, *args, **kwargs)

        publish.__dist_kernel_solo__ = True  # type: ignore[attr-defined]
        pub.publish = publish
    else:
        original = None
    marked = [s for s in (sys.stdout, sys.stderr) if hasattr(s, "solo") and not s.solo] if streams else []
    if marked:
        flush_streams()  # what was printed before goes first, unmarked
    for stream in marked:
        stream.solo = True
    try:
        yield
    finally:
        if original is not None and pub is not None:  # pub is set wherever original is
            pub.publish = original
        for stream in marked:
            stream.solo = False


def flush_streams() -> None:
    """Send what this rank printed so far. A rank whose twin shows solo output calls it at the
    same point, so that text printed before by every rank leaves every rank alike (and merges)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or replaced stream: nothing to send
            pass


@contextlib.contextmanager
def dropped_output() -> Iterator[None]:
    """Nothing this rank displays while this is active reaches the frontend (another rank shows
    the same thing, marked as its alone with :func:`solo_output`)."""
    from IPython import get_ipython

    pub = getattr(get_ipython(), "display_pub", None)
    if pub is None:
        yield
        return
    original = pub.publish
    # a display flushes the streams first: so does a dropped one, so that text printed before
    # leaves when it would have, and meets its twins from the ranks that show the display
    flush = getattr(pub, "_flush_streams", lambda: None)
    pub.publish = lambda *args, **kwargs: flush()
    try:
        yield
    finally:
        pub.publish = original


def cell_ranks() -> tuple[int, ...]:
    """The ranks that run the current cell (a ``%%rank`` line may name fewer than all).

    The parent puts them in the execute_request's metadata (``dist_kernel.ranks``) where they
    are not the whole world; otherwise, and outside a cell, every rank of the group.
    """
    from IPython import get_ipython

    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    try:
        meta = kernel.get_parent("shell").get("metadata") or {} if kernel is not None else {}
    except Exception:  # noqa: BLE001 - no request in this context
        meta = {}
    ranks = ranks_from(meta_of(meta).get(META_RANKS))
    if ranks:
        return ranks
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return tuple(range(world))


def set_empty_cache(on: bool) -> None:
    _state["empty_cache"] = bool(on)


def status() -> RankStatus:
    """What ``%dist_status`` shows for this rank."""
    rss = None
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            kb = next((line.split()[1] for line in f if line.startswith("VmRSS:")), None)
        rss = round(int(kb) / 1024, 1) if kb else None
    except OSError:
        pass
    cuda_alloc = cuda_reserved = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_alloc = round(torch.cuda.memory_allocated() / 2**20, 1)
        cuda_reserved = round(torch.cuda.memory_reserved() / 2**20, 1)
    place = where()
    return RankStatus(pid=os.getpid(), host=socket.gethostname(), device=str(_state.get("device", "?")),
                      rss_mb=rss, empty_cache=bool(_state.get("empty_cache")), busy=place.busy,
                      group="up" if group_up() else "down",
                      line=place.line if place.busy else "", cuda_allocated_mb=cuda_alloc,
                      cuda_reserved_mb=cuda_reserved)


def set_device(device: str) -> None:
    """Remember the rank's device for status (the user may rebind the name ``device``)."""
    _state["device"] = device


def device() -> str:
    """The device the kernel gave this rank (``cpu``, ``cuda:0``, ...)."""
    return str(_state.get("device", "cpu"))


def teardown_group(peer_pids: list[int], peer_hosts: list[str] | None = None) -> Done:
    """Break this rank's process group, so that every collective on it raises at once.

    Destroying the group makes peers blocked with this rank raise, but not this rank's own
    main thread when it is blocked itself (every rank in mismatched collectives): so the
    rank also shuts down its TCP connections to the peer ranks, which is what a dead peer
    looks like to gloo ("Connection closed by peer"). A wait in the rendezvous store (group
    creation) is ended too. An NCCL rank aborts its communicators instead, which alone frees a
    GPU waiting for a peer (:func:`dist_kernel.rank.nccl.abort`). The group is formed again
    afterwards.
    """
    released = store.release()
    # never rank 0's rendezvous (across machines, a TCPStore kept for the kernel's life): the
    # next formation meets there again
    cut = cut_connections(peer_pids, peer_hosts or [], keep_port=next(iter(store.tcp_port), None))
    outcome = f"cut {cut} connection(s)" + (", ended a wait in the store" if released else "")
    if nccl.in_use() and group_up():
        try:
            outcome += ", " + nccl.abort(interrupt_main=bool(_state.get("busy")) and in_code())
        except Exception as e:  # noqa: BLE001 - reported; the destroy below may still work
            outcome += f", abort failed: {type(e).__name__}: {e}"
    if not _state.get("busy"):
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
                outcome += ", destroyed"
        except Exception as e:  # noqa: BLE001 - a broken group may refuse; that is fine too
            outcome += f", {type(e).__name__}: {e}"
    return Done(outcome=outcome)


def cut_connections(peer_pids: list[int], peer_hosts: list[str] = (),  # type: ignore[assignment]
                    keep_port: int | None = None) -> int:
    """Shut down this process's established TCP connections to the given processes on this
    machine, and to every process on the given other machines (IPv4 addresses; Linux); those
    from or to ``keep_port`` (the rendezvous store) stay."""
    kept = f":{keep_port:04X}" if keep_port else None
    table = _tcp_table()
    peers: set[str] = set()
    for pid in peer_pids:
        peers.update(table[i][0] for i in _socket_inodes(pid) if i in table)
    hosts = {_proc_net_host(h) for h in peer_hosts if h}
    cut = 0
    for inode, fd in _socket_inodes(os.getpid()).items():
        local, remote, state = table.get(inode, ("", "", ""))
        if kept and (local.endswith(kept) or remote.endswith(kept)):
            continue
        if state == "01" and (remote in peers or remote.rsplit(":", 1)[0] in hosts):  # 01: ESTABLISHED
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                continue
    return cut


def _proc_net_host(address: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (hex, host byte order: little-endian here)."""
    try:
        return socket.inet_aton(address)[::-1].hex().upper()
    except OSError:
        return address


def _socket_inodes(pid: int) -> dict[int, int]:
    """Socket inode -> file descriptor, for one process."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(fd)
    return found


def _tcp_table() -> dict[int, tuple[str, str, str]]:
    """Socket inode -> (local address, remote address, state), from /proc/net/tcp and tcp6."""
    table: dict[int, tuple[str, str, str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    table[int(parts[9])] = (parts[1], parts[2], parts[3])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return table
