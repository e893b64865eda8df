"""input() on N ranks: one prompt in the frontend, the answer to every rank that asked.

Ranks run the same code, so the k-th ``input()`` of every rank is the same question: the
first rank to ask it opens the prompt; all ranks asking it get that one answer.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable

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
