"""The server-side pieces of ``python -m dist_kernel lab``, put into the server's own packages.

Three things, each where the server does the work it changes (versions of
``.ci/constraints.txt``; a version whose names moved gets none of them, with a warning):

- jupyter-server-nbmodel's output hook (``actions._output_hook``), which writes a running cell's
  output into the notebook's shared document, applies ``update_display_data`` and waits with
  ``clear_output(wait=True)`` as a browser does (:mod:`dist_kernel.lab.displays`), both in the
  document and in the outputs a page polls for (output recovery);
- jupyter-server-ydoc's cleanup of a document whose last page closed waits while a cell of that
  document runs (:mod:`dist_kernel.lab.documents`), and a page reads such a cell's output from the
  document alone while it runs (:func:`execute_snippet`);
- JupyterLab's settings default nbmodel's output recovery to on: a reloaded page resumes
  following a running cell. A user's own setting still wins.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dist_kernel.lab.displays import CellDisplays, Place, Step
from dist_kernel.lab.documents import RunningDocuments

log = logging.getLogger("dist_kernel.lab")

#: nbmodel's JupyterLab plugin and its setting "Recover the outputs over HTTP"
RECOVERY_PLUGIN = "@datalayer/jupyter-server-nbmodel:notebook-cell-executor"
RECOVERY_SETTING = "outputRecovery"
#: marks a function of the server's packages as ours, so that a second install changes nothing
MARK = "_dist_kernel_lab"

DOCUMENTS = RunningDocuments()


def install() -> list[str]:
    """Put the three pieces in; the names of those that could not be (their package changed)."""
    missing = []
    for name, put in (("output hook", _install_output_hook), ("document keeper", _install_keeper),
                      ("output recovery default", _install_recovery_default)):
        try:
            put()
        except (ImportError, AttributeError) as e:
            log.warning("dist_kernel lab: the %s is not installed (%s: %s)", name, type(e).__name__, e)
            missing.append(name)
    return missing


def _marked(fn: Callable) -> bool:
    return getattr(fn, MARK, False)


def _mark(fn: Callable) -> Callable:
    setattr(fn, MARK, True)
    return fn


# ------------------------------------------------------------------ displays updated in place
def _install_output_hook() -> None:
    from jupyter_server_nbmodel import actions

    if _marked(actions._output_hook):
        return
    base = actions._StreamState

    @dataclass
    class StreamAndDisplays(base):  # type: ignore[misc, valid-type]  # nbmodel's, made per execution
        displays: CellDisplays = field(default_factory=CellDisplays)

    actions._StreamState = StreamAndDisplays
    actions._output_hook = _mark(functools.partial(output_hook, actions._output_hook))


def output_hook(original: Callable, outputs: list, ycell: Any, state: Any, msg: dict) -> None:
    """nbmodel's ``_output_hook(outputs, ycell, stream_state, msg)``, with displays updated in
    place: ``outputs`` is the list of the execution's outputs a page polls for (one per message),
    ``ycell`` the notebook cell (or None)."""
    displays = getattr(state, "displays", None)
    if not isinstance(displays, CellDisplays):
        original(outputs, ycell, state, msg)
        return
    step: Step = displays.step(msg["header"]["msg_type"], msg.get("content") or {})
    if step.clear_first:
        original(outputs, ycell, state, {"header": {"msg_type": "clear_output"}, "content": {"wait": False}})
    if step.replace is not None:
        display_id, output = step.replace
        _replace(displays.where(display_id), output, outputs, ycell)
    if step.forward:
        original(outputs, ycell, state, msg)
    if step.remember is not None and outputs:
        cell_outputs = len(ycell["outputs"]) if ycell is not None else 0
        displays.remember(step.remember, Place(len(outputs) - 1, cell_outputs - 1 if cell_outputs else None))


def _replace(places: list[Place], output: dict, outputs: list, ycell: Any) -> None:
    import nbformat

    for place in places:
        if place.message < len(outputs):
            outputs[place.message] = nbformat.from_dict(output)
    if ycell is None:
        return
    cell_outputs = ycell["outputs"]
    with cell_outputs.doc.transaction():  # one change: the page never shows the cell without it
        for place in places:
            if place.output is not None and place.output < len(cell_outputs):
                cell_outputs[place.output] = dict(output)  # pycrdt: delete and insert, as JupyterLab's set


# ------------------------------------------------------------------ documents of running cells
def _install_keeper() -> None:
    from jupyter_server_nbmodel import actions
    from jupyter_server_ydoc.handlers import YDocWebSocketHandler

    if not _marked(actions._execute_snippet):
        actions._execute_snippet = _mark(functools.partial(execute_snippet, actions._execute_snippet))
    if not _marked(YDocWebSocketHandler._clean_room):
        original = YDocWebSocketHandler._clean_room

        async def clean_room(handler: Any) -> None:
            delay = handler._cleanup_delay
            if delay is None:  # kept forever anyway
                return
            await DOCUMENTS.forget_when_idle(handler._room_id, delay)
            handler._cleanup_delay = 0  # waited above; this handler's page has gone
            await original(handler)

        YDocWebSocketHandler._clean_room = _mark(clean_room)


async def execute_snippet(original: Callable, client: Any, ydoc: Any, snippet: str, metadata: dict | None,
                          stdin_hook: Callable | None, progress: dict | None = None) -> Any:
    """nbmodel's ``_execute_snippet``: while it runs, its document is kept.

    A page with output recovery on polls ``progress`` (the outputs so far) and, where that snapshot
    disagrees with the document, writes the snapshot over the document: a snapshot taken before a
    display was updated in place puts its older frame back (measured: stale fastprogress frames
    saved beside the final table). So while the cell runs in a kept document the page is shown no
    snapshot, and reads the document alone; the final outputs (the request's result) still reach it.
    """
    room = _room_of(ydoc, metadata)
    if room is None:  # no document: the snapshots are the page's only way to the output
        return await original(client, ydoc, snippet, metadata, stdin_hook, progress)
    DOCUMENTS.started(room)
    try:
        return await original(client, ydoc, snippet, metadata, stdin_hook, {} if progress is not None else None)
    finally:
        DOCUMENTS.ended(room)


def _room_of(ydoc: Any, metadata: dict | None) -> str | None:
    """The collaboration room of the document a cell runs in: the page sends its id, else its path."""
    if not metadata:
        return None
    room = metadata.get("document_id")
    if isinstance(room, str) and room:
        return room
    path = metadata.get("document_path")
    if ydoc is None or not isinstance(path, str) or not path:
        return None
    try:
        from jupyter_server_ydoc.utils import encode_file_path, room_id_from_encoded_path

        file_id = ydoc.serverapp.web_app.settings["file_id_manager"].index(path)
        return room_id_from_encoded_path(encode_file_path("json", "notebook", file_id))
    except Exception:  # noqa: BLE001 - no room known: the cell runs, its document is not kept
        return None


# ------------------------------------------------------------------ output recovery on
def _install_recovery_default() -> None:
    from jupyterlab_server import handlers

    if _marked(handlers._get_overrides):
        return
    original = handlers._get_overrides

    def get_overrides(app_settings_dir: str) -> tuple[dict, str]:
        overrides, error = original(app_settings_dir)
        overrides.setdefault(RECOVERY_PLUGIN, {}).setdefault(RECOVERY_SETTING, True)
        return overrides, error

    handlers._get_overrides = _mark(get_overrides)
