"""The output budget, as a specification: floods of merged output cut to what a notebook can show,
nothing lost (dist_kernel.parent.throttle behind the merger)."""

from __future__ import annotations

import os


class TestThrottle:
    def test_a_flood_is_cut_to_head_and_tail_with_the_full_text_saved(self, tmp_path):
        from dist_kernel.parent.throttle import StreamThrottle

        shown: list[tuple[str, dict]] = []
        now = [0.0]
        th = StreamThrottle(lambda t, c: shown.append((t, c)), rate=1000, burst=2000,
                            clock=lambda: now[0], spill_dir=str(tmp_path))
        lines = [f"line {i}\n" for i in range(1000)]
        for i in range(0, 1000, 10):
            th.publish("stream", {"name": "stdout", "text": "".join(lines[i:i + 10])})
            now[0] += 0.01
        th.close()
        first_note = next(i for i, (_, c) in enumerate(shown) if c["name"] == "stderr")
        live = "".join(c["text"] for _, c in shown[:first_note])
        tail = "".join(c["text"] for _, c in shown[first_note:] if c["name"] == "stdout")
        assert live.startswith("line 0\n") and len(live) <= 2000 + 1000 * now[0]  # burst + rate
        assert tail == "".join(lines[-20:])  # the cell's final lines are delivered
        assert live + open(th.spill_path).read() == "".join(lines)  # and nothing is lost
        notes = "".join(c["text"] for _, c in shown if c["name"] == "stderr")
        assert th.spill_path in notes and "were not shown" in notes

    def test_ordinary_output_passes_untouched(self):
        from dist_kernel.parent.throttle import StreamThrottle

        shown = []
        th = StreamThrottle(lambda t, c: shown.append(c["text"]))
        th.publish("stream", {"name": "stdout", "text": "hello\n"})
        th.close()
        assert shown == ["hello\n"]


class TestOutputBudget:
    @staticmethod
    def throttle(tmp_path, clock, budget=None, **kw):
        from dist_kernel.parent.throttle import OutputBudget, StreamThrottle

        shown: list[tuple[str, dict]] = []
        budget = budget or OutputBudget(clock=lambda: clock[0], spill_dir=str(tmp_path), **kw)
        return StreamThrottle(lambda t, c: shown.append((t, c)), budget=budget), shown

    def test_rich_outputs_past_the_message_rate_go_to_the_file_as_text_and_are_counted(self, tmp_path):
        now = [0.0]
        th, shown = self.throttle(tmp_path, now, msg_rate=10, msg_burst=20)
        for i in range(100):
            th.publish("display_data", {"data": {"text/plain": str(i)}, "metadata": {}})
        th.close()
        displays = [int(c["data"]["text/plain"]) for t, c in shown if t == "display_data"]
        notes = "".join(c["text"] for t, c in shown if t == "stream")
        assert displays == list(range(20)) and "80 outputs were not shown" in notes
        assert [int(line) for line in open(th.spill_path)] == list(range(20, 100))
        assert os.path.dirname(th.spill_path) == str(tmp_path)

    def test_no_stream_message_is_longer_than_the_limit(self, tmp_path):
        from dist_kernel.parent.throttle import MAX_MESSAGE

        now = [0.0]
        th, shown = self.throttle(tmp_path, now, burst=10_000_000)
        text = "".join(f"{i}\n" for i in range(500_000))  # 3.4 MB in one message
        th.publish("stream", {"name": "stdout", "text": text})
        assert max(len(c["text"]) for _, c in shown) <= MAX_MESSAGE
        assert "".join(c["text"] for _, c in shown) == text

    def test_a_huge_line_goes_to_the_file_and_its_tail_is_bounded(self, tmp_path):
        from dist_kernel.parent.throttle import TAIL_BYTES

        now = [0.0]
        th, shown = self.throttle(tmp_path, now)
        th.publish("stream", {"name": "stdout", "text": "y" * 10_000_000})
        th.close()
        assert sum(len(c["text"]) for _, c in shown) < 2 * TAIL_BYTES
        assert "more characters in the file" in shown[-1][1]["text"]
        assert open(th.spill_path).read() == "y" * 10_000_000
        assert th._file is None  # closed

    def test_the_budget_spans_cells_and_output_after_a_cell_ended(self, tmp_path):
        from dist_kernel.parent.throttle import OutputBudget

        now = [0.0]
        budget = OutputBudget(rate=1000, burst=2000, clock=lambda: now[0], spill_dir=str(tmp_path))
        first, shown1 = self.throttle(tmp_path, now, budget)
        first.publish("stream", {"name": "stdout", "text": "x" * 1500 + "\n"})
        first.close()
        first.publish("stream", {"name": "stdout", "text": "late " * 200 + "\n"})  # a background thread
        assert "after its cell ended" in shown1[-1][1]["text"] and first._file is None
        second, shown2 = self.throttle(tmp_path, now, budget)
        second.publish("stream", {"name": "stdout", "text": "z" * 600 + "\n"})
        assert "faster than a notebook can show" in shown2[0][1]["text"]
        now[0] += 10  # quiet: the late output is shown again, after saying what was not
        first.publish("stream", {"name": "stdout", "text": "back\n"})
        assert "1 line (0.0 MiB) was not shown" in shown1[-3][1]["text"] and shown1[-1][1]["text"] == "back\n"

    def test_the_newest_state_of_a_display_updated_while_spilling_is_shown_at_the_end(self, tmp_path):
        now = [0.0]
        th, shown = self.throttle(tmp_path, now, msg_burst=5, msg_rate=1)
        for i in range(50):
            th.publish("update_display_data", {"data": {"text/plain": f"{i}%"}, "metadata": {},
                                               "transient": {"display_id": "bar"}})
        th.close()
        assert shown[-1] == ("update_display_data", {"data": {"text/plain": "49%"}, "metadata": {},
                                                     "transient": {"display_id": "bar"}})

    def test_a_message_of_wide_characters_is_cut_by_its_bytes(self, tmp_path):
        from dist_kernel.parent.throttle import MAX_MESSAGE

        now = [0.0]
        th, shown = self.throttle(tmp_path, now, burst=10_000_000)
        text = "€" * 200_000 + "a" * 400_000  # 1 MB, the wide characters first
        th.publish("stream", {"name": "stdout", "text": text})
        assert max(len(c["text"].encode()) for _, c in shown) <= MAX_MESSAGE
        assert "".join(c["text"] for _, c in shown) == text

    def test_the_last_lines_keep_carriage_return_progress_as_one_line(self, tmp_path):
        now = [0.0]
        th, shown = self.throttle(tmp_path, now, burst=3)  # not even one line fits
        th.publish("stream", {"name": "stdout", "text": "start\n10%\r20%\r30%\ndone\n"})
        th.close()
        assert shown[-1][1]["text"] == "start\n10%\r20%\r30%\ndone\n"

