"""Labels: how output that only some ranks gave says which (``[rank 0,2] ...``), and the marks a
rank puts on its output for the merger, taken off before a frontend sees them."""

from __future__ import annotations

import copy
import functools
import html
from collections.abc import Hashable, Sequence

from dist_kernel.output_kinds import KINDS
from dist_kernel.parent.merge.units import content_key
from dist_kernel.parent.selection import format_ranks
from dist_kernel.protocol import META, META_GROUPS, META_RANKS, with_meta


@functools.lru_cache(maxsize=1024)
def _label(ranks: tuple[int, ...]) -> str:
    return f"[rank {format_ranks(ranks)}] "


def label(ranks: Sequence[int]) -> str:
    """The prefix that marks output as coming from these ranks only."""
    return _label(tuple(ranks))


def label_lines(text: str, ranks: Sequence[int]) -> str:
    """Every line of ``text`` marked as coming from these ranks."""
    prefix = label(ranks)
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def prefix_lines(text: str, prefix: str | None) -> str:
    """Every non-empty line of ``text`` after ``prefix`` (an area's text, shown whole)."""
    if not prefix:
        return text
    return "\n".join(prefix + line if line else line for line in text.split("\n"))


def unmarked(msg_type: str, content: dict) -> dict:
    """``content`` without the marks a rank puts on its output for the merger (``solo``,
    ``branch``): a stream's ``metadata`` (not a field of the Jupyter stream message), a rich
    output's ``metadata.dist_kernel``. For output shown without the merger (a comm callback's,
    output after its cell ended)."""
    kind = KINDS.get(msg_type)
    if kind is not None and kind.lines and "metadata" in content:
        return {k: v for k, v in content.items() if k != "metadata"}
    return unmarked_meta(content)


def unmarked_meta(content: dict) -> dict:
    """:func:`unmarked` of an output whose marks are in its ``metadata`` (a rich one)."""
    meta = content.get("metadata")
    if isinstance(meta, dict) and META in meta:
        return {**content, "metadata": {k: v for k, v in meta.items() if k != META}}
    return content


def namespaced_display_id(display_id: str, rank: int) -> str:
    """Display ids are per rank, so two ranks showing id X never overwrite each other."""
    return f"{display_id}@rank{rank}"


def labelled_error(content: dict, ranks: Sequence[int]) -> dict:
    """An error output whose traceback starts with the ranks that raised it."""
    tb = list(content.get("traceback") or [])
    return dict(content, traceback=[f"\x1b[1;31m{label(ranks).strip()}\x1b[0m", *tb])


def labelled_rich(content: dict, ranks: Sequence[int]) -> dict:
    """A rich output with its text and HTML labelled, and the ranks in its metadata."""
    content = copy.deepcopy(content)
    data = content.setdefault("data", {})
    prefix = label(ranks)
    if "text/plain" in data:
        data["text/plain"] = prefix + data["text/plain"]
    if "text/html" in data:
        data["text/html"] = f"<pre style='margin:0'>{prefix.strip()}</pre>" + data["text/html"]
    meta = content.get("metadata") or {}
    content["metadata"] = with_meta(meta, {META_RANKS: list(ranks)})
    return content


def _html_of(data: dict) -> str:
    """An output's best rendering as HTML, to show several ranks' outputs in one display."""
    if "text/html" in data:
        return str(data["text/html"])
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            return f"<img src='data:{mime};base64,{str(data[mime]).strip()}'/>"
    if "image/svg+xml" in data:
        return str(data["image/svg+xml"])
    return f"<pre style='margin:0'>{html.escape(str(data.get('text/plain', '')))}</pre>"


def combined(states: dict[int, dict], ranks: Sequence[int]) -> dict:
    """The content of a display that ranks gave ``states``: the content itself when every rank
    of the cell gave the same; otherwise each group of ranks' content, labelled, one after another."""
    groups: dict[Hashable, list[int]] = {}
    for r in sorted(states):
        groups.setdefault(content_key(states[r])[0], []).append(r)
    if len(groups) == 1:
        (group,) = groups.values()
        content = states[group[0]]
        if set(group) >= set(ranks):
            return {"data": content.get("data", {}), "metadata": content.get("metadata", {})}
        return labelled_rich({"data": content.get("data", {}), "metadata": content.get("metadata", {})}, group)
    datas = [(g, states[g[0]].get("data") or {}) for g in groups.values()]
    data = {"text/plain": "\n".join(label(g) + str(d.get("text/plain", "")) for g, d in datas)}
    if any(m in d for _, d in datas for m in ("text/html", "image/png", "image/jpeg", "image/svg+xml")):
        data["text/html"] = "".join(f"<div><pre style='margin:0'>{label(g).strip()}</pre>{_html_of(d)}</div>"
                                    for g, d in datas)
    return {"data": data, "metadata": with_meta({}, {META_RANKS: sorted(states), META_GROUPS: [g for g, _ in datas]})}
