"""The fault policy's rule 3, its reading of ranks that are all blocked: can the calls they are
blocked in complete each other? Pure: it reads the ranks' ``where`` replies
(:class:`~dist_kernel.protocol.Place`), and says why not, in words.

Three ways they cannot:

- **Different calls.** Different collectives, or sequence numbers, or groups; a point-to-point
  call without its counterpart (two ranks each receiving from the other).
- **Different tensors in one call.** Every rank is in the same collective (same group and
  sequence number), but one that needs the same shape and dtype on every rank
  (:data:`SAME_OPERANDS`) holds different ones: gloo waits for bytes that never come
  (``dist.all_reduce(torch.ones(rank + 1))``). torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
  compares such fingerprints before every collective; the kernel compares them only once the
  ranks have been blocked for a while, from what each rank reports (``Place.operands``).
- **A collective started in C++ against one called from Python.** A rank in a C++ call of
  torch's distributed code (``native``: DDP's forward re-building its buckets, its constructor)
  or in ``backward()`` (DDP's gradient all_reduce) has started, in C++, at least as many
  collectives on a group as the collective another rank is blocked in from Python on that group
  (a ``barrier``): the two are different calls at one place in the group's order, or the C++ one
  is past it, so neither completes (accelerate's ``join_uneven_inputs``; DDP with uneven inputs).
  A C++ rank that has started fewer may still be computing on its way there: not judged.
"""

from __future__ import annotations

from collections.abc import Iterable

from dist_kernel.parent.selection import format_ranks
from dist_kernel.protocol import Place

P2P = ("send", "recv", "isend", "irecv")
#: collectives whose tensors have one shape and dtype on every rank
SAME_OPERANDS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def unmatched(places: dict[int, Place], world: Iterable[int]) -> str:
    """Why the calls these blocked ranks are in cannot complete each other, in words; "" when
    they may. Every rank given is blocked: in a torch.distributed call (``collective``), or in a
    collective that torch started in C++ (``native`` or ``in_backward``)."""
    python = {r: s for r, s in places.items() if s.collective is not None}
    if len(python) < len(places):
        return _cpp_against_python(places, python, tuple(world))
    if not _can_complete(python):
        return ", ".join(f"rank {r} in {call(s)}" for r, s in python.items())
    return _operands_differ(python)


def call(s: Place) -> str:
    """A blocked rank's torch.distributed call, in words: ``recv(src=1, #4)``."""
    extra = []
    if s.peer is not None:
        extra.append(("src=" if s.collective in ("recv", "irecv") else "dst=") + str(s.peer))
    if s.seq is not None:
        extra.append(f"#{s.seq}")
    return f"{s.collective}({', '.join(extra)})"


def _can_complete(places: dict[int, Place]) -> bool:
    """Could the calls these ranks are blocked in complete each other, as calls?"""
    p2p = {r: s for r, s in places.items() if s.collective in P2P}
    coll = {r: s for r, s in places.items() if s.collective not in P2P}
    for r, s in p2p.items():  # a send must face a recv from the other side, and vice versa
        other = p2p.get(s.peer) if s.peer is not None else None
        sending = s.collective in ("send", "isend")
        if other is None or other.peer != r or (other.collective in ("send", "isend")) == sending:
            return False
    if coll:
        kinds = {(s.collective, tuple(s.group_ranks), s.seq) for s in coll.values()}
        if len(kinds) != 1:
            return False
        (_, group, _), = kinds
        members = set(group) if group else set(places)
        if not members <= set(coll):  # a member of its group is elsewhere (a p2p call)
            return False
    return True


def _fingerprint(s: Place) -> str:
    """The tensors of a rank's call, as torch prints them: ``[1] float32``."""
    return ", ".join(f"{o.shape} {o.dtype}" for o in s.operands)


def _operands_differ(places: dict[int, Place]) -> str:
    """Ranks in one collective that needs the same tensors everywhere, holding different ones:
    each set of ranks with its tensors (``rank 0 all_reduce of [1] float32, rank 1 of [2]
    float32``); "" when they agree, or the call does not need them to."""
    op = next(iter(places.values())).collective
    if op not in SAME_OPERANDS or any(not s.operands for s in places.values()):
        return ""
    by_print: dict[str, list[int]] = {}
    for r, s in sorted(places.items()):
        by_print.setdefault(_fingerprint(s), []).append(r)
    if len(by_print) < 2:
        return ""
    said: list[str] = []
    for tensors, ranks in by_print.items():
        said.append(f"rank {format_ranks(ranks)} " + ("of " if said else f"{op} of ") + tensors)
    return ", ".join(said) + f": {op} needs the same shape and dtype on every rank"


def _cpp_against_python(places: dict[int, Place], python: dict[int, Place], world: tuple[int, ...]) -> str:
    """A rank in a collective torch started in C++ that has started at least as many collectives
    on a group as the one another rank is blocked in from Python on that group: both, in words
    ("" when no such pair, or nothing is known of the counts)."""
    for c, cs in places.items():
        if c in python:
            continue
        count, group = _cpp_count(cs, world)
        if count is None:
            continue
        for p, ps in python.items():
            if ps.seq is not None and set(ps.group_ranks or world) == group and count >= ps.seq:
                return f"rank {c} in {in_cpp(cs)} (#{count}); rank {p} in {call(ps)}"
    return ""


def _cpp_count(s: Place, world: tuple[int, ...]) -> tuple[int | None, set[int]]:
    """How many collectives a rank in a C++-started one has started, and on which group's ranks:
    its call's group (``native``), else the default group (``backward()``)."""
    if s.native and s.group_ranks:
        return s.seq, set(s.group_ranks)
    return s.group_seq, set(world)


def in_cpp(s: Place) -> str:
    """Where a rank in a collective that torch started in C++ waits, in words."""
    if s.native:
        return f"{s.native}, a collective that torch started in C++"
    return "backward(), DDP's gradient all_reduce, started in C++"
