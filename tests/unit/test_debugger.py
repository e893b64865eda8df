"""JupyterLab's debugger on one rank (parent/debugger.py): ``%dist_debug``'s argument, which rank
a debug request reaches, what reaches the frontend, the session moved to another rank, and the
fault policy waiting while the debugged rank is stopped at a breakpoint (rule 7). The real DAP
sequence runs in tests/kernel/test_debugger.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dist_kernel.exceptions import UsageError
from dist_kernel.kernelspec import kernel_json
from dist_kernel.parent import debugger, magics
from dist_kernel.parent.debugger import DebugSession, parse_dist_debug
from dist_kernel.parent.fault_policy import Cell, Judge, look_due
from dist_kernel.protocol import Place


# ------------------------------------------------------------------ %dist_debug
@pytest.mark.parametrize(("arg", "choice"), [("", "show"), ("  ", "show"), ("off", "off"), ("OFF", "off"),
                                             ("on", 0), ("0", 0), ("1", 1), ("3  # the odd one", 3)])
def test_dist_debug_reads_a_rank_off_or_nothing(arg, choice):
    assert parse_dist_debug(arg, 4) == choice


@pytest.mark.parametrize(("arg", "says"), [("4", "rank 4 does not exist"), ("-1", "use `%dist_debug N`"),
                                           ("1,2", "use `%dist_debug N`"), ("１", "use `%dist_debug N`"),
                                           ("rank 1", "use `%dist_debug N`")])
def test_dist_debug_refuses_what_is_not_one_rank(arg, says):
    with pytest.raises(ValueError, match=says.replace("`", ".").replace("%", ".")):
        parse_dist_debug(arg, 4)


def test_dist_debug_is_a_parent_magic():
    calls, rest = magics.split("%dist_debug 1\n")
    assert calls == [("dist_debug", "1")] and not rest.strip()


def dist_debug(dbg: DebugSession, ranks, arg: str) -> list[str]:
    """``%dist_debug ARG`` as the kernel runs it; what it said."""
    said: list[str] = []
    asyncio.run(debugger.dist_debug(SimpleNamespace(ranks=ranks, debug=dbg, say=said.append), arg))
    return said


def test_the_kernelspec_announces_the_debugger_where_debugpy_is_there():
    assert kernel_json([])["metadata"]["debugger"] is True  # ipykernel depends on debugpy


# ------------------------------------------------------------------ the session
class Ranks:
    """The seam, as far as the debugger uses it: each control request recorded and answered."""

    def __init__(self, world_size: int = 2) -> None:
        self.config = SimpleNamespace(world_size=world_size)
        self.ready = asyncio.Event()
        self.ready.set()
        self.start_error = None
        self.dead: set[int] = set()
        self.sent: list[tuple[int, str]] = []  # (rank, DAP command)
        self.pids = {r: 1000 + r for r in range(world_size)}  # a respawn gives a rank a new one

    def alive(self, rank: int) -> bool:
        return rank not in self.dead

    def pid(self, rank: int) -> int:
        return self.pids[rank]

    async def shell_request(self, rank, msg_type, content, timeout=10.0, channel="shell"):
        assert msg_type == "debug_request" and channel == "control"
        self.sent.append((rank, content["command"]))
        self.last = content
        return {"type": "response", "success": True, "command": content["command"], "body": {"rank": rank}}


def request(command: str, **arguments) -> dict:
    return {"header": {"msg_id": f"front-{command}"}, "content": {"type": "request", "seq": 1, "command": command,
                                                                    "arguments": arguments}}


def session() -> tuple[DebugSession, list, list]:
    published: list = []
    stopped: list = []
    return DebugSession(lambda p, t, c: published.append((p["header"]["msg_id"], t, c)), stopped.append), \
        published, stopped


def test_a_debug_request_reaches_rank_0_and_its_reply_comes_back():
    dbg, _, _ = session()
    ranks = Ranks()
    reply = asyncio.run(dbg.request(ranks, request("initialize")))
    assert reply["body"] == {"rank": 0} and ranks.sent == [(0, "initialize")]


def test_a_disconnect_never_ends_the_ranks_process():
    dbg, _, _ = session()
    ranks = Ranks()
    asyncio.run(dbg.request(ranks, request("disconnect", restart=False, terminateDebuggee=True)))
    assert ranks.last["arguments"]["terminateDebuggee"] is False


def test_with_the_debugger_off_a_request_fails_in_words():
    dbg, _, _ = session()
    dbg.rank = None
    ranks = Ranks()
    reply = asyncio.run(dbg.request(ranks, request("initialize")))
    assert not reply["success"] and "%dist_debug 0" in reply["message"] and ranks.sent == []


def test_while_the_ranks_start_debug_info_says_not_started_without_waiting():
    dbg, _, _ = session()
    ranks = Ranks()
    ranks.ready.clear()
    reply = asyncio.run(dbg.request(ranks, request("debugInfo")))
    assert reply["success"] and reply["body"]["isStarted"] is False and ranks.sent == []
    assert reply["body"]["tmpFilePrefix"].endswith(f"ipykernel_{__import__('os').getpid()}/")
    assert not asyncio.run(dbg.request(ranks, request("attach")))["success"]


def test_the_debugged_ranks_events_reach_the_frontend_as_they_are_and_the_others_do_not():
    dbg, published, stopped = session()
    ranks = Ranks()
    asyncio.run(dbg.request(ranks, request("attach")))
    route = dbg.routing(lambda rank, msg: published.append(("other", rank, msg)))
    event = {"seq": 7, "type": "event", "event": "stopped", "body": {"reason": "breakpoint", "threadId": 1}}
    route(1, {"header": {"msg_type": "debug_event"}, "content": event})  # not the debugged rank
    assert published == [] and dbg.stopped_ranks() == ()
    route(0, {"header": {"msg_type": "debug_event"}, "content": event})
    assert published == [("front-attach", "debug_event", event)]  # under the frontend's request
    assert dbg.stopped_ranks() == (0,) and stopped == [0]
    route(0, {"header": {"msg_type": "debug_event"},
              "content": {"event": "continued", "body": {"threadId": 1, "allThreadsContinued": True}}})
    assert dbg.stopped_ranks() == ()
    comm = {"header": {"msg_type": "comm_msg"}, "content": {}}
    route(0, comm)
    assert published[-1] == ("other", 0, comm)


def test_dist_debug_moves_the_session_to_the_new_rank():
    dbg, published, _ = session()
    ranks = Ranks()
    for command, args in (("initialize", {}), ("attach", {}), ("setBreakpoints", {"source": {"path": "/c.py"}}),
                          ("configurationDone", {})):
        asyncio.run(dbg.request(ranks, request(command, **args)))
    ranks.sent.clear()
    assert dist_debug(dbg, ranks, "1") == ["debugger: rank 1\n"]
    assert ranks.sent == [(0, "disconnect"), (1, "initialize"), (1, "attach"), (1, "setBreakpoints"),
                          (1, "configurationDone")]
    ranks.sent.clear()
    dist_debug(dbg, ranks, "off")
    assert ranks.sent == [(1, "disconnect")] and not dbg.active
    with pytest.raises(UsageError, match="rank 2 does not exist"):
        dist_debug(dbg, ranks, "2")


def test_shutdown_ends_the_session_and_lets_a_stopped_rank_go_on():
    dbg, _, _ = session()
    ranks = Ranks()
    asyncio.run(dbg.request(ranks, request("initialize")))
    dbg.on_event(0, {"event": "stopped", "body": {"threadId": 1}})
    ranks.sent.clear()
    asyncio.run(dbg.end(ranks))
    assert ranks.sent == [(0, "continue"), (0, "disconnect")] and not dbg.active and dbg.stopped_ranks() == ()


# ------------------------------------------------------------------ the debugged rank replaced (issue 36)
SESSION = (("initialize", {}), ("attach", {}), ("setBreakpoints", {"source": {"path": "/c.py"}}),
           ("configurationDone", {}))


def _started(dbg: DebugSession, ranks: Ranks) -> None:
    for command, args in SESSION:
        asyncio.run(dbg.request(ranks, request(command, **args)))
    ranks.sent.clear()


def test_a_debugged_rank_that_dies_at_a_breakpoint_is_stopped_no_longer():
    dbg, published, _ = session()
    ranks = Ranks()
    dbg.rank = 1
    _started(dbg, ranks)
    dbg.on_event(1, {"event": "stopped", "body": {"reason": "breakpoint", "threadId": 7}})
    assert dbg.stopped_ranks() == (1,) and "stopped at a breakpoint" in dbg.describe()
    dbg.rank_died(0)  # another rank: nothing changes
    assert dbg.stopped_ranks() == (1,)
    dbg.rank_died(1)
    # the hang checks must not wait for a dead rank's breakpoint; the frontend's thread goes on
    assert dbg.stopped_ranks() == () and dbg.describe() == "debugger: rank 1\n"
    assert published[-1][1:] == ("debug_event", {"seq": 0, "type": "event", "event": "continued",
                                                 "body": {"threadId": 7, "allThreadsContinued": True}})


def test_the_session_is_set_up_again_on_the_process_that_took_the_debugged_ranks_place():
    dbg, _, _ = session()
    ranks = Ranks()
    dbg.rank = 1
    _started(dbg, ranks)
    ranks.pids[1] = 2001  # %dist_respawn, or %dist_ranks 1 then 2
    reply = asyncio.run(dbg.request(ranks, request("dumpCell", code="x = 1")))
    assert reply["success"]
    assert ranks.sent == [(1, "initialize"), (1, "attach"), (1, "setBreakpoints"), (1, "configurationDone"),
                          (1, "dumpCell")]
    ranks.sent.clear()
    asyncio.run(dbg.follow(ranks))  # set up once: nothing more
    assert ranks.sent == []


def test_before_a_cell_or_at_dist_debug_the_replaced_rank_gets_the_session_back():
    dbg, _, _ = session()
    ranks = Ranks()
    dbg.rank = 1
    _started(dbg, ranks)
    ranks.pids[1] = 2001
    assert dist_debug(dbg, ranks, "1") == ["debugger: rank 1\n"]
    assert ranks.sent == [(1, "initialize"), (1, "attach"), (1, "setBreakpoints"), (1, "configurationDone")]


def test_nothing_is_asked_of_a_process_that_never_had_the_session():
    # %dist_debug off, or another rank, after the debugged rank was replaced: no continue and no
    # disconnect to the new process (its debugger never started: each waited out the timeout)
    dbg, _, _ = session()
    ranks = Ranks()
    dbg.rank = 1
    _started(dbg, ranks)
    dbg.on_event(1, {"event": "stopped", "body": {"threadId": 1}})
    dbg.rank_died(1)
    ranks.pids[1] = 2001
    dist_debug(dbg, ranks, "0")
    assert ranks.sent == [(0, "initialize"), (0, "attach"), (0, "setBreakpoints"), (0, "configurationDone")]
    ranks.sent.clear()
    ranks.pids[0] = 2000
    dist_debug(dbg, ranks, "off")
    assert ranks.sent == [] and not dbg.active


def test_the_frontends_disconnect_for_a_replaced_process_is_answered_without_it():
    dbg, _, _ = session()
    ranks = Ranks()
    _started(dbg, ranks)
    ranks.pids[0] = 2000
    reply = asyncio.run(dbg.request(ranks, request("disconnect", restart=False, terminateDebuggee=False)))
    assert reply["success"] and ranks.sent == [] and not dbg.active


# ------------------------------------------------------------------ fault policy, rule 7
def _cell(**kw) -> Cell:
    return Cell(**{**dict(ranks=(0, 1), world=(0, 1), busy=(0,), started=0.0, first_finished=1.0,
                          hang_grace=10.0), **kw})


BLOCKED = Place(collective="all_reduce", group_ranks=[0, 1], peer=None, seq=5, stack=[], line="line 2", busy=True)


def test_nothing_is_looked_at_or_torn_down_while_the_debugged_rank_is_stopped_at_a_breakpoint():
    assert look_due(_cell(), now=60.0, last_look=None)
    assert Judge().judge(_cell(), {0: BLOCKED}, now=60.0).action == "teardown"
    assert not look_due(_cell(debug_stopped=(0,)), now=60.0, last_look=None)
    assert Judge().judge(_cell(debug_stopped=(0,)), {0: BLOCKED}, now=60.0).action == "wait"


def test_a_dead_rank_or_the_stop_button_are_acted_on_even_at_a_breakpoint():
    dead = _cell(ranks=(0, 1, 2), world=(0, 1, 2), busy=(0, 1), dead=(2,), debug_stopped=(0,))
    assert look_due(dead, now=60.0, last_look=None)
    assert Judge().judge(dead, {0: BLOCKED, 1: BLOCKED}, now=60.0).action == "teardown"
    stop = _cell(interrupted_at=50.0, debug_stopped=(0,))
    assert look_due(stop, now=60.0, last_look=None)
    assert Judge().judge(stop, {0: BLOCKED}, now=60.0).action != "wait"
