"""The one table of the IOPub message kinds the parent relays from the ranks (issue 37): for each,
where it goes, how the merger keys and merges it, what it does to a cell's outputs, how the output
budget counts it, and how it is written as text. The relay, the merger and its renderer, the
budget, the comm router, the capture answers, the text renderer (``run``'s terminal, the output
log), the runner and the lab's output keeper read a kind's row (:data:`KINDS`) instead of testing
``msg_type`` themselves.

=========================  ========  =====  ======  =======  =========  ===========
kind                       route     merge  shows   budget   text       besides
=========================  ========  =====  ======  =======  =========  ===========
``stream``                 output    lines  add     text     stream
``display_data``           output    rich   add     message  plain
``execute_result``         output    rich   add     always   plain      ``numbered``
``update_display_data``    output    rich   update  message  frame
``clear_output``           output    clear  clear   clear    none
``error``                  output    error  add     always   traceback
``comm_open``              comm      none   none    free     none
``comm_msg``               comm      none   none    free     none       ``capture``
``comm_close``             comm      none   none    free     none
:data:`IN_ORDER`           in order  none   none    free     none
=========================  ========  =====  ======  =======  =========  ===========

What each value means is its enum member's comment, which names the code that does it. Anything
not in the table (``status``, ``execute_input``, ``debug_event``) is no output: the relay reads a
rank's ``idle`` from its ``status`` itself.

**Comm messages** (widgets) are never merged: the comm router (``parent/comms.py``) relays the
leading owner's to the frontend, and keeps which ranks own each comm (its ``comm_open`` and
``comm_close``). One of them meets the outputs: a ``comm_msg`` that starts or stops an ipywidgets
``Output`` capture (``capture``) goes through the merger as an :data:`IN_ORDER` item, in its place
among the rank's outputs, and out again to the comm router.

**To add a kind**, add a row, picking each column's value among those that exist: the relay, the
merger, the renderer, the budget and the text renderer then handle it as they handle the kinds that
share those values. Only a kind that needs a new *value* (a new way of merging, of counting) adds a
member to that column's enum, and its case where that column is read (the member's comment names
the place). ``tests/unit/test_output_kinds.py`` holds the table complete: every IOPub type of the
Jupyter protocol is a row or named as no output, every value is some row's and does what its
comment says, and no module but this one checks a message type against an output kind's name.

Hot paths read the table once per message (``KINDS[msg_type] if msg_type in KINDS else None``: no
method call, fewer instructions than the checks it replaced, where ``KINDS.get`` costs more), and
the merger keeps the row on each item (``Item.kind``): no object is made per message. They compare
a column with the members bound to module globals (``_RICH = Merge.RICH``): a member read off its
enum class costs five times a string comparison, a global less than one. The merger's most
frequent question, whether an item is stream text, is a field of the row (``lines``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Route(Enum):
    """Where the parent sends a rank's message of the kind (``parent/relay.py``)."""

    OUTPUT = "output"  # a cell's output: merged across the ranks (``merge``), published under the budget
    COMM = "comm"  # a widget's comm message: relayed by the comm router (parent/comms.py), never merged
    IN_ORDER = "in order"  # a comm message the merger keeps in its place among a rank's outputs


class Merge(Enum):
    """How the merger (``parent/merge``) cuts the kind into items, keys twins (items that are the
    same on several ranks, published once) and marks what only some ranks gave (labelled)."""

    #: cut into lines (and ``\\r`` states: progress bars, ``merge/bars.py``) per stream name, made
    #: as items of the ``stream`` row (:data:`STREAM`); twins have the same stream and text (a
    #: progress state: its ``units.progress_key``); a line of some ranks is labelled line by line;
    #: consecutive text of one stream is published as one message
    LINES = "lines"
    #: one item; twins have the same kind, display id, data and metadata (``units.content_key``);
    #: a display id makes every rank's content one display (``rendering.DisplayRegistry``);
    #: output policy ``rank0`` keeps one rank's only; labelled in its text/plain and HTML
    RICH = "rich"
    #: one item, held until its rank's reply says whether it is the cell's error, which is shown
    #: once for the ranks at the cell's end (``merge/errors.py``); the others are outputs, twins
    #: by ``errors.error_key``, labelled in their traceback
    ERROR = "error"
    #: one item, twins by ``wait``; every rank clearing at one point is one clear, a rank that
    #: clears alone moves its output to areas (displays updated in place, ``rendering._to_area``)
    CLEAR = "clear"
    #: not merged (comm messages; an in-order item is published as it is, in its place)
    NONE = "none"


class Shows(Enum):
    """What the kind does to a cell's outputs in a frontend: how the renderer draws it (an area
    takes only an added output), what a spill keeps, and what the lab's output keeper does
    (``lab/displays.py``)."""

    ADD = "add"  # adds an output; a rich one with a display id can be updated later
    UPDATE = "update"  # replaces the outputs of its display id, wherever they are; adds none
    CLEAR = "clear"  # clears the cell's outputs (with ``wait``: at its next output)
    NONE = "none"  # not an output


class Budget(Enum):
    """How the kernel's output budget (``parent/throttle.py``) counts the kind, and what a spill
    (output past the budget goes to a file) keeps of it."""

    #: bytes per second and a message per piece (at most ``throttle.MAX_MESSAGE``); spilled as it
    #: is, its last lines kept and shown when the spill ends
    TEXT = "text"
    #: one message; spilled as its text/plain (an update's newest state is shown when the spill ends)
    MESSAGE = "message"
    #: one message; spilled, it is not written, and drops the last lines kept so far (a frontend
    #: would show only what follows it)
    CLEAR = "clear"
    #: one message, never held back (the user asked for it): past the budget it waits for the
    #: spill's end, written to the file in its place
    ALWAYS = "always"
    #: not cell output: not counted
    FREE = "free"


class Text(Enum):
    """How the kind is written as text, appended to a terminal or the output log (``text_output.py``)."""

    STREAM = "stream"  # its text as it is; a line rewritten with '\r' as a line every few seconds
    PLAIN = "plain"  # its text/plain on lines of its own (spilled: the same)
    FRAME = "frame"  # the newest frame of a display already shown, written every few seconds
    TRACEBACK = "traceback"  # its traceback without colours, on stderr (spilled: ename and evalue)
    NONE = "none"  # nothing: a clear erases nothing already written (the output log leaves it out)


#: the merger's name for a comm message it keeps in its place among a rank's outputs
IN_ORDER = "dist_kernel.in_order"


@dataclass(frozen=True, slots=True)
class OutputKind:
    """One row of the table: an IOPub message type and how the parent handles it (see the module doc)."""

    name: str  # the IOPub msg_type
    route: Route
    merge: Merge
    shows: Shows
    budget: Budget
    text: Text
    numbered: bool = False  # carries the cell's execution count: the parent's, not the rank's
    capture: bool = False  # may start or stop an ipywidgets Output capture (then it is kept in order)
    #: ``merge is Merge.LINES``, kept as a field: the merger asks it of every item, several times
    #: (one attribute read, cheaper than the string comparison it replaced)
    lines: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lines", self.merge is Merge.LINES)


def _comm(name: str, route: Route = Route.COMM, capture: bool = False) -> OutputKind:
    return OutputKind(name, route, Merge.NONE, Shows.NONE, Budget.FREE, Text.NONE, capture=capture)


_OUTPUT = Route.OUTPUT

#: the table, in the order the module doc lists it
ROWS: tuple[OutputKind, ...] = (
    OutputKind("stream", _OUTPUT, Merge.LINES, Shows.ADD, Budget.TEXT, Text.STREAM),
    OutputKind("display_data", _OUTPUT, Merge.RICH, Shows.ADD, Budget.MESSAGE, Text.PLAIN),
    OutputKind("execute_result", _OUTPUT, Merge.RICH, Shows.ADD, Budget.ALWAYS, Text.PLAIN, numbered=True),
    OutputKind("update_display_data", _OUTPUT, Merge.RICH, Shows.UPDATE, Budget.MESSAGE, Text.FRAME),
    OutputKind("clear_output", _OUTPUT, Merge.CLEAR, Shows.CLEAR, Budget.CLEAR, Text.NONE),
    OutputKind("error", _OUTPUT, Merge.ERROR, Shows.ADD, Budget.ALWAYS, Text.TRACEBACK),
    _comm("comm_open"),
    _comm("comm_msg", capture=True),
    _comm("comm_close"),
    _comm(IN_ORDER, Route.IN_ORDER),
)

#: msg_type -> its row; ``KINDS.get(msg_type)`` is None for a message that is no output
KINDS: dict[str, OutputKind] = {k.name: k for k in ROWS}
#: the comm message types, which the parent's kernel also answers from the frontend (shell)
COMM_TYPES: tuple[str, ...] = tuple(k.name for k in ROWS if k.route is Route.COMM)
#: the row the merger makes its line items of (:data:`Merge.LINES`)
STREAM = KINDS["stream"]
