"""Runs inside each rank: what each rank switch does (the options declared ``rank_switch`` in
:mod:`dist_kernel.options`: cache freeing and the library integrations).

A switch is set twice: at the group's first formation from the kernel's option (``Join.switches``,
:func:`start`), and at run time by ``set_option`` (:func:`switch`), which the parent's
``%dist_<name> on|off`` sends to every rank at once. A new rank switch is an option with
``rank_switch=True``, its ``KernelConfig`` field, and its entry in :data:`SWITCHES`; the
protocol, the parent's join, its magic and ``set_option`` follow from those (a unit test holds
:data:`SWITCHES` to the options).

A rank never flips a switch alone: ``%dist_<name>`` reaching a rank (below code in a cell, or
``run_line_magic``) is refused there with a pointer to the parent's magic (:func:`stand_in`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dist_kernel.options import OPTION, RANK_SWITCHES
from dist_kernel.rank import agent, integration


@dataclass(frozen=True)
class RankSwitch:
    """What one switch does in a rank."""

    #: at the first formation, with the option's value: an integration is installed only when on
    #: (its patches, once installed, consult :attr:`set`'s flag on every call)
    start: Callable[[bool], None]
    #: at run time (``set_option``)
    set: Callable[[bool], None]


def _install_fastai(on: bool) -> None:
    if on:
        from dist_kernel.rank import fastai

        fastai.install()


def _install_lightning(on: bool) -> None:
    if on:
        from dist_kernel.rank import lightning

        lightning.install()


def _install_hf(on: bool) -> None:
    if on:
        from dist_kernel.rank import hf

        hf.install()


#: every rank switch by its option's name; the integrations are imported only when installed
SWITCHES: dict[str, RankSwitch] = {
    "fastai": RankSwitch(_install_fastai, integration.fastai.set),
    "lightning": RankSwitch(_install_lightning, integration.lightning.set),
    "hf": RankSwitch(_install_hf, integration.hf.set),
    "empty_cache": RankSwitch(agent.set_empty_cache, agent.set_empty_cache),
}


def start(given: Mapping[str, bool]) -> None:
    """The first formation: every switch as ``given`` (``Join.switches``), or its option's default;
    and each switch's magic refused on this rank (:func:`stand_in`)."""
    for name in RANK_SWITCHES:
        on = given.get(name)
        SWITCHES[name].start(bool(OPTION[name].default_value()) if on is None else on)
    _register_stand_ins()


def stand_in(name: str, line: str = "") -> None:
    """``%dist_<name>`` run on a rank: refused. The parent runs it, for every rank at once, from a
    cell's first lines; here (below code, under ``%%rank``) it would flip this rank alone."""
    from IPython.core.error import UsageError

    magic = f"%dist_{name} {line.strip()}".strip()
    raise UsageError(f"{magic} reached a rank, and a rank never switches {name} alone: the ranks would disagree. "
                     f"The kernel switches it on every rank at once when it is among a cell's first lines: put "
                     f"`{magic}` at the top of a cell, before any code and without %%rank. No rank switched anything.")


def _register_stand_ins() -> None:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        for name in RANK_SWITCHES:
            shell.register_magic_function(functools.partial(stand_in, name), "line", f"dist_{name}")


def switch(name: str, on: bool) -> None:
    """``set_option``: switch ``name`` (a name the protocol validated) at run time."""
    SWITCHES[name].set(on)
