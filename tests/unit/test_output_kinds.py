"""The one table of output kinds (issue 37, ``dist_kernel/output_kinds.py``): complete, every row
and every value of it used as it says, and the only place that names an output kind in a check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dist_kernel.lab.displays import CellDisplays, Place
from dist_kernel.output_kinds import IN_ORDER, KINDS, ROWS, Budget, Merge, OutputKind, Route, Shows, Text
from dist_kernel.parent.relay import Outlet, OutputRelay
from dist_kernel.parent.throttle import OutputBudget, StreamThrottle
from dist_kernel.text_output import TextOutput

PACKAGE = Path(__file__).parents[2] / "dist_kernel"

#: the IOPub message types of the Jupyter messaging protocol (5.4: "Messages on the IOPub
#: (PUB/SUB) channel", and "Custom Messages" for comms)
IOPUB_TYPES = {"stream", "display_data", "update_display_data", "execute_input", "execute_result", "error",
               "status", "clear_output", "debug_event", "comm_open", "comm_msg", "comm_close"}
#: what the parent does not relay as output, and why
NO_OUTPUT = {
    "status": "the relay reads a rank's idle from it (a rank's part of the request is over)",
    "execute_input": "ranks send none; the parent publishes the frontend's own",
    "debug_event": "the debugger's (parent/debugger.py), on one rank's control channel",
}

#: a content of each output kind, as a rank sends it
CONTENT = {
    "stream": {"name": "stdout", "text": "hello\n"},
    "display_data": {"data": {"text/plain": "shown"}, "metadata": {}},
    "execute_result": {"data": {"text/plain": "42"}, "metadata": {}, "execution_count": 7},
    "update_display_data": {"data": {"text/plain": "new"}, "metadata": {}, "transient": {"display_id": "d"}},
    "clear_output": {"wait": False},
    "error": {"ename": "ValueError", "evalue": "boom", "traceback": ["ValueError: boom"]},
    "comm_open": {"comm_id": "c", "target_name": "t", "data": {}},
    "comm_msg": {"comm_id": "c", "data": {"method": "update", "state": {"value": 1}}},
    "comm_close": {"comm_id": "c", "data": {}},
}


def _msg(msg_type: str, content: dict) -> dict:
    return {"header": {"msg_type": msg_type}, "content": content}


def _name(kind: OutputKind) -> str:
    return kind.name


def test_every_iopub_type_of_the_protocol_is_a_row_or_named_as_no_output():
    relayed = {k.name for k in ROWS if k.route is not Route.IN_ORDER}
    assert relayed | NO_OUTPUT.keys() == IOPUB_TYPES
    assert not relayed & NO_OUTPUT.keys()
    assert len(KINDS) == len(ROWS)  # one row per kind
    assert set(CONTENT) == relayed


@pytest.mark.parametrize("column", [Route, Merge, Shows, Budget, Text])
def test_every_value_of_every_column_is_some_rows(column):
    """A value no row has is dead code where its column is read."""
    field = {Route: "route", Merge: "merge", Shows: "shows", Budget: "budget", Text: "text"}[column]
    assert {getattr(k, field) for k in ROWS} == set(column)


@pytest.mark.parametrize("kind", [k for k in ROWS if k.route is not Route.IN_ORDER], ids=_name)
def test_each_kind_goes_where_its_route_says(kind):
    """Every row is used: a rank's message of each kind, through the relay of a two-rank cell,
    reaches the frontend as an output (merged: once for both ranks), or the comm router."""
    published: list[tuple[str, dict]] = []
    comms: list[tuple[int, dict]] = []
    relay = OutputRelay([0, 1], Outlet(lambda t, c: published.append((t, c)),
                                       relay_comm=lambda r, m: comms.append((r, m))), 3, window=0.05)
    for rank in (0, 1):
        relay.on_iopub(rank, _msg(kind.name, CONTENT[kind.name]))
        relay.on_reply(rank, {"status": "ok"})
    relay.close()
    if kind.route is Route.OUTPUT:
        assert [t for t, _ in published] == [kind.name] and not comms
        if kind.numbered:  # the parent's execution count, not the rank's
            assert published[0][1]["execution_count"] == 3
    else:
        assert not published and [m["header"]["msg_type"] for _, m in comms] == [kind.name] * 2


def test_a_capture_change_keeps_its_place_among_the_outputs():
    """The IN_ORDER row: a ``comm_msg`` (``capture``) that starts an Output widget's capture goes
    through the merger, after what the rank printed before it, and out to the comm router."""
    order: list[str] = []
    relay = OutputRelay([0], Outlet(lambda t, c: order.append(t), relay_comm=lambda r, m: order.append("comm")),
                        1, window=0.05)
    relay.on_iopub(0, _msg("stream", {"name": "stdout", "text": "before"}))  # an unfinished line
    change = {"comm_id": "out", "data": {"method": "update", "state": {"msg_id": "cell"}}}
    assert [k.name for k in ROWS if k.capture] == ["comm_msg"]
    relay.on_iopub(0, _msg("comm_msg", change))
    relay.on_reply(0, {"status": "ok"})
    relay.close()
    assert order == ["stream", "comm"]


@pytest.mark.parametrize("kind", ROWS, ids=_name)
def test_the_budget_counts_each_kind_as_its_row_says(kind, tmp_path):
    """Past the budget (none left), what a row's ``budget`` says: always sent, or not counted, or
    spilled (a clear is not written to the file)."""
    shown: list[tuple[str, dict]] = []
    budget = OutputBudget(rate=0, burst=0, msg_rate=0, msg_burst=0, clock=lambda: 0.0, spill_dir=str(tmp_path))
    throttle = StreamThrottle(lambda t, c: shown.append((t, c)), budget=budget)
    content = CONTENT.get(kind.name, {})
    throttle.publish(kind.name, content)
    sent = (kind.name, content) in shown
    assert sent == (kind.budget in (Budget.ALWAYS, Budget.FREE))
    if kind.budget is Budget.FREE:
        assert shown == [(kind.name, content)]  # not counted: no notice of a spill
    elif not sent:
        assert throttle.spilling
        throttle.close()  # the cell ends: the file is complete
        written = open(throttle.spill_path or "").read()
        assert bool(written) == (kind.budget is not Budget.CLEAR)


@pytest.mark.parametrize("kind", ROWS, ids=_name)
def test_the_text_renderer_writes_each_kind_as_its_row_says(kind):
    text = TextOutput(clock=lambda: 100.0)
    written = "".join(t for _, t in text.feed(kind.name, CONTENT.get(kind.name, {})) + text.finish())
    assert bool(written) == (kind.text is not Text.NONE)
    if kind.text is Text.TRACEBACK:
        assert written == "ValueError: boom\n"


@pytest.mark.parametrize("kind", ROWS, ids=_name)
def test_the_lab_keeps_each_kind_as_its_row_says(kind):
    """What a page would do with it, for the server that writes outputs (``lab/displays.py``)."""
    displays = CellDisplays()
    displays.remember("d", Place(0, 0))  # a display this cell showed
    step = displays.step(kind.name, CONTENT.get(kind.name, {}))
    assert (step.replace is not None) == (kind.shows is Shows.UPDATE)
    assert step.forward == (kind.shows is not Shows.UPDATE)
    assert (displays.where("d") == []) == (kind.shows is Shows.CLEAR)


def test_the_rows_are_frozen_and_carry_no_state():
    """The merger keeps a row on each item: a row is a constant, never made per message."""
    with pytest.raises(AttributeError):
        KINDS["stream"].merge = Merge.RICH  # type: ignore[misc]
    assert not hasattr(OutputKind("x", Route.OUTPUT, Merge.RICH, Shows.ADD, Budget.MESSAGE, Text.PLAIN), "__dict__")
    assert KINDS[IN_ORDER].route is Route.IN_ORDER


# ------------------------------------------------------------------ one home
#: outputs a module may name in a check: only the table's own
_OUTPUT_NAMES = {k.name for k in ROWS if k.route is Route.OUTPUT}
#: the ranks and the stub ranks make outputs of each kind; the table is how the parent handles them
_MAKERS = ("rank", "testing")


def _names_outputs(node: ast.expr) -> bool:
    """A string that is an output kind's name, or a literal collection holding one."""
    if isinstance(node, ast.Constant):
        return node.value in _OUTPUT_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in _OUTPUT_NAMES for e in node.elts)
    return False


def _is_message_type(node: ast.expr) -> bool:
    """An expression that holds a message type: ``msg_type``, ``msg["msg_type"]``, ``item.kind``."""
    source = ast.unparse(node)
    return "msg_type" in source or (isinstance(node, ast.Attribute) and node.attr == "kind")


def _checks(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for a, b in zip(sides, sides[1:], strict=False):
                if (_names_outputs(a) and _is_message_type(b)) or (_names_outputs(b) and _is_message_type(a)):
                    found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            named = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in _OUTPUT_NAMES]
            if len(named) > 1:  # a list of kinds of its own (OUTPUT_TYPES, RICH_TYPES, THROTTLED, ...)
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_but_the_table_checks_a_message_type_against_an_output_kind():
    """A new kind, or a change of how one is handled, is made in the table alone: no module of the
    parent or the CLI tests ``msg_type`` against an output kind's name, or lists kinds of its own."""
    own = PACKAGE / "output_kinds.py"
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if path != own and path.relative_to(PACKAGE).parts[0] not in _MAKERS
             for line, text in _checks(ast.parse(path.read_text()))]
    assert found == []


def test_the_check_finds_what_it_looks_for():
    """The scan above is not blind: the checks this table replaced are found."""
    before = """
if msg_type == "stream": pass
if msg_type not in OUTPUT_TYPES or msg_type == "execute_result": pass
if item.kind in ("display_data", "execute_result"): pass
RICH_TYPES = ("display_data", "execute_result", "update_display_data")
if reply.get("status") == "error": pass
"""
    assert sorted(line for line, _ in _checks(ast.parse(before))) == [2, 3, 4, 4, 5]  # 4: its check and its list
