"""Requests that need the user's namespace but not every rank: completion, inspection,
``is_complete_request`` and ``history_request``, answered by one rank.

That rank is the first one a ``%%rank`` line in the code names, else rank 0; without a live
rank the parent answers as a kernel that knows nothing would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dist_kernel.exceptions import RankSpecError
from dist_kernel.parent.selection import plan_cell

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks


async def ask_one_rank(ranks: Ranks, msg_type: str, content: dict, fallback: dict) -> dict:
    """``msg_type`` with ``content``, answered by the rank the code names (see the module doc);
    ``fallback`` when no live rank answers.

    The ``%%rank`` line is blanked to the same length, so cursor offsets stay valid.
    """
    if not ranks.ready.is_set() or ranks.start_error:
        return fallback
    rank = 0
    if "code" in content:
        try:
            plan = plan_cell(content["code"], ranks.config.world_size)
            rank, content = plan.ranks[0], dict(content, code=plan.code)
        except RankSpecError:
            pass
    try:
        return await ranks.shell_request(rank, msg_type, content)
    except Exception:  # noqa: BLE001 - a dead or busy rank: answer without it
        return fallback


class OneRankRequests:
    """The kernel's handlers of these requests (ipykernel's ``do_*`` names), for
    :class:`~dist_kernel.parent.kernel.DistributedKernel`."""

    ranks: Ranks | None

    async def _ask_rank(self, msg_type: str, content: dict, fallback: dict) -> dict:
        if self.ranks is None:
            return fallback
        return await ask_one_rank(self.ranks, msg_type, content, fallback)

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
