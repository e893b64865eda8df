"""The lab itself, before any kernel (tests/cluster/lab.sh, cluster_lab.py): the packet capture
sees plaintext across the lab's links, and the namespace listings see what runs on the nodes;
the security checks of cluster kernels rest on these.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from cluster_lab import (
    NODES,
    Capture,
    assert_capture_sees_markers,
    listeners,
    ns_procs,
    our_procs,
    send_markers,
    wait_until,
)

pytestmark = pytest.mark.slow


def test_the_capture_sees_plaintext_across_the_lab_links(lab):
    with Capture() as cap:
        markers = send_markers()
    assert_capture_sees_markers(cap, markers)
    assert not cap.holds(f"dk-never-sent-{uuid.uuid4().hex}")  # and finds only what was sent


def test_the_namespace_process_listing_sees_a_process_started_in_a_node(lab):
    tag = f"dist_kernel-listing-check-{uuid.uuid4().hex[:8]}"
    p = subprocess.Popen(["ip", "netns", "exec", "n2", sys.executable, "-c",
                          "import sys, time; time.sleep(30)", tag])
    try:
        found = wait_until(lambda: [q for q in our_procs() if tag in q.cmdline], 10)
        assert found and found[0].ns == "n2" and found[0].pid == p.pid
        assert not [q for q in ns_procs("n1") if tag in q.cmdline]
    finally:
        p.kill()
        p.wait()
    assert wait_until(lambda: not [q for q in our_procs() if tag in q.cmdline], 5)


def test_the_listener_listing_sees_the_nodes_sshd_and_slurmd(lab):
    for ns, addr in NODES.items():
        ls = listeners(ns)
        assert any(x.port == 22 and x.comm == "sshd" and x.addr == addr for x in ls), ls
        assert any(x.comm == "slurmd" for x in ls), ls

