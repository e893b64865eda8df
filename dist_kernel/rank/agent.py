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
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator

from dist_kernel.protocol import META_RANKS, META_SOLO, Done, Place, RankStatus, meta_of, ranks_from, with_meta
from dist_kernel.rank import nccl, stack, store
from dist_kernel.rank.connections import cut_connections

_state: dict[str, object] = {"empty_cache": True, "busy": False}

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

    return stack.group_info(dist.GroupMember.WORLD)[1]


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
    dist_frame, public, backward = stack.dist_call(frame)
    collective = dist_frame.f_code.co_name if dist_frame is not None else None
    store_wait = store.waiting() and public is not None
    if store_wait:  # group creation: name what the user called, never a private helper
        collective = public
    group_ranks: list[int] = []
    peer = seq = None
    native = ""
    if dist_frame is None and busy:
        native, native_group = stack.native_call(frame)
        if native:
            group_ranks, seq = stack.group_info(native_group)
    if dist_frame is not None:
        args = dist_frame.f_locals
        group_ranks, seq = stack.group_info(args.get("group"))
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
    frames, line = stack.user_frames(frame) if busy else ([], "")
    if not line:
        line = str(_state.get("doing") or "")
        if line:  # a request, not a cell (%dist_sync): its step, not torch's frames
            frames = [f"  {line}"]
    return Place(collective=collective, group_ranks=group_ranks, peer=peer, seq=seq, stack=frames,
                 line=line, busy=busy, store_wait=store_wait, in_code=in_code(), group_seq=group_seq(),
                 in_backward=backward, native=native, cuda_wait=cuda_wait, pending=pending,
                 operands=stack.operands(dist_frame) if dist_frame is not None else [])


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
