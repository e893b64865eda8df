"""The magics that change an option while the kernel runs: ``%dist_output`` (the parent's own),
and ``%dist_<name> on|off`` for each rank switch, made from the options declared ``rank_switch``
in :mod:`dist_kernel.options` (``%dist_fastai``, ``%dist_lightning``, ``%dist_hf``,
``%dist_empty_cache``), never written one by one.

A switch is sent to every live rank at once (``set_option``) and becomes the kernel's option
(``Ranks.config``), so a rank started later (``%dist_respawn``, ``%dist_ranks``) is switched so
too. No rank is ever switched alone: the parent reads these magics off a cell's first lines, a
``%%rank`` line cannot pick ranks for them (:mod:`dist_kernel.parent.magics` refuses it), and a
rank refuses one that reaches it (:func:`dist_kernel.rank.switches.stand_in`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dist_kernel.exceptions import RankRequestError, UsageError
from dist_kernel.options import OPTION, OUTPUT_POLICIES
from dist_kernel.parent.selection import format_ranks

if TYPE_CHECKING:
    from dist_kernel.options import KernelConfig
    from dist_kernel.parent.ranks import Ranks


class OutputCall(Protocol):
    """What ``%dist_output`` is given (:class:`~dist_kernel.parent.magics.MagicContext` is one)."""

    @property
    def set_output(self) -> Callable[[str], None]: ...
    def say(self, text: str) -> None: ...


class SwitchCall(Protocol):
    """What a rank switch's magic is given."""

    @property
    def ranks(self) -> Ranks: ...
    @property
    def launched(self) -> KernelConfig: ...
    def say(self, text: str) -> None: ...


async def dist_output(call: OutputCall, arg: str) -> None:
    """``%dist_output all|rank0``: rich output from every rank (merged) or from rank 0 only."""
    if arg not in OUTPUT_POLICIES:
        raise UsageError(f"%dist_output {arg!r}: use `%dist_output all` (rich output from every rank, merged) "
                         "or `%dist_output rank0`.")
    call.set_output(arg)
    call.say(f"rich output from: {arg}")


def what(name: str) -> str:
    """What a rank switch does, in its option's first words (``fastai integration inside the ranks``)."""
    return OPTION[name].help_text.split(" (default")[0].split(":")[0]


def switch_help(name: str) -> str:
    """The magics table's line for the rank switch ``name``."""
    return f"{what(name)}: on or off, on every rank at once (starts as {OPTION[name].flag})"


async def dist_switch(name: str, call: SwitchCall, arg: str) -> None:
    """``%dist_<name> on|off``: the rank switch ``name`` on every rank; alone, whether it is on."""
    option, ranks = OPTION[name], call.ranks
    word = arg.split("#", 1)[0].strip().lower()
    if not word:
        call.say(f"{name}: {'on' if ranks.config.rank_switches()[name] else 'off'} on every rank")
        return
    if word not in ("on", "off"):
        raise UsageError(f"%dist_{name} {arg.strip()!r}: use `%dist_{name} on` or `%dist_{name} off` "
                         f"({what(name)}).")
    on = word == "on"
    if on and option.installed_at_start and not call.launched.rank_switches()[name]:
        raise UsageError(f"%dist_{name} on: this kernel started with {option.flag} off, so the integration was "
                         "never installed in its ranks (a library they imported since would stay unpatched). "
                         f"Restart the kernel with {option.flag} on ({option.env}=on) to use it; nothing was "
                         "switched.")
    missing = await ranks.set_option(name, on)
    if missing:
        raise RankRequestError(f"rank {format_ranks(missing)} did not confirm %dist_{name} {word}, so the ranks "
                               f"may disagree; run `%dist_{name} {word}` again, or restart the kernel.")
    call.say(f"{name}: {word} on every rank")
