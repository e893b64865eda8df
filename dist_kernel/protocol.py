"""Every message that passes between the parent kernel and a rank, besides ordinary Jupyter.

The parent runs cells on a rank with plain Jupyter ``execute_request``s. Everything else it
needs from a rank (join or re-form the process group, "where is the cell?", status, tear the
group down, switch cache freeing or a library integration) is one typed request below,
sent on the rank kernel's **control** channel as a ``dist_request`` message and answered
with one ``dist_reply``. The control channel has its own thread in every ipykernel, so a
rank answers while its shell runs a long cell or is blocked in a C++ collective.

Wire format (the ``content`` of the Jupyter message; HMAC-signed like every Jupyter message)::

    dist_request  {"version": 3, "op": "<op>", "args": {<the request's fields>}}
    dist_reply    {"version": 3, "op": "<op>", "status": "ok",    "result": {<the reply's fields>}}
    dist_reply    {"version": 3, "op": "<op>", "status": "error", "ename": "...", "evalue": "..."}

Both sides validate on receipt (:func:`parse_request`, :func:`parse_reply`): an unknown op,
a missing or extra field, or a field of the wrong type is a :class:`ProtocolError`; the rank
answers it with an error reply and keeps working. Nothing here is code: no field is ever
executed or unpickled. This module imports nothing heavy (the options, for the names of the
rank switches, are the standard library's); both sides import it.

Plain Jupyter messages carry a little of dist_kernel in their metadata, always under one key
(``metadata["dist_kernel"]``, :data:`META`), with the fields declared below (``META_*``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from dist_kernel.options import RANK_SWITCHES

#: 2: ``sync``, ``Join.local_world_size``, ``Place.cuda_wait`` and ``Place.pending`` (issue 29)
#: 3: ``Place.operands`` (issue 36)
VERSION = 3
REQUEST = "dist_request"
REPLY = "dist_reply"


# --------------------------------------------------------------------- metadata
#: dist_kernel's part of a Jupyter message's metadata: ``metadata[META] = {META_...: value}``
META = "dist_kernel"
#: execute_request, parent -> rank: the ranks that run the cell (a list of int), absent when every
#: rank of the world runs it (the request's size does not grow with the rank count); merged
#: output, parent -> frontend: the ranks it stands for
META_RANKS = "ranks"
#: execute_request and forwarded comm messages, parent -> rank: the frontend request's msg_id, the
#: same on every rank (comms a rank opens for it are named after it: see dist_kernel.rank.widgets)
META_CELL = "cell"
#: execute_request, parent -> rank: the cell's source as the frontend sent it, where the code the
#: rank runs differs (a ``%%rank`` line made a comment): the rank names the cell's file after it,
#: the file JupyterLab's debugger dumped the cell to and set its breakpoints in
META_SOURCE = "source"
#: execute_request, parent -> rank: the cell's execution count, the parent's (the frontend's
#: ``[n]``): a rank that a ``%%rank`` cell left out numbers the next cell as the others do, so
#: tracebacks (``Cell In[n]``), ``Out[n]`` and ``_i<n>`` agree with the prompt on every rank
META_COUNT = "count"
#: execute_reply, rank -> parent: how many IOPub messages the cell published before its reply
META_IOPUB = "iopub"
#: execute_reply, rank -> parent: the cell's error broke the process group (true)
META_GROUP_BROKEN = "group_broken"
#: execute_reply, rank -> parent: the cell destroyed the process group (true)
META_GROUP_DESTROYED = "group_destroyed"
#: execute_reply of a failed cell, rank -> parent: the default group's collective sequence number
META_SEQ = "seq"
#: display_data, rank -> parent: this rank's output alone, shown once and unlabelled (true)
META_SOLO = "solo"
#: stream (in its content) and display_data, rank -> parent: made inside a branch on the rank
#: (``if rank == 0:``), so the other ranks may never give its twin: not held for them (true)
META_BRANCH = "branch"
#: merged output, parent -> frontend: the ranks it stands for are :data:`META_RANKS`; a merged
#: display also lists its rank groups here (a list of lists of int)
META_GROUPS = "groups"
#: execute_request, frontend -> parent: the frontend shows ``%dist_top``'s table as a live view
#: although its cells allow no stdin (``python -m dist_kernel run`` on a terminal, which keeps the
#: table out of the notebook it saves) (true)
META_LIVE = "live"


def meta_of(metadata: dict | None) -> dict:
    """dist_kernel's part of a message's metadata ({} when absent or not a dict)."""
    part = (metadata or {}).get(META)
    return part if isinstance(part, dict) else {}


def with_meta(metadata: dict | None, part: dict) -> dict:
    """``metadata`` with dist_kernel's part set to ``part``."""
    return {**(metadata or {}), META: part}


def ranks_from(value: object) -> tuple[int, ...] | None:
    """The ranks of :data:`META_RANKS` in an execute_request; None when absent (every rank of the
    world runs the cell) or malformed."""
    if isinstance(value, list) and value and all(isinstance(r, int) for r in value):
        return tuple(value)
    return None


class ProtocolError(ValueError):
    """A message that does not follow this module (unknown op, bad field)."""


# --------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Request:
    """Base of every request; ``op`` names it on the wire."""

    op: ClassVar[str] = ""


@dataclass(frozen=True)
class Join(Request):
    """Form (or re-form) the process group and define ``rank``, ``world_size``, ``local_rank``,
    ``device`` in the user's namespace. The first formation (``first``) also seeds every rank
    alike and sets the rank switches (``switches``: cache freeing, which ``%dist_empty_cache``
    switches later, and the library integrations, installed when on). Runs on the rank's main
    thread (CUDA's current device is per thread); answered when the group has formed."""

    op: ClassVar[str] = "join"
    rank: int
    world_size: int
    local_rank: int
    backend: str
    #: where the ranks meet, a new one per formation: a FileStore path in the kernel's private
    #: runtime dir (one machine), or ``tcp://HOST:PORT/PREFIX``: rank 0 hosts a TCPStore there
    store: str
    timeout: float  # collective timeout, seconds
    use_cuda: bool
    first: bool
    seed: int | None = None
    #: the first formation: each rank switch on or off (:data:`RANK_SWITCHES`); one left out
    #: takes its option's default (later formations keep what ``set_option`` chose)
    switches: dict[str, bool] = field(default_factory=dict)
    #: the ranks on this rank's node (``LOCAL_WORLD_SIZE``), which ``%dist_ranks`` changes; None: as
    #: the rank's environment says
    local_world_size: int | None = None


@dataclass(frozen=True)
class Where(Request):
    """Where the rank's main thread is: its cell's frames, and the torch.distributed call it
    is blocked in, if any. Read from the control thread, so it answers during a collective."""

    op: ClassVar[str] = "where"


@dataclass(frozen=True)
class Status(Request):
    """What ``%dist_status`` shows for the rank, plus the line its cell is on when busy."""

    op: ClassVar[str] = "status"


@dataclass(frozen=True)
class Teardown(Request):
    """Break the rank's process group, so that every collective on it raises at once: an idle
    rank destroys it; every rank shuts down its connections to ``peer_pids`` (the other
    ranks' processes), which frees its own main thread when it is blocked in one."""

    op: ClassVar[str] = "teardown"
    peer_pids: list[int]
    #: the addresses of other machines that hold peer ranks (pids mean nothing across machines)
    peer_hosts: list[str] | None = None


@dataclass(frozen=True)
class SetOption(Request):
    """Switch a rank-side behaviour at run time: one of :data:`RANK_SWITCHES`, the options
    declared ``rank_switch`` (``empty_cache``, free the CUDA cache after each cell; ``fastai``,
    ``lightning``, ``hf``: those integrations, ``hf`` being accelerate and Transformers)."""

    op: ClassVar[str] = "set_option"
    name: str
    on: bool


@dataclass(frozen=True)
class Sync(Request):
    """``%dist_sync``: copy the user's variables ``names`` from rank ``src`` to every other rank,
    over the process group (every rank of the group gets this request at once, and runs it on its
    main thread). Tensors, numpy arrays and plain data (nested lists, dicts, tuples) go as
    tensors and JSON; a module or optimizer into the one of the same kind the rank already holds
    under that name (its ``state_dict``). Nothing is pickled."""

    op: ClassVar[str] = "sync"
    names: list[str]
    src: int


#: every request, by op
REQUESTS: dict[str, type[Request]] = {c.op: c for c in (Join, Where, Status, Teardown, SetOption, Sync)}


# ---------------------------------------------------------------------- replies
@dataclass(frozen=True)
class Joined:
    """Reply to :class:`Join`."""

    device: str


@dataclass(frozen=True)
class Pending:
    """A collective this rank started that has not completed, as torch's flight recorder holds
    it (NCCL starts collectives asynchronously: the Python thread goes on, and blocks later in a
    CUDA synchronisation). Its output tensors may hold a partial result once the group is aborted."""

    op: str  # the collective: "all_reduce" (the recorder's "nccl:all_reduce" without the backend)
    group: str  # the process group's name ("0" for the default group)
    default: bool  # it is the default group, whose count idle ranks report (``Place.group_seq``)
    group_ranks: list[int]  # the global ranks of its group ([] when the recorder did not say)
    #: the group's collective sequence number of this call (1 for the group's first), as
    #: ``Place.group_seq`` counts them; a point-to-point call's own count when ``p2p``
    seq: int
    p2p: bool
    state: str  # "scheduled" or "started" (NCCL knows "started" only with TORCH_NCCL_ENABLE_TIMING)
    output_sizes: list[list[int]]
    output_dtypes: list[str]  # as the recorder names them: "Float", "BFloat16", ...


@dataclass(frozen=True)
class Operand:
    """A tensor that a rank blocked in a torch.distributed call holds there (an argument, or a
    local the call made of one): what the fault policy compares between ranks blocked in the
    same collective, which needs the same shape and dtype on every rank."""

    name: str  # the argument's name in torch's function ("tensor", "output_tensor")
    dtype: str  # "float32", as torch names it without "torch."
    shape: list[int]


@dataclass(frozen=True)
class Place:
    """Reply to :class:`Where`.

    ``collective`` is the innermost torch.distributed function the main thread is in (None
    when it is not in one); ``group_ranks`` the global ranks of the group it was given (the
    whole world for the default group); ``peer`` the src/dst of a point-to-point call;
    ``seq`` the group's collective sequence number when torch exposes it, so that two ranks
    in "the same" collective can be told apart from two ranks in different ones. ``stack``
    holds the cell's frames, formatted like a traceback; ``line`` the innermost cell line.
    """

    collective: str | None
    group_ranks: list[int]
    peer: int | None
    seq: int | None
    stack: list[str]
    line: str
    busy: bool  # the main thread is running a cell (not idle in the event loop)
    #: it waits in the rendezvous store: group creation (``collective`` is the public call,
    #: ``new_group``), which every rank of the world must enter
    store_wait: bool = False
    #: the cell's own code still runs; False once it has ended (its traceback is being shown,
    #: its reply sent): an interrupted rank in that state has stopped and only reports
    in_code: bool = True
    #: how many collectives the default group has started on this rank, in a collective or
    #: not (None without a group): a busy rank ahead of an idle one started a collective (in
    #: C++, such as DDP's gradient all_reduce) that the idle one never entered
    group_seq: int | None = None
    #: the main thread is in autograd's backward pass (C++), where DDP starts its all_reduce
    in_backward: bool = False
    #: the torch call it is in when that call started a collective in C++, with no
    #: torch.distributed collective on the stack (``collective`` is None): its innermost Python
    #: frame is torch's distributed code, named from the outside in, such as
    #: ``DistributedDataParallel(...) / _verify_param_shape_across_processes /
    #: _verify_params_across_processes``; ``group_ranks`` and ``seq`` are its group's. On NCCL, also
    #: the call that waits on the GPU for a pending collective (``cuda_wait``, with ``pending``):
    #: it is in C++ just as well, and a stop cannot reach it. "" otherwise
    native: str = ""
    #: NCCL only: the call in which the main thread waits for the GPU, a CUDA synchronisation
    #: (``loss.item()``, ``torch.cuda.synchronize()``); "" when it is not in one
    cuda_wait: str = ""
    #: NCCL only: the collectives this rank started that have not completed (the flight recorder's),
    #: read while it is in a CUDA synchronisation; the oldest first
    pending: list[Pending] = field(default_factory=list)
    #: the tensors the torch.distributed call it is blocked in holds (``collective`` set), by name,
    #: dtype and shape; read only when a look is due. [] otherwise
    operands: list[Operand] = field(default_factory=list)


@dataclass(frozen=True)
class RankStatus:
    """Reply to :class:`Status`."""

    pid: int
    host: str
    device: str
    rss_mb: float | None
    empty_cache: bool
    busy: bool
    line: str  # where the cell is, when busy
    cuda_allocated_mb: float | None = None
    cuda_reserved_mb: float | None = None
    group: str = "up"  # the default process group: "up", or "down" (destroyed in a cell)


@dataclass(frozen=True)
class Done:
    """Reply to :class:`Teardown` and :class:`SetOption`: what happened, in words."""

    outcome: str


@dataclass(frozen=True)
class Synced:
    """Reply to :class:`Sync`: per name, what this rank did (``copied``: how, in words) or why
    it could not (``failed``)."""

    copied: dict[str, str]
    failed: dict[str, str]


#: the reply type of each op
REPLIES: dict[str, type] = {"join": Joined, "where": Place, "status": RankStatus,
                            "teardown": Done, "set_option": Done, "sync": Synced}


@dataclass(frozen=True)
class ErrorReply:
    """A request that failed or did not validate."""

    ename: str
    evalue: str


# --------------------------------------------------------------- (de)serialising
def request_content(req: Request) -> dict:
    """The ``dist_request`` content for ``req``."""
    return {"version": VERSION, "op": req.op, "args": dataclasses.asdict(req)}


def reply_content(op: str, result: Any) -> dict:
    """The ``dist_reply`` content for a result (a reply dataclass) or an :class:`ErrorReply`."""
    if isinstance(result, ErrorReply):
        return {"version": VERSION, "op": op, "status": "error", "ename": result.ename, "evalue": result.evalue}
    return {"version": VERSION, "op": op, "status": "ok", "result": dataclasses.asdict(result)}


def parse_request(content: Any) -> Request:
    """Validate a ``dist_request`` content; raises :class:`ProtocolError`."""
    op = _envelope(content, {"version", "op", "args"})
    cls = REQUESTS.get(op)
    if cls is None:
        raise ProtocolError(f"unknown op {op!r}; known: {', '.join(REQUESTS)}")
    req = _build(cls, content["args"])
    names = [req.name] if isinstance(req, SetOption) else list(req.switches) if isinstance(req, Join) else []
    unknown = [n for n in names if n not in RANK_SWITCHES]
    if unknown:
        raise ProtocolError(f"{op}: unknown option {unknown[0]!r}; known: {', '.join(RANK_SWITCHES)}")
    return req


def parse_reply(content: Any, expected_op: str) -> Any:
    """Validate a ``dist_reply`` content: the reply dataclass, or an :class:`ErrorReply`."""
    if not isinstance(content, dict):
        raise ProtocolError("a reply must be a JSON object")
    status = content.get("status")
    if status == "error":
        op = _envelope(content, {"version", "op", "status", "ename", "evalue"})
        return _build(ErrorReply, {"ename": content["ename"], "evalue": content["evalue"]})
    op = _envelope(content, {"version", "op", "status", "result"})
    if status != "ok":
        raise ProtocolError(f"reply status {status!r} is neither ok nor error")
    if op != expected_op:
        raise ProtocolError(f"reply for op {op!r}, expected {expected_op!r}")
    return _build(REPLIES[op], content["result"])


def _envelope(content: Any, keys: set[str]) -> str:
    if not isinstance(content, dict):
        raise ProtocolError("a message must be a JSON object")
    if set(content) != keys:
        raise ProtocolError(f"fields {sorted(content)}; expected {sorted(keys)}")
    if content["version"] != VERSION:
        raise ProtocolError(f"protocol version {content['version']!r}; this side speaks {VERSION}")
    op = content["op"]
    if not isinstance(op, str):
        raise ProtocolError("op must be a string")
    return op


def _build(cls: type, args: Any) -> Any:
    """Instantiate a dataclass from JSON, checking every field's presence and type."""
    if not isinstance(args, dict):
        raise ProtocolError(f"{cls.__name__}: fields must be a JSON object")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(args) - set(fields)
    if extra:
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {sorted(extra)}")
    values = {}
    for name, f in fields.items():
        if name not in args:
            if f.default is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            continue
        if not _is(args[name], hints[name]):
            raise ProtocolError(f"{cls.__name__}.{name}: {args[name]!r} is not {_name(hints[name])}")
        values[name] = _nested(args[name], hints[name])
    return cls(**values)


def _nested(value: Any, hint: Any) -> Any:
    """A JSON value with the reply dataclasses it holds built (a list of :class:`Pending`)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return [_nested(v, item) for v in value]
    return value


def _is(value: Any, hint: Any) -> bool:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # its fields are checked as it is built (_nested)
        return isinstance(value, dict)
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_is(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_is(k, key) and _is(v, item) for k, v in value.items())
    if hint is float:  # JSON has one number type
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
