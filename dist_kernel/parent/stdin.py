"""input() on N ranks: one prompt in the frontend, the answer to every rank that asked.

Ranks run the same code, so the k-th ``input()`` of every rank is the same question: the
first rank to ask it opens the prompt; all ranks asking it get that one answer.
:class:`RankInput` is the kernel's side: a mixin of
:class:`~dist_kernel.parent.kernel.DistributedKernel`.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ipykernel.kernelbase import Kernel

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks

Ask = Callable[[str, bool], Awaitable[str]]  # (prompt, password) -> answer from the frontend
Reply = Callable[[int, str], None]  # (rank, answer) -> send input_reply to that rank


class InputBroker:
    """Matches the ranks' input requests of one cell to prompts in the frontend."""

    def __init__(self, ask: Ask, reply: Reply) -> None:
        self.ask = ask
        self.reply = reply
        self.answers: list[str] = []
        self._count: dict[int, int] = defaultdict(int)
        self._waiting: dict[int, list[int]] = defaultdict(list)
        self._asking: set[int] = set()
        self.tasks: list[asyncio.Task] = []

    def on_request(self, rank: int, prompt: str, password: bool = False) -> None:
        k = self._count[rank]
        self._count[rank] += 1
        if k < len(self.answers):
            self.reply(rank, self.answers[k])
            return
        self._waiting[k].append(rank)
        if k not in self._asking:
            self._asking.add(k)
            self.tasks.append(asyncio.ensure_future(self._prompt(k, prompt, password)))

    async def _prompt(self, k: int, prompt: str, password: bool) -> None:
        try:
            value = await self.ask(prompt, password)
        except Exception:  # noqa: BLE001 - the frontend went away: unblock the ranks
            value = ""
        while len(self.answers) <= k:
            self.answers.append(value)
        for rank in self._waiting.pop(k, []):
            self.reply(rank, value)


class RankInput(Kernel):
    """The kernel's hooks: a cell that allows ``input()`` gets a broker (:meth:`_input_for`), and
    the ranks' input requests reach it (:meth:`on_rank_stdin`)."""

    ranks: Ranks | None  # the kernel's
    _stdin: InputBroker | None = None  # the running cell's

    def _input_for(self, parent: dict, allow_stdin: bool) -> None:
        """The broker of the cell that answers ``parent`` (none unless it allows ``input()``)."""
        # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
        ident = self._get_shell_context_var(self._shell_parent_ident)
        ranks = self.ranks
        self._stdin = InputBroker(lambda prompt, pw: self._ask_frontend(prompt, pw, ident, parent),
                                  ranks.reply_input) if allow_stdin and ranks is not None else None

    def on_rank_stdin(self, rank: int, msg: dict) -> None:
        """A rank asks for ``input()``."""
        broker = self._stdin
        content = msg["content"]
        if broker is None:  # not allowed: ipykernel would not have asked; answer empty
            if self.ranks is not None:
                self.ranks.reply_input(rank, "")
            return
        broker.on_request(rank, content.get("prompt", ""), bool(content.get("password")))

    async def _ask_frontend(self, prompt: str, password: bool, ident: Any, parent: dict) -> str:
        """One input_request to the frontend, answered off the event loop (the base call blocks)."""
        loop = asyncio.get_running_loop()
        # _input_request: private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
        return await loop.run_in_executor(None, lambda: self._input_request(prompt, ident, parent, password))
