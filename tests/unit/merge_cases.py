"""What the merger's specifications share: events as a rank sends them, and the cell driven as the
parent drives it (:class:`~dist_kernel.parent.merge.CellMerger`)."""

from __future__ import annotations

import re

from dist_kernel.parent.merge import CellMerger, render_cr
from dist_kernel.parent.relay import IN_ORDER

W = 0.1  # merge window used throughout


def streams(emits, name="stdout"):
    return "".join(c["text"] for t, c in emits if t == "stream" and c["name"] == name)


def run(merger: CellMerger, events, end: float = 10.0):
    """Feed (time, rank, msg_type, content) events, polling as the parent does; return all emits."""
    out = []
    for now, rank, msg_type, content in sorted(events, key=lambda e: e[0]):
        merger.poll(now)
        merger.add(rank, msg_type, content, now)
        out += merger.take()
    merger.finish(end)
    return out + merger.take()


def say(t, rank, text, name="stdout"):
    return (t, rank, "stream", {"name": name, "text": text})


def final_displays(out) -> set[str]:
    """The text each updatable display shows at the end."""
    shown: dict[str, str] = {}
    for t, c in out:
        if t in ("display_data", "update_display_data") and "transient" in c:
            shown[c["transient"]["display_id"]] = c["data"].get("text/plain", "")
    return set(shown.values())


def frontend(out) -> str:
    """What a frontend shows at the end (JupyterLab, nbclient): outputs replayed in order, a
    ``clear_output(wait=True)`` taking effect at the next output, display updates in place, and
    consecutive stream text of one name as one output, in which ``\\r`` rewrites its line."""
    shown: list[list] = []  # [kind, display id or stream name, text]
    clear = False
    for t, c in out:
        if t == "clear_output":
            clear, shown = (True, shown) if c.get("wait") else (False, [])
            continue
        if t == "update_display_data":
            for o in shown:
                if o[0] == "display" and o[1] == c["transient"]["display_id"]:
                    o[2] = c["data"].get("text/plain", "")
            continue
        if clear:
            shown, clear = [], False
        if t == "stream" and shown and shown[-1][:2] == ["stream", c["name"]]:
            shown[-1][2] += c["text"]
        elif t == "stream":
            shown.append(["stream", c["name"], c["text"]])
        elif t in ("display_data", "execute_result"):
            shown.append(["display", (c.get("transient") or {}).get("display_id"), c["data"].get("text/plain", "")])
    return "".join(render_cr(o[2]) if o[0] == "stream" else o[2] + "\n" for o in shown)


def expand(spec: str) -> list[int]:
    """The ranks a label names: ``0,2-4`` is [0, 2, 3, 4]."""
    out: list[int] = []
    for piece in spec.split(","):
        lo, _, hi = piece.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def disp(t, rank, text, display_id, msg_type="display_data"):
    return (t, rank, msg_type, {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id}})


def err(t, rank, ename, evalue="boom"):
    return (t, rank, "error", {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]})


def kinds(out):
    return [t for t, _ in out]


def drift(texts: dict[int, list[str]], start: dict[int, float], step: dict[int, float],
          pause: tuple[int, int, float] | None = None):
    """Stream events: rank r prints its texts from ``start[r]``, one every ``step[r]`` seconds;
    ``pause`` (rank, index, seconds): that rank stalls before that text."""
    events = []
    for r, lines in texts.items():
        t = start[r]
        for i, line in enumerate(lines):
            if pause and pause[:2] == (r, i):
                t += pause[2]
            events.append(say(t, r, line))
            t += step[r]
    return events


def per_rank(text: str, ranks) -> dict[int, list[str]]:
    """What each rank printed, read back from merged output (unlabelled lines belong to all)."""
    out = {r: [] for r in ranks}
    for line in text.splitlines(keepends=True):
        m = re.match(r"\[rank ([\d,-]+)\] (.*)", line, re.S)
        for r in expand(m.group(1)) if m else ranks:
            out[r].append(m.group(2) if m else line)
    return out


def run_polled(merger: CellMerger, events, end: float, tick: float = 0.05):
    """As ``run``, with the parent's poll every ``tick`` between events too. Events of type
    ``IN_ORDER`` (an ``Output`` widget's capture changes) go to ``add_in_order``, after the plain
    events of the same moment, as the parent hands them over."""
    plain = [e for e in events if e[2] != IN_ORDER]
    in_order = [e for e in events if e[2] == IN_ORDER]
    ticks = [(i * tick, None, None, None) for i in range(int(end / tick))]
    out = []
    for now, rank, msg_type, content in sorted(plain + in_order + ticks, key=lambda e: e[0]):
        merger.poll(now)
        if msg_type == IN_ORDER:
            merger.add_in_order(rank, msg_type, content, now)
        elif rank is not None:
            merger.add(rank, msg_type, content, now)
        out += merger.take()
    for r in merger.ranks:
        merger.rank_done(r, end)
    merger.finish(end)
    return out + merger.take()


LINES = [f"step {i}\n" for i in range(300)]


def say_solo(t, rank, text, name="stdout"):
    """A stream message a rank marked as its alone (``agent.solo_output(streams=True)``)."""
    return (t, rank, "stream", {"name": name, "text": text, "metadata": {"dist_kernel": {"solo": True}}})


def say_branch(t, rank, text, name="stdout"):
    """A stream message a rank made inside a branch on the rank (``if rank == 0: print(...)``)."""
    return (t, rank, "stream", {"name": name, "text": text, "metadata": {"dist_kernel": {"branch": True}}})

