"""What the kernel says when the ranks that make up the group change: a rank died, was started
anew, a respawn or a formation failed, the rank count changed.

Every such message is written here, once, so that the words agree with the number of ranks
("rank 1 was", "ranks 1,2 were"), each one names the magic that helps (``%dist_respawn``
where it works, a restart only where nothing else does), and each says what objects built on
the old group need. Pure: the unit tests read every message.
"""

from __future__ import annotations

from collections.abc import Collection

from dist_kernel.parent.selection import format_ranks

#: how a kernel message about the group starts (bold yellow, as the notes after a cell's error)
HEAD = "\x1b[1;33mdist_kernel:\x1b[0m "

#: what objects built on the old group need once it was formed again (a new size, or new members)
REBUILD = ("Objects built on the old group do not follow it: create DistributedDataParallel wrappers, "
           "DistributedSampler (it keeps the old num_replicas and rank) and new_group() handles again.")


def ranks_named(ranks: Collection[int]) -> str:
    """``rank 1`` or ``ranks 1,2`` (``ranks 0-3``)."""
    return f"{'rank' if len(set(ranks)) == 1 else 'ranks'} {format_ranks(list(ranks))}"


def _is(ranks: Collection[int]) -> str:
    return "is" if len(set(ranks)) == 1 else "are"


def _was(ranks: Collection[int]) -> str:
    return "was" if len(set(ranks)) == 1 else "were"


def count(n: int, noun: str = "rank") -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _empty(ranks: Collection[int]) -> str:
    """Whose namespace is empty, and what to do about it."""
    if len(set(ranks)) == 1:
        return ("its namespace is empty: rebuild what it needs, or copy variables into it with "
                "%dist_sync NAME [NAME ...] [--from R]")
    return ("their namespaces are empty: rebuild what they need, or copy variables into them with "
            "%dist_sync NAME [NAME ...] [--from R]")


def _it(ranks: Collection[int]) -> str:
    return "it" if len(set(ranks)) == 1 else "them"


# ------------------------------------------------------------------------ a rank died
def respawn_hint(dead: Collection[int]) -> str:
    """After a cell in which ranks died: the survivors kept their variables; how to go on."""
    which = ranks_named(dead)
    return (f"The other ranks keep their variables; the process group is down until {which} {_is(dead)} back. "
            f"Run %dist_respawn to start {which} anew ({_empty(dead)}), or restart the kernel.")


def dead_cell(dead: Collection[int]) -> str:
    """A cell that names a dead rank did not run: what to do."""
    return (f"The cell did not run. The other ranks kept their variables. Run %dist_respawn to start "
            f"{ranks_named(dead)} anew ({_empty(dead)}), or restart the kernel (Kernel > Restart). Until then, "
            "cells with %%rank on the other ranks run.")


#: every rank is gone: nothing survived to keep
ALL_GONE = "Every rank is gone. Restart the kernel (Kernel > Restart) to start fresh ranks; variables are lost."


def dead_first(dead: Collection[int], then: str) -> str:
    """A magic that needs every rank alive (``%dist_ranks N``, ``%dist_sync``)."""
    return f"{ranks_named(dead)} {_is(dead)} dead: run %dist_respawn first, then {then}."


# ------------------------------------------------------------------ started anew
def respawned(started: Collection[int]) -> str:
    """What the kernel says once dead ranks were started anew and the group formed again."""
    which = ranks_named(started)
    return (f"{HEAD}{which} {_was(started)} started anew and the process group was formed again; the other ranks "
            f"kept their variables. {_capital(_empty(started))}. {REBUILD}")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def nothing_dead() -> str:
    return "%dist_respawn: no rank is dead; nothing to start."


def refuse_running(alive: Collection[int], dead: Collection[int]) -> str:
    """``%dist_respawn SPEC`` names a rank that runs."""
    return (f"%dist_respawn: {ranks_named(alive)} {_is(alive)} running; %dist_respawn starts only dead ranks "
            f"(dead now: {format_ranks(list(dead)) or 'none'}).")


def refuse_partial(wanted: Collection[int], others: Collection[int]) -> str:
    """``%dist_respawn SPEC`` leaves other dead ranks dead: the group cannot form without them,
    so nothing is started (a started rank would wait for them in the formation)."""
    every = sorted({*wanted, *others})
    return (f"%dist_respawn {format_ranks(list(wanted))}: {ranks_named(others)} {_is(others)} dead too, and the "
            f"process group cannot form without {_it(others)}; nothing was started. "
            f"Run %dist_respawn (every dead rank) or %dist_respawn {format_ranks(every)}.")


def keeps_dying(looping: Collection[int]) -> str:
    """``--respawn on`` will not start a rank that died three times within a minute."""
    one = len(set(looping)) == 1
    return (f"--respawn on: {ranks_named(looping)} died 3 times within a minute, so {'it is' if one else 'they are'} "
            f"not started again by itself. Find out why {'it dies' if one else 'they die'} (the out-of-memory "
            "killer, a crash in an extension; %dist_status, the rank's last output), then run %dist_respawn, or "
            "restart the kernel.")


def auto_failed(error: str, dead: Collection[int]) -> str:
    """``--respawn on`` could not start the dead ranks: why, and what to do (once each)."""
    said = error if error.startswith("--respawn on") else f"--respawn on could not start {ranks_named(dead)} " \
        f"anew: {error}"
    if "%dist_respawn" in said:
        return said
    return f"{said} Run %dist_respawn to try again, or restart the kernel."


def idle_death(rank: int, reason: str, outcome: str) -> str:
    """A rank that died between cells, and what ``--respawn on`` did about it."""
    return f"rank {rank} {reason} between cells. {outcome}"


# ------------------------------------------------------------- a failed start or formation
def start_fix(reason: str, crashed: bool, respawn: bool, python: str = "this Python") -> str:
    """The advice for a rank that failed to start. ``reason``: how its process ended ("" when it
    runs); ``crashed``: its output shows a traceback; ``respawn``: it was started anew while the
    kernel runs, so ``%dist_respawn`` tries again (no restart needed); ``python``: the ranks'."""
    again = "run %dist_respawn to try again" if respawn else "restart the kernel to try again"
    if reason and crashed:
        return (f"The rank process {reason} while starting (its output is above). Fix: make sure ipykernel and "
                f"dist_kernel import in {python}, then {again}.")
    if reason:
        return f"The rank process {reason} while starting. {_capital(again)}."
    return f"{_capital(again)}; on a slow or busy machine raise --startup-timeout."


def join_failed(rank: int, backend: str, error: str, python: str) -> str:
    """A rank whose join the rank refused (``error``): torch missing, or options that do not suit
    the machine."""
    if "No module named 'torch'" in error or ("torch" in error and "ImportError" in error):
        fix = f"Fix: make sure `import torch` works in {python}, then restart the kernel."
    else:
        fix = "Fix: check the kernel's options (--gpus, --backend) suit this machine, then restart the kernel."
    return f"rank {rank} could not join the {backend} process group:\n{error}\n{fix}"


def rank_states(states: dict[int, tuple[str, str]]) -> str:
    """The ranks' states when a start timed out, from {rank: (where its process is, its state)},
    each followed by ". " ("" without ranks); past 8 ranks grouped by state, one line however many."""
    if len(states) > 8:
        by_state: dict[str, list[int]] = {}
        for rank, (_, state) in states.items():
            by_state.setdefault(state, []).append(rank)
        groups = sorted(by_state.items(), key=lambda kv: min(kv[1]))
        return "; ".join(f"rank {format_ranks(ranks)} {state}" for state, ranks in groups) + ". "
    each = [f"rank {rank} ({where}) {state}" for rank, (where, state) in states.items()]
    return ("; ".join(each) + ". ") if each else ""


def formation_failed(error: str, started: Collection[int], retry: str) -> str:
    """A respawn or resize (``retry``: the magic, to run again) that failed to start its ranks or
    to form the group: why, that nothing is left half-started or waiting in the formation, and
    what to run next."""
    ended = f" {_capital(ranks_named(started))}, started for it, {_was(started)} ended again." if started else ""
    again = "" if retry in error else f" Run {retry} to try again, or restart the kernel."
    return f"{error.rstrip()}\nNo rank waits in the formation any more.{ended}{again}"


def not_joined(rank: int, seconds: float, respawn: bool) -> str:
    """A rank that did not answer its join in time (never an empty message)."""
    fix = ("run %dist_respawn to try again" if respawn else "restart the kernel") + \
        "; on a slow or busy machine raise --startup-timeout"
    return f"rank {rank} did not join the process group within {seconds:.0f}s. Fix: {fix}."


def dead_before_joining(dead: Collection[int], reasons: str) -> str:
    """A formation asked of a group with dead ranks: it cannot form, and nobody is asked to join."""
    return (f"{ranks_named(dead)} {_is(dead)} dead ({reasons}): the process group cannot form without "
            f"{_it(dead)}. Run %dist_respawn to start {_it(dead)} anew, or restart the kernel.")


# --------------------------------------------------------------------- the rank count
def resized(world: int, started: Collection[int], ended: Collection[int]) -> str:
    """``%dist_ranks N`` changed the count: the new size, what the new ranks need, and what
    objects built on the old group need."""
    said = [f"now {count(world)}; the process group was formed again and the other ranks kept their variables."]
    if started:
        said.append(f"Started {ranks_named(started)}; {_empty(started)}.")
    if ended:
        said.append(f"Ended {ranks_named(ended)}.")
    said.append(REBUILD)
    return " ".join(said)


def count_now(world: int, started_with: int) -> str:
    """``%dist_ranks`` alone."""
    return (f"{count(world)} now; the kernel started with {started_with} (its kernelspec's --ranks, or "
            "DIST_KERNEL_RANKS). %dist_ranks N changes the count in place.")


def magic_failed(magic: str, arg: str, error: BaseException) -> str:
    """A group magic that failed in a way no message was written for: never empty."""
    text = str(error).strip() or f"{type(error).__name__} (no message)"
    return f"%{magic}{' ' + arg if arg else ''}: {text}"
