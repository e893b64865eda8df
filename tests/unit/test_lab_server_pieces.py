"""``python -m dist_kernel lab`` (issue 35): its command line, and its pieces in the server's own
packages (jupyter-server-nbmodel's output hook on a real shared notebook, jupyter-server-ydoc's
cleanup, JupyterLab's settings default). No server, no process: the packages of the ``lab`` extra,
imported."""

from __future__ import annotations

import asyncio
import json

import pytest

from dist_kernel import cli
from dist_kernel.lab import launch, nbmodel


def _msg(msg_type: str, content: dict) -> dict:
    return {"header": {"msg_type": msg_type, "msg_id": "m", "date": "2026-01-01T00:00:00Z", "session": "s",
                       "username": "u", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "content": content}


def _bar(text: str, display_id: str = "bar") -> dict:
    return {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id}}


@pytest.fixture
def server_cell():
    """nbmodel's output hook for one execution, with dist_kernel's pieces in, writing into a code
    cell of a real shared notebook: (send(msg_type, content), cell outputs, polled outputs)."""
    from jupyter_server_nbmodel import actions
    from jupyter_ydoc import YNotebook

    assert nbmodel.install() == []
    nb = YNotebook()
    nb.append_cell({"cell_type": "code", "source": "", "metadata": {}, "outputs": [], "execution_count": None,
                    "id": "c1"})
    ycell = nb.ycells[0]
    polled: list = []
    state = actions._StreamState()

    def send(msg_type: str, content: dict) -> None:
        actions._output_hook(polled, ycell, state, _msg(msg_type, content))

    return send, lambda: ycell["outputs"].to_py(), polled


def _texts(outputs: list) -> list[str]:
    return [o["data"]["text/plain"] if "data" in o else "".join(o["text"]) for o in outputs]


def test_the_server_saves_an_updated_display_at_its_final_frame_once(server_cell):
    send, cell, polled = server_cell
    send("stream", {"name": "stdout", "text": "[rank 0] line 1\n"})
    send("display_data", _bar("bar 0%"))
    for pct in range(10, 101, 10):
        send("update_display_data", _bar(f"bar {pct}%"))
    send("stream", {"name": "stdout", "text": "[rank 0] line 2\n"})
    assert _texts(cell()) == ["[rank 0] line 1\n", "bar 100%", "[rank 0] line 2\n"]
    # what a page polls for (output recovery) says the same, or the page would put the first frame back
    assert _texts(polled) == ["[rank 0] line 1\n", "bar 100%", "[rank 0] line 2\n"]


def test_the_server_clears_a_cell_with_clear_output_wait_at_its_next_output(server_cell):
    send, cell, polled = server_cell
    send("display_data", {"data": {"text/plain": "frame 1"}, "metadata": {}})
    send("clear_output", {"wait": True})
    assert _texts(cell()) == ["frame 1"]  # not an empty cell between two frames
    send("display_data", {"data": {"text/plain": "frame 2"}, "metadata": {}})
    assert _texts(cell()) == ["frame 2"] == _texts(polled)


def test_installing_twice_changes_nothing_more():
    from jupyter_server_nbmodel import actions
    from jupyter_server_ydoc.handlers import YDocWebSocketHandler
    from jupyterlab_server import handlers

    nbmodel.install()
    hooks = (actions._output_hook, actions._execute_snippet, YDocWebSocketHandler._clean_room,
             handlers._get_overrides, actions._StreamState)
    assert nbmodel.install() == []
    assert (actions._output_hook, actions._execute_snippet, YDocWebSocketHandler._clean_room,
            handlers._get_overrides, actions._StreamState) == hooks


def test_output_recovery_defaults_to_on_and_a_users_override_file_wins(tmp_path):
    from jupyterlab_server import handlers

    nbmodel.install()
    overrides, _error = handlers._get_overrides(str(tmp_path))
    assert overrides[nbmodel.RECOVERY_PLUGIN] == {"outputRecovery": True}
    (tmp_path / "overrides.json").write_text(json.dumps({nbmodel.RECOVERY_PLUGIN: {"outputRecovery": False}}))
    overrides, _error = handlers._get_overrides(str(tmp_path))
    assert overrides[nbmodel.RECOVERY_PLUGIN] == {"outputRecovery": False}


def test_a_running_cell_keeps_its_document_and_the_cleanup_waits_for_it():
    from jupyter_server_ydoc.handlers import YDocWebSocketHandler

    nbmodel.install()
    cleaned: list[str] = []

    class Handler:  # what _clean_room reads of its handler; the original then deletes the room
        _room_id = "json:notebook:abc"
        _cleanup_delay = 0.02

    async def scenario() -> None:
        release = asyncio.Event()

        async def cell(*_args) -> str:
            await release.wait()
            return "reply"

        run = asyncio.ensure_future(nbmodel.execute_snippet(cell, None, None, "code",
                                                            {"document_id": Handler._room_id}, None))
        await asyncio.sleep(0)
        clean = asyncio.ensure_future(YDocWebSocketHandler._clean_room(Handler()))
        await asyncio.sleep(0.1)
        cleaned.append("running: room " + ("gone" if clean.done() else "kept"))
        release.set()
        assert await run == "reply"
        with pytest.raises(AttributeError):  # the original cleanup ran: our stand-in has no room
            await asyncio.wait_for(clean, 1)
        cleaned.append("ended: cleaned")

    asyncio.run(scenario())
    assert cleaned == ["running: room kept", "ended: cleaned"]


def test_lab_without_the_extra_fails_at_once_naming_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(launch.importlib.util, "find_spec",
                        lambda name: None if name == "jupyter_server_nbmodel" else object())
    assert cli.main(["lab", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "jupyter-server-nbmodel" in err and 'pip install "dist-kernel[lab]"' in err


def test_lab_says_where_output_is_kept_and_passes_every_option_through():
    argv = ["--port", "8888", "notebook.ipynb", "--YDocExtension.document_cleanup_delay=5", "--help-all"]
    assert launch.extension_args(argv) == [*argv, "--ServerApp.jpserver_extensions=dist_kernel.lab=True"]
    text = launch.banner(argv)
    assert "saved to its .ipynb file" in text and "forgotten 5 s after its last cell ended" in text
    assert "forgotten 60 s after" in launch.banner([])
    assert "never forgotten" in launch.banner(["--YDocExtension.document_cleanup_delay", "None"])


def test_a_page_polling_a_cell_of_a_kept_document_gets_no_snapshot_to_write_over_it():
    """Output recovery: a page writes a polled snapshot over the document where they disagree, and
    a snapshot taken before a display was updated would put its old frame back. While the cell runs
    in a document, the page reads the document alone; without a document, the snapshots go on."""
    async def cell(client, ydoc, snippet, metadata, stdin_hook, progress):
        if progress is not None:
            progress["outputs"] = ["bar 0%"]  # what nbmodel shows a polling page, as it comes
        return {"status": "ok", "outputs": '["bar 100%"]'}

    async def scenario(metadata: dict) -> dict:
        polled = {"pending": True, "outputs": []}
        result = await nbmodel.execute_snippet(cell, None, None, "code", metadata, None, polled)
        assert result["outputs"] == '["bar 100%"]'  # the result, with the final outputs, is the page's
        return polled

    assert asyncio.run(scenario({"document_id": "json:notebook:abc"}))["outputs"] == []
    assert asyncio.run(scenario({}))["outputs"] == ["bar 0%"]
