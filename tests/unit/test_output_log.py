"""The kernel's output log (issue 35, item 5): its format, the text it shares with ``python -m
dist_kernel run``, rotation, owner-only files, which old logs go; and the kernel's hooks into it,
on the in-process parent with fake ranks."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import stat
import time

import pytest
from fake_ranks import Act, FakeRanks, stdout
from inprocess import Frontend

from dist_kernel.exceptions import ConfigError
from dist_kernel.options import KernelConfig, size_or_off
from dist_kernel.parent.log_file import KEEP_KERNELS, RotatingFile, log_path, prune
from dist_kernel.parent.output_log import OutputLog, Recorder
from dist_kernel.text_output import REDRAW_EVERY, TextOutput


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def bar(display_id: str, text: str, first: bool = False) -> tuple[str, dict]:
    return ("display_data" if first else "update_display_data",
            {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id}})


def stamp(text: str) -> str:
    """The log with its clock times and durations made constant."""
    text = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "DATE", text)
    text = re.sub(r"\d\d:\d\d:\d\d", "TIME", text)
    return re.sub(r"\d+\.\ds", "Ts", text)


# ------------------------------------------------------------------ the format
def test_a_cell_is_framed_by_its_number_and_times_with_its_merged_output_between():
    rec = Recorder(TextOutput(clock=Clock()))
    log = rec.started("m1", 3, "\n\n%%rank 0,1\nprint(rank)\n", wall=time.time())
    log += rec.output("m1", "execute_request", "stream", {"name": "stdout", "text": "same on both\n"})
    log += rec.output("m1", "execute_request", "stream", {"name": "stdout", "text": "[rank 0] 0\n[rank 1] 1\n"})
    log += rec.output("m1", "execute_request", "execute_result", {"data": {"text/plain": "[rank 0] 0\n[rank 1] 1"}})
    log += rec.output("m1", "execute_request", "stream", {"name": "stderr", "text": "a warning, no newline"})
    log += rec.output("m1", "execute_request", "error", {"traceback": ["\x1b[0;31mValueError\x1b[0m: bad shard"]})
    started = time.time()
    log += rec.ended("m1", "error", wall=started + 12.34)
    assert stamp(log) == (
        "\n── In [3] · DATE · %%rank 0,1 ──\n"
        "same on both\n[rank 0] 0\n[rank 1] 1\n"
        "[rank 0] 0\n[rank 1] 1\n"
        "a warning, no newline\n"  # an error starts a line of its own
        "ValueError: bad shard\n"  # colours gone
        "── In [3] failed after Ts · TIME ──\n")
    assert "12.3s" in log


def test_a_cells_end_a_later_threads_output_a_callbacks_and_a_silent_requests():
    rec = Recorder(TextOutput(clock=Clock()))
    t0 = time.time()
    log = rec.started("m1", 1, "x = 1", wall=t0) + rec.ended("m1", "ok", wall=t0 + 0.5)
    log += rec.started("m2", 2, "", wall=t0 + 1)
    log += rec.output("m1", "execute_request", "stream", {"name": "stdout", "text": "from a thread\n"})
    log += rec.output("m2", "execute_request", "stream", {"name": "stdout", "text": "cell 2 again\n"})
    log += rec.output("silent", "execute_request", "stream", {"name": "stdout", "text": "not a cell\n"})
    log += rec.output("w", "comm_msg", "stream", {"name": "stdout", "text": "clicked\n"})
    log += rec.output("m2", "execute_request", "clear_output", {"wait": True})  # erases nothing
    log += rec.ended("m2", "aborted", wall=t0 + 2)
    assert stamp(log) == (
        "\n── In [1] · DATE · x = 1 ──\n── In [1] done in Ts · TIME ──\n"
        "\n── In [2] · DATE ──\n"
        "── In [1], after it ended · TIME ──\nfrom a thread\n"
        "── In [2], continued · TIME ──\ncell 2 again\n"
        "── a widget's callback · TIME ──\nclicked\n"
        "── In [2] aborted after Ts · TIME ──\n")


def test_a_bar_redrawn_in_place_is_a_line_every_few_seconds_and_its_last_frame_before_what_follows():
    clock = Clock()
    rec = Recorder(TextOutput(clock=clock))
    log = rec.started("m", 1, "train()", wall=time.time())
    log += rec.output("m", "execute_request", *bar("b", "  0%|          | 0/100", first=True))
    step = 0.45
    for i in range(1, 101):  # 100 frames over 45 s
        clock.t += step
        log += rec.output("m", "execute_request", *bar("b", f"{i:3d}%|#         | {i}/100"))
    log += rec.output("m", "execute_request", "stream", {"name": "stdout", "text": "epoch 0: loss 0.5\n"})
    frames = [int(line.split("%")[0]) for line in log.splitlines() if "%|" in line]
    # the first, then the newest once every REDRAW_EVERY seconds, then the last
    assert frames == [0, 23, 46, 69, 92, 100] and REDRAW_EVERY / step == pytest.approx(22.2, abs=0.1)
    assert log.endswith("100%|#         | 100/100\nepoch 0: loss 0.5\n")  # its end, then the print
    # an HTML bar's text/plain never changes: it is written once
    log = rec.output("m", "execute_request", *bar("h", "<IPython.core.display.HTML object>", first=True))
    for _ in range(30):
        clock.t += 1
        log += rec.output("m", "execute_request", *bar("h", "<IPython.core.display.HTML object>"))
    assert log == "<IPython.core.display.HTML object>\n"


def test_a_carriage_return_line_is_written_as_lines_and_its_final_frame():
    clock = Clock()
    rec = Recorder(TextOutput(clock=clock))
    log = rec.started("m", 1, "loop", wall=time.time())
    for i in range(0, 101, 5):  # one rank's tqdm: \r frames, then its \n
        clock.t += 1
        log += rec.output("m", "execute_request", "stream", {"name": "stderr", "text": f"\r{i:3d}%|"})
    log += rec.output("m", "execute_request", "stream", {"name": "stderr", "text": "\n"})
    log += rec.output("m", "execute_request", "stream", {"name": "stderr", "text": "printed after\n"})
    body = log.split("──\n", 1)[1]
    assert "\r" not in body
    assert body == "  0%|\n 50%|\n100%|\nprinted after\n"  # the first, one per 10 s, the last
    # a bar left open at the cell's end (tqdm(leave=False) aside) still shows its last frame
    log = rec.output("m", "execute_request", "stream", {"name": "stdout", "text": "\r 10%"})
    log += rec.output("m", "execute_request", "stream", {"name": "stdout", "text": "\r 20%"})  # not due yet
    log += rec.ended("m", "ok", wall=time.time())
    assert stamp(log) == " 10%\n 20%\n── In [1] done in Ts · TIME ──\n"


def test_run_and_the_log_share_one_renderer_the_terminal_keeps_its_carriage_returns():
    term = TextOutput(keep_cr=True)
    assert term.feed("stream", {"name": "stdout", "text": "\r 50%"}) == [("stdout", "\r 50%")]
    assert not term.at_line_start
    # a rich output after an open line starts a line of its own; the status table is not output
    assert term.feed("display_data", {"data": {"text/plain": "df"}}) == [("stdout", "\ndf\n")]
    top = {"data": {"text/plain": "rank state"}, "metadata": {"dist_kernel": {"top": True}}}
    assert term.feed("display_data", top) == [] and term.feed("update_display_data", top) == []
    assert term.rule("cell 1/2 done in 1.0s") == "── cell 1/2 done in 1.0s ──\n"


# ------------------------------------------------------------------ the file
@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """Jupyter's runtime directory, here."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_the_log_lives_in_jupyters_runtime_dir_named_after_the_kernels_connection_file(runtime):
    assert log_path("/tmp/kernel-1f2e.json") == str(runtime / "dist_kernel" / "kernel-1f2e.log")


def test_the_file_is_owner_only_and_rotates_at_its_size_into_one_earlier_file(tmp_path):
    path = str(tmp_path / "dist_kernel" / "kernel-a.log")
    f = RotatingFile(path, max_bytes=100)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "dist_kernel").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        for i in range(25):
            f.write(f"line {i:02d}\n")  # 8 bytes each
        current, earlier = open(path).read(), open(path + ".1").read()
        assert len(current) <= 100 and len(earlier) <= 100 and current
        lines = (earlier + current).splitlines()  # the newest lines, in order, none lost between the two
        assert lines == [f"line {i:02d}" for i in range(25 - len(lines), 25)]
        assert not os.path.exists(path + ".2")
        assert stat.S_IMODE(os.stat(path + ".1").st_mode) == 0o600
        f.write("x" * 500 + "END\n")  # one write larger than the file: its end is kept
        text = open(path).read()
        assert text.endswith("END\n") and "bytes left out" in text and len(text) <= 100
    finally:
        f.close()


def test_a_directory_of_someone_else_or_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "dist_kernel")
    with pytest.raises(OSError, match="not a directory"):
        RotatingFile(str(tmp_path / "dist_kernel" / "kernel-a.log"), 1000)


def test_old_kernels_logs_go_the_newest_and_the_live_ones_stay(tmp_path):
    folder = tmp_path / "dist_kernel"
    folder.mkdir()
    now = time.time()
    names = [f"kernel-{i:02d}.log" for i in range(KEEP_KERNELS + 4)]
    for age, name in enumerate(names):  # kernel-00 is the newest
        for path in (folder / name, folder / (name + ".1")):
            path.write_text("x")
            os.utime(path, (now - 60 * age, now - 60 * age))
    live = open(folder / names[-1])  # the oldest log's kernel still runs
    fcntl.flock(live, fcntl.LOCK_EX)
    (folder / "notes.txt").write_text("not a log")
    try:
        removed = prune(str(folder))
    finally:
        live.close()
    left = sorted(p.name for p in folder.iterdir())
    assert sorted(os.path.basename(p) for p in removed) == sorted(
        n + s for n in names[KEEP_KERNELS:-1] for s in ("", ".1"))
    assert left == sorted([*(n + s for n in names[:KEEP_KERNELS] + names[-1:] for s in ("", ".1")), "notes.txt"])


def test_the_writer_thread_writes_what_the_kernel_queues_and_the_kernels_end(runtime):
    log = OutputLog.open("/tmp/kernel-k.json", KernelConfig(world_size=2, backend="gloo"))
    assert log.path == str(runtime / "dist_kernel" / "kernel-k.log")
    assert "tail -F" in log.note and "10 MB" in log.note
    request = {"header": {"msg_id": "m", "msg_type": "execute_request"}}
    log.cell_starts(request, 1, "print('hi')")
    log.output(request, "stream", {"name": "stdout", "text": "hi\n"})
    log.output(request, "status", {"execution_state": "idle"})  # not an output
    log.cell_ends(request, {"status": "ok"})
    log.close()
    text = open(log.path).read()
    assert "dist_kernel" in text.splitlines()[0] and "2 ranks" in text.splitlines()[0]
    assert re.search(r"── In \[1\] · .* · print\('hi'\) ──\nhi\n── In \[1\] done in", text)
    assert text.endswith(" ──\n") and "kernel ended" in text.splitlines()[-1]


def test_outputs_a_stalled_disk_could_not_take_are_counted_in_the_log(runtime, monkeypatch):
    from dist_kernel.parent import output_log

    log = OutputLog.open("kernel-k.json", KernelConfig(world_size=2, backend="gloo"))
    request = {"header": {"msg_id": "m", "msg_type": "execute_request"}}
    log.cell_starts(request, 1, "print('a lot')")
    monkeypatch.setattr(output_log, "MAX_QUEUED", 0)  # as if the queue were full: the writer is stuck
    for _ in range(3):
        log.output(request, "stream", {"name": "stdout", "text": "lost\n"})
    monkeypatch.setattr(output_log, "MAX_QUEUED", 20_000)
    log.output(request, "stream", {"name": "stdout", "text": "kept\n"})
    log.close()
    text = open(str(log.path)).read()
    assert "── 3 outputs left out of this log: the disk did not keep up (the notebook has them) ──\n" in text
    assert "lost" not in text and "kept\n" in text


def test_the_log_is_off_when_asked_or_when_it_cannot_be_made(runtime):
    off = OutputLog.open("kernel-k.json", KernelConfig(world_size=2, backend="gloo", output_log=0))
    assert off.path is None and off.note == "off (--output-log off)"
    off.output({"header": {}}, "stream", {"name": "stdout", "text": "x"})  # does nothing
    (runtime / "dist_kernel").write_text("a file where the folder would be")
    broken = OutputLog.open("kernel-k.json", ConfigError("bad"))
    assert broken.path is None and broken.note.startswith("off: ")


def test_the_size_option_reads_sizes_and_off():
    assert size_or_off("--output-log", "10MB") == 10 << 20
    assert size_or_off("--output-log", "512 KiB") == 512 << 10
    assert size_or_off("--output-log", "1.5g") == int(1.5 * (1 << 30))
    assert size_or_off("--output-log", "off") == 0 == size_or_off("--output-log", "0")
    assert KernelConfig(world_size=1, backend="gloo").output_log == 10 << 20
    with pytest.raises(ConfigError, match="below 4KB"):
        size_or_off("--output-log", "100")
    with pytest.raises(ConfigError, match=r"--output-log 'ten' is neither a size"):
        size_or_off("--output-log", "ten")


# ------------------------------------------------------------------ the kernel's hooks
def test_the_kernel_logs_each_cell_with_its_number_and_dist_status_names_the_file(runtime):
    async def main() -> str:  # the log's path
        fe = Frontend()
        ranks = FakeRanks(fe.kernel, world_size=2, script=lambda rank, code: Act(
            out=[stdout(f"rank says {rank}\n")]) if "say" in code else Act())
        fe.kernel.dist_config = ranks.config
        fe.kernel.attach(ranks)
        fe.kernel.output_log = log = OutputLog.open("kernel-k.json", ranks.config)
        await ranks.start()
        try:
            assert (await fe.execute("say")).status == "ok"
            await fe.execute("quiet", silent=True)  # a frontend's own request: not in the log
            status = await fe.execute("%dist_status")
        finally:
            fe.close()
            log.close()
        text = next(c["data"]["text/plain"] for t, c in status.outputs if t == "display_data")
        assert f"output log: {log.path} (rotated at 10 MB" in text
        return str(log.path)

    text = open(asyncio.run(main())).read()
    cells = re.findall(r"── In \[(\d)\] · [^\n]* ──\n(.*?)── In \[\d\] done in", text, re.S)
    assert [c[0] for c in cells] == ["1", "2"]
    assert cells[0][1] == "[rank 0] rank says 0\n[rank 1] rank says 1\n"  # merged and labelled as in the notebook
    assert "output log:" in cells[1][1] and "quiet" not in text

