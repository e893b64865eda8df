"""The kernel's own line magics: one table (:data:`MAGICS`), and a cell's magics run in its order.

A cell's first lines that name one of these (blank and comment lines between them allowed) are
the parent's: :func:`run` runs them one after the other, in the cell's order, before the rest of
the cell goes to the ranks, so ``%dist_ranks 3`` then ``%dist_status`` shows 3 ranks, and the
rest (a ``%%rank`` line included) is read against the rank count they leave. The first that
fails ends the cell, with its error.

A magic is one row of :data:`MAGICS`: its name, its handler and one line of help. The handler
lives with its domain (the debugger, ``%dist_top``, ``%dist_status``, the group magics, the
options) and takes a :class:`MagicContext`, which carries the ranks, the cell's publish function
and the kernel's parts a magic may change, and the magic's argument; it says what happened
(:meth:`MagicContext.say`) or raises the error the user sees. Each rank switch of
:mod:`dist_kernel.options` is a row made from the option (:mod:`dist_kernel.parent.option_magics`).
The README's magics table lists the same names (a unit test holds them to each other).

These magics act for every rank, so a ``%%rank`` line cannot pick ranks for them: a cell whose
``%%rank`` line is followed by one is refused before anything runs (a switch flipped on some
ranks only would leave the ranks disagreeing; running it on every rank would not be what the
cell says).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dist_kernel.exceptions import DistKernelError, UsageError, error_content
from dist_kernel.options import RANK_SWITCHES
from dist_kernel.parent.debugger import DebugSession, dist_debug
from dist_kernel.parent.group_magics import Copy, MagicFailed, dist_ranks, dist_respawn, dist_sync
from dist_kernel.parent.membership_words import magic_failed
from dist_kernel.parent.option_magics import dist_output, dist_switch, switch_help
from dist_kernel.parent.selection import rank_line
from dist_kernel.parent.status import dist_status
from dist_kernel.parent.top import TopMonitor, dist_top

if TYPE_CHECKING:
    from dist_kernel.options import KernelConfig
    from dist_kernel.parent.ranks import Ranks

#: publish an IOPub message in the running cell: (msg_type, content)
Publish = Callable[[str, dict], None]
#: one magic call: its name (``dist_status``) and its argument
Call = tuple[str, str]


@dataclass(frozen=True)
class MagicContext:
    """What a magic's handler is given: the ranks, where the cell's output goes, and the parts of
    the kernel a magic reads or changes."""

    ranks: Ranks
    publish: Publish
    #: the kernel's options as it started (its kernelspec's), before any magic changed them
    launched: KernelConfig
    debug: DebugSession
    top: TopMonitor
    #: takes ``%dist_output``'s policy
    set_output: Callable[[str], None]
    #: ``%dist_sync``'s copy, watched as a cell is
    copy: Copy
    #: the ranks ``--respawn on`` is starting anew now
    starting: Collection[int] = ()
    #: where the kernel's output log is (``%dist_status`` says)
    output_log: str = ""
    #: a person watches this request run (``top.watched``): ``%dist_top``'s table is shown to it
    live: bool = True

    def say(self, text: str) -> None:
        """A line of the magic's own on stdout."""
        self.publish("stream", {"name": "stdout", "text": text if text.endswith("\n") else text + "\n"})


Handler = Callable[[MagicContext, str], Awaitable[None]]


@dataclass(frozen=True)
class Magic:
    """One of the kernel's line magics."""

    name: str  # without the %: ``dist_status``
    handler: Handler
    help: str  # one line; the README's magics table says more
    #: does a cell of only this magic wait for a rank that ``--respawn on`` is starting anew?
    #: (``%dist_status`` does not: it shows that rank being started)
    waits: bool = True


#: every line magic of the kernel, by name, in the README's order
MAGICS: dict[str, Magic] = {m.name: m for m in (
    Magic("dist_status", dist_status, "per rank: pid, host, device, state, process group, load, memory "
          "and cache freeing; where the output log is", waits=False),
    Magic("dist_top", dist_top, "a live table of each rank's state and load while cells run; `off` stops it"),
    Magic("dist_debug", dist_debug, "the rank JupyterLab's debugger debugs: `N`, or `off`; alone, which"),
    Magic("dist_respawn", dist_respawn, "start dead ranks anew (every one, or those named) and form "
          "the group again"),
    Magic("dist_sync", dist_sync, "copy variables from one rank (`--from R`, 0) to every other rank"),
    Magic("dist_ranks", dist_ranks, "the rank count; with N, grow or shrink the ranks on this "
          "machine to N in place"),
    Magic("dist_output", dist_output, "rich output from every rank, merged (`all`), or from rank 0 "
          "only (`rank0`)"),
    *(Magic(f"dist_{name}", functools.partial(dist_switch, name), switch_help(name))
      for name in RANK_SWITCHES),
)}

_LINE = re.compile(r"^\s*%(?P<name>" + "|".join(MAGICS) + r")\b(?P<arg>.*)$")


def split(code: str) -> tuple[list[Call], str]:
    """Take the kernel's magics off a cell's first lines (their lines stay, blanked, so line
    numbers hold): the calls in order, and the rest of the cell."""
    lines = code.split("\n")
    found: list[Call] = []
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        if m:
            found.append((m.group("name"), m.group("arg").strip()))
            lines[i] = ""
        elif line.strip() and not line.lstrip().startswith("#"):
            break
    return found, "\n".join(lines) if found else code


def read(code: str) -> tuple[list[Call], str]:
    """:func:`split`, refusing (:class:`UsageError`) a magic of the kernel below a ``%%rank``
    line, before anything runs."""
    calls, rest = split(code)
    lines = rest.split("\n")
    i = rank_line(lines)
    below = split("\n".join(lines[i + 1:]))[0] if i is not None else []
    if i is not None and below:
        name, selection = below[0][0], lines[i].strip()
        raise UsageError(f"%{name} under `{selection}`: the kernel's magics act for every rank, so a %%rank line "
                         "cannot pick ranks for them (a switch flipped on some ranks only would leave the ranks "
                         f"disagreeing). Put %{name} in a cell of its own, or above the %%rank line; nothing ran.")
    return calls, rest


def waits(code: str) -> bool:
    """Does this cell wait for a rank that ``--respawn on`` is starting anew? Every cell but one
    of magics that need not (``%dist_status``, which then shows it being started) and no code."""
    calls, rest = split(code)
    return not (calls and not rest.strip() and all(not MAGICS[name].waits for name, _ in calls))


async def run(ctx: MagicContext, calls: Sequence[Call]) -> dict | None:
    """Run a cell's magics in its order; the first that fails ends them: its error's content."""
    for name, arg in calls:
        try:
            await MAGICS[name].handler(ctx, arg)
        except MagicFailed as e:
            return e.error
        except DistKernelError as e:
            return error_content(type(e), str(e) or magic_failed(name, arg, e))
        except Exception as e:  # noqa: BLE001 - a rank that failed to start or join: said, the kernel stays
            return error_content(type(e).__name__, magic_failed(name, arg, e))
    return None
