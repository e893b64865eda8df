"""The supervisor hears its ranks exit, stop and continue as events, without polling them
(issue 26): an idle parent does no work per rank."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from dist_kernel.parent.launch.local import ProcessEvents


async def _next(events: asyncio.Queue, timeout: float = 10) -> int:
    return await asyncio.wait_for(events.get(), timeout)


@pytest.mark.timeout(60)
def test_a_child_that_stops_continues_and_exits_is_named_each_time_and_its_exit_code_stays_for_poll():
    # started as jupyter_client starts a rank: a plain Popen child of this process
    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    async def scenario() -> None:
        events: asyncio.Queue[int] = asyncio.Queue()
        watcher = ProcessEvents(events.put_nowait)
        assert watcher.available, "Linux with pidfd_open: the event path, not the polling fallback"
        try:
            watcher.watch(child.pid)
            child.send_signal(signal.SIGSTOP)
            assert await _next(events) == child.pid
            child.send_signal(signal.SIGCONT)
            assert await _next(events) == child.pid
            quiet.send_signal(signal.SIGSTOP)  # a child nobody watches is no news
            quiet.send_signal(signal.SIGCONT)
            child.kill()
            assert await _next(events) == child.pid
            assert events.empty()
            # nothing was reaped behind jupyter_client's back: poll() still gets the exit code
            assert child.poll() == -signal.SIGKILL
        finally:
            watcher.close()

    try:
        asyncio.run(scenario())
    finally:
        for p in (quiet, child):
            p.kill()
            p.wait()
