"""``%dist_top`` through a real kernel (issue 28, section 2): 2 ipykernel ranks, a real gloo group.

- While a sleeping cell runs, the table is one display (one display id) updated in place.
- In a hang (``%%rank 0`` around an all_reduce that rank 1 never enters) the table shows rank 0
  "in all_reduce" and rank 1 "idle"; the stop button ends the cell and the kernel goes on.

Nothing here asserts a timing: the bounds only keep a hang from passing.
"""

from __future__ import annotations

import threading

import pytest
from harness import DistKernel, Output, assert_group_works_and_variables_survived

pytestmark = pytest.mark.timeout(300)


def is_top(o: Output) -> bool:
    return o.msg_type in ("display_data", "update_display_data") and \
        bool(o.content.get("metadata", {}).get("dist_kernel", {}).get("top"))


def row(text: str, rank: int) -> str:
    return next(line for line in text.splitlines() if line.split()[:1] == [str(rank)])


def test_dist_top_updates_one_display_in_place_and_names_the_rank_waiting_in_a_collective():
    k = DistKernel("--ranks", "2", "--hang-grace", "600")
    try:
        res = k.execute("import time, torch, torch.distributed as dist\nkept = 100 + rank", timeout=120)
        assert res.status == "ok", res.explain()
        assert "dist_top: on" in k.execute("%dist_top", timeout=30).stream()

        res = k.execute("time.sleep(4)\nprint('slept')", timeout=60)
        assert res.status == "ok", res.explain()
        tables = [o for o in res.outputs if is_top(o)]
        assert len(tables) >= 3, [o.msg_type for o in res.outputs]
        assert tables[0].msg_type == "display_data"
        assert {o.msg_type for o in tables[1:]} == {"update_display_data"}
        assert len({o.content["transient"]["display_id"] for o in tables}) == 1
        assert any("running" in row(o.text, 0) and "time.sleep(4)" in row(o.text, 0) for o in tables)
        assert "text/html" in tables[0].content["data"] and "<table" in tables[0].content["data"]["text/html"]

        # a hang: rank 0 waits in all_reduce for rank 1, which is idle; seen, then stopped
        seen: list[str] = []
        fallback = threading.Timer(120, k.km.interrupt_kernel)  # never hang the suite

        def watch(o: Output) -> None:
            if is_top(o) and not seen and "in all_reduce" in row(o.text, 0) and "idle" in row(o.text, 1):
                seen.append(o.text)
                k.km.interrupt_kernel()  # the stop button

        fallback.start()
        try:
            res = k.execute("%%rank 0\ndist.all_reduce(torch.ones(1))", timeout=180, on_output=watch)
        finally:
            fallback.cancel()
        assert seen, "\n".join(o.text for o in res.outputs if is_top(o))[-3000:]
        assert "dist.all_reduce(torch.ones(1))" in row(seen[0], 0)
        assert res.status == "error", res.explain()

        assert_group_works_and_variables_survived(k)
        assert (k.execute("%dist_top off", timeout=30)).stream() == "dist_top: off\n"
        res = k.execute("time.sleep(2)", timeout=60)
        assert res.status == "ok" and not [o for o in res.outputs if is_top(o)], res.outputs
    finally:
        k.shutdown()
