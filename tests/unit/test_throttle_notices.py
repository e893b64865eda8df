"""Issue 30, section 4: what the output budget always sends, and how it says what it did not."""

from __future__ import annotations

from dist_kernel.parent.throttle import OutputBudget, StreamThrottle, not_shown_note


def throttle(tmp_path, now: list[float], budget: OutputBudget | None = None, **kw):
    shown: list[tuple[str, dict]] = []
    budget = budget or OutputBudget(clock=lambda: now[0], spill_dir=str(tmp_path), **kw)
    return StreamThrottle(lambda t, c: shown.append((t, c)), budget=budget), shown


def notes(shown: list[tuple[str, dict]]) -> str:
    return "".join(c["text"] for t, c in shown if t == "stream" and c["name"] == "stderr")


def test_a_cells_result_after_a_flood_is_shown_after_the_last_lines(tmp_path):
    now = [0.0]
    th, shown = throttle(tmp_path, now)
    th.publish("stream", {"name": "stdout", "text": "x" * 1_000_000 + "\n"})
    th.publish("stream", {"name": "stdout", "text": "x" * 1_000_000 + "\n"})
    result = {"data": {"text/plain": "1000001"}, "metadata": {}, "execution_count": 1}
    th.publish("execute_result", result)
    assert not any(t == "execute_result" for t, _ in shown)  # not before the notice and the last lines
    th.close()
    assert shown[-1] == ("execute_result", result)
    assert "2 lines (1.9 MiB) were not shown" in notes(shown)  # the result is not among what was not
    assert open(th.spill_path).read().endswith("x\n1000001\n")  # the file is the full output, in order


def test_an_error_shown_while_spilling_is_sent_too(tmp_path):
    now = [0.0]
    th, shown = throttle(tmp_path, now)
    th.publish("stream", {"name": "stdout", "text": "y" * 3_000_000})
    error = {"ename": "ValueError", "evalue": "boom", "traceback": ["ValueError: boom"]}
    th.publish("error", error)
    th.close()
    assert ("error", error) in shown


def test_results_and_errors_are_sent_past_the_message_rate(tmp_path):
    now = [0.0]
    th, shown = throttle(tmp_path, now, msg_rate=1, msg_burst=2)
    for i in range(5):
        th.publish("display_data", {"data": {"text/plain": str(i)}, "metadata": {}})
    th.publish("execute_result", {"data": {"text/plain": "'done'"}, "metadata": {}})
    th.close()
    assert [c["data"]["text/plain"] for t, c in shown if t != "stream"] == ["0", "1", "'done'"]
    assert "3 outputs were not shown" in notes(shown)


def test_a_huge_line_without_a_newline_counts_as_one_line(tmp_path):
    now = [0.0]
    th, shown = throttle(tmp_path, now)
    th.publish("stream", {"name": "stdout", "text": "z" * 1_500_000})
    th.publish("stream", {"name": "stdout", "text": "z" * 1_500_000})  # the same line, continued
    th.close()
    assert "1 line (2.9 MiB) was not shown" in notes(shown)


def test_the_lines_of_two_streams_are_counted_apart(tmp_path):
    now = [0.0]
    th, shown = throttle(tmp_path, now)
    th.publish("stream", {"name": "stdout", "text": "a" * 2_000_000})
    th.publish("stream", {"name": "stderr", "text": "b\nc"})
    th.publish("stream", {"name": "stdout", "text": "a\nd\n"})
    th.close()
    assert "4 lines" in notes(shown)  # a..a, b, c, d


def test_the_notice_agrees_in_number():
    assert "1 output was not shown" in not_shown_note(0, 0, 1, "/f")
    assert "2 outputs were not shown" in not_shown_note(0, 0, 2, "/f")
    assert "1 line (0.0 MiB) was not shown" in not_shown_note(1, 10, 0, "/f")
    assert "3 lines (0.0 MiB) were not shown" in not_shown_note(3, 10, 0, "/f")
    assert "1 line (0.0 MiB) and 1 output were not shown" in not_shown_note(1, 10, 1, "/f")
    assert not_shown_note(0, 0, 0, "/f") == "[dist_kernel] full output: /f\n"
