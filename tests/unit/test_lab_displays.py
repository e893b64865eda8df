"""Displays updated in place under server-side execution (issue 35): what the server does with each
message of a cell (dist_kernel.lab.displays), and when a document whose page closed may go
(dist_kernel.lab.documents). Pure: no server, no pycrdt."""

from __future__ import annotations

import asyncio

from dist_kernel.lab.displays import CellDisplays, Place, Step
from dist_kernel.lab.documents import RunningDocuments


def _display(text: str, display_id: str | None = None) -> dict:
    content: dict = {"data": {"text/plain": text}, "metadata": {}}
    if display_id is not None:
        content["transient"] = {"display_id": display_id}
    return content


class Cell:
    """A notebook cell as the server writes it, driven by CellDisplays the way dist_kernel.lab.nbmodel
    drives it: the outputs a frontend that ignores updates (jupyter-server-nbmodel) ends with."""

    def __init__(self) -> None:
        self.displays = CellDisplays()
        self.outputs: list[dict] = []

    def send(self, msg_type: str, content: dict) -> Step:
        step = self.displays.step(msg_type, content)
        if step.clear_first:
            self.outputs.clear()
        if step.replace is not None:
            display_id, output = step.replace
            for place in self.displays.where(display_id):
                self.outputs[place.message] = output
        if step.forward:
            if msg_type == "clear_output":
                self.outputs.clear()
            elif msg_type != "update_display_data":
                self.outputs.append({"output_type": msg_type, **{k: v for k, v in content.items() if k != "transient"}})
        if step.remember is not None:
            self.displays.remember(step.remember, Place(len(self.outputs) - 1, len(self.outputs) - 1))
        return step

    def texts(self) -> list[str]:
        return [o.get("data", {}).get("text/plain", o.get("text", "")) for o in self.outputs]


def test_an_updated_display_ends_at_its_final_frame_once_between_the_lines_around_it():
    cell = Cell()
    cell.send("stream", {"name": "stdout", "text": "[rank 0] epoch 0\n"})
    cell.send("display_data", _display("bar 0%", "bar"))
    for pct in (10, 50, 100):
        cell.send("update_display_data", _display(f"bar {pct}%", "bar"))
    cell.send("stream", {"name": "stdout", "text": "[rank 0] done\n"})
    assert cell.texts() == ["[rank 0] epoch 0\n", "bar 100%", "[rank 0] done\n"]
    assert cell.outputs[1]["output_type"] == "display_data"


def test_each_output_of_a_display_id_shown_twice_is_updated_and_others_are_not():
    cell = Cell()
    cell.send("display_data", _display("a0", "a"))
    cell.send("display_data", _display("b0", "b"))
    cell.send("display_data", _display("a0", "a"))
    cell.send("update_display_data", _display("a1", "a"))
    assert cell.texts() == ["a1", "b0", "a1"]


def test_an_update_of_a_display_this_cell_never_showed_changes_nothing():
    cell = Cell()
    cell.send("display_data", _display("mine", "mine"))
    step = cell.send("update_display_data", _display("other", "from-an-earlier-cell"))
    assert step == Step()
    assert cell.texts() == ["mine"]


def test_clear_output_wait_clears_at_the_next_output_not_before():
    cell = Cell()
    cell.send("display_data", _display("frame 1"))
    step = cell.send("clear_output", {"wait": True})
    assert step == Step() and cell.texts() == ["frame 1"]  # a page closed now keeps the last frame
    step = cell.send("display_data", _display("frame 2"))
    assert step.clear_first and step.forward
    assert cell.texts() == ["frame 2"]
    cell.send("clear_output", {"wait": True})
    cell.send("clear_output", {"wait": True})
    cell.send("stream", {"name": "stdout", "text": "frame 3\n"})
    assert cell.texts() == ["frame 3\n"]


def test_an_update_while_a_clear_waits_updates_the_display_still_shown():
    cell = Cell()
    cell.send("display_data", _display("0%", "bar"))
    cell.send("clear_output", {"wait": True})
    cell.send("update_display_data", _display("50%", "bar"))
    assert cell.texts() == ["50%"]
    cell.send("stream", {"name": "stdout", "text": "after\n"})
    assert cell.texts() == ["after\n"]
    cell.send("update_display_data", _display("100%", "bar"))  # cleared: the display is gone
    assert cell.texts() == ["after\n"]


def test_clear_output_without_wait_clears_at_once_and_forgets_the_displays():
    cell = Cell()
    cell.send("display_data", _display("0%", "bar"))
    step = cell.send("clear_output", {"wait": False})
    assert step.forward and not step.clear_first
    assert cell.texts() == []
    cell.send("update_display_data", _display("100%", "bar"))
    assert cell.texts() == []


def test_an_execute_result_with_a_display_id_is_updated_too_and_other_messages_pass():
    cell = Cell()
    content = {**_display("r0", "res"), "execution_count": 3}
    assert cell.send("execute_result", content).remember == "res"
    cell.send("update_display_data", _display("r1", "res"))
    assert cell.texts() == ["r1"]
    assert cell.displays.step("status", {"execution_state": "idle"}) == Step(forward=True)


def test_a_document_is_forgotten_only_once_its_cells_ended_and_the_delay_passed():
    async def scenario() -> list[str]:
        docs = RunningDocuments()
        events: list[str] = []
        docs.started("room")
        forget = asyncio.ensure_future(docs.forget_when_idle("room", 0.05))
        await asyncio.sleep(0.1)
        events.append(f"while running: {'forgotten' if forget.done() else 'kept'}")
        docs.ended("room")
        await asyncio.sleep(0.01)
        docs.started("room")  # "Run All": the next cell starts within the delay
        await asyncio.sleep(0.1)
        events.append(f"next cell running: {'forgotten' if forget.done() else 'kept'}")
        docs.ended("room")
        await asyncio.wait_for(forget, 1)
        events.append("forgotten after the last cell")
        assert not docs.running("room")
        await asyncio.wait_for(docs.forget_when_idle("other", 0), 1)  # no cell: at once
        return events

    assert asyncio.run(scenario()) == ["while running: kept", "next cell running: kept",
                                       "forgotten after the last cell"]


def test_two_running_cells_of_one_document_keep_it_until_both_ended():
    async def scenario() -> None:
        docs = RunningDocuments()
        docs.started("room")
        docs.started("room")
        docs.ended("room")
        assert docs.running("room")
        waiter = asyncio.ensure_future(docs.until_idle("room"))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        docs.ended("room")
        await asyncio.wait_for(waiter, 1)

    asyncio.run(scenario())
