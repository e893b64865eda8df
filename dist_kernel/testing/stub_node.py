"""A stub node agent: the real agent's wire to the parent, with stub ranks behind it.

    python -m dist_kernel.testing.stub_node --parent tcp://ADDR:PORT --node-rank I

Started by ``--launcher stub`` (:class:`~dist_kernel.parent.launch.node_starters.stub.StubNodeStarter`)
where ssh would start ``python -m dist_kernel.node``, with the same argv and the same key line
on stdin. To the parent it is a node agent (:mod:`dist_kernel.node.agent`): it connects out
over CurveZMQ, says hello, starts its ranks when told, takes the parent's fan messages (signed
here for each rank with its key), sends what its ranks say in one batch per turn, beats every
half second with the ranks whose state changed, reports a rank that exits, and signals ranks
when asked. Its ranks are :class:`~dist_kernel.testing.stub_rank.StubRank` objects in this one
process, each with its own HMAC key and session, so a node of 64 ranks costs one small
process. One thread: a ZMQ poll on the parent's connection and the ranks' timers.

How the ranks answer comes from the environment (the parent's, which the node starter passes
on): ``DIST_KERNEL_STUB_DELAY_MS`` before each cell's first step, plus up to
``DIST_KERNEL_STUB_JITTER_MS`` at random.

It ends when the parent says ``stop``, falls silent for :data:`~dist_kernel.tunnel.LOST_AFTER`
seconds, or closes its stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time

import zmq

from dist_kernel import tunnel
from dist_kernel.node.agent import read_bootstrap
from dist_kernel.placement import rank_of
from dist_kernel.testing.stub_rank import StubBehaviour, StubRank, Timers
from dist_kernel.tunnel.keys import Bootstrap
from dist_kernel.tunnel.link import LinkWatch, agent_socket
from dist_kernel.tunnel.turns import Signer, Turn

DELAY_ENV = "DIST_KERNEL_STUB_DELAY_MS"
JITTER_ENV = "DIST_KERNEL_STUB_JITTER_MS"
#: messages from the parent handled per turn before the timers get theirs
_BATCH = 500


def behaviour_from(environ: dict[str, str] | os._Environ) -> StubBehaviour:
    return StubBehaviour(delay=float(environ.get(DELAY_ENV, "0") or 0) / 1000,
                         jitter=float(environ.get(JITTER_ENV, "0") or 0) / 1000)


class StubNode:
    """One stub node: the parent's connection, its stub ranks and their timers."""

    def __init__(self, parent: str, node: int, boot: Bootstrap, behaviour: StubBehaviour) -> None:
        self.parent = parent
        self.node = node
        self.boot = boot
        self.behaviour = behaviour
        self.host = f"stub-node{node}"  # never this machine's name: the parent must not end these "pids" itself
        self.ctx = zmq.Context()
        self.timers = Timers()
        self.ranks: dict[int, StubRank] = {}
        self.exits: dict[int, int] = {}
        self.signer = Signer(boot.rank_keys)
        self.turn = Turn(self.signer)  # what the ranks said this turn, as the real agent sends it
        self.beaten: dict[int, tuple] = {}  # each rank's state as the last beat told the parent
        self.sampling = False  # the parent's beats ask for loads (%dist_top): a beat each time then
        self.stdin_closed = threading.Event()
        self.ending = ""

    def connect(self) -> None:
        sock = agent_socket(self.ctx, self.boot, self.node)  # as the real agent's
        self.link = LinkWatch(sock)
        sock.connect(self.parent)
        self.sock = sock
        hello = {"type": "hello", "node": self.node, "host": self.host, "address": "127.0.0.1",
                 "ifname": "lo", "pid": os.getpid(), "job": None, "step": None}
        if self.node == 0:  # the ports of rank 0's rendezvous: stub ranks form no group
            hello["master_port"], hello["user_port"] = 1, 2
        self.send_ctl(hello)

    def send_ctl(self, event: dict) -> None:
        self.flush()  # after what the ranks said before it (a rank's last output, then its exit)
        self.sock.send_multipart(tunnel.pack_ctl(self.boot.hmac_key, event))

    def flush(self) -> None:
        """What the ranks said since the last flush, as one batch (as the real agent does per turn)."""
        for frames in self.turn.pack(self.boot.hmac_key):
            self.sock.send_multipart(frames)

    def start_ranks(self) -> None:
        boot = self.boot
        for local in range(boot.ranks_per_node):
            rank = rank_of(self.node, local, boot.ranks_per_node)
            def send(channel: bytes, frames: list[bytes], rank: int = rank) -> None:
                self.turn.add(rank, channel, frames)

            self.ranks[rank] = StubRank(rank, boot.world_size, boot.rank_keys[str(rank)].encode(), self.host,
                                        os.getpid(), send, self._exited, self.timers, self.behaviour)
        self.send_ctl({"type": "started", "node": self.node, "ranks": {str(r): os.getpid() for r in self.ranks}})

    def _exited(self, rank: StubRank, code: int) -> None:
        self.exits[rank.rank] = code
        self.send_ctl({"type": "exited", "rank": rank.rank, "code": code,
                       "log": f"stub rank {rank.rank} exited with code {code}\n"})

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        while not self.ending:
            wait = self.timers.wait(max(0.0, min(0.1, self.link.next_beat - time.monotonic())))
            if self.sock.poll(int(wait * 1000) if wait > 0 else 0, zmq.POLLIN):
                for _ in range(_BATCH):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.from_parent(frames)
            self.timers.run_due()
            self.flush()
            self.link.read()
            self.ending = self.link.turn(self.beat, self.stdin_closed.is_set(), "the harness ended")

    def beat(self) -> None:
        """The same beat as the real agent's: the pid, state and exit code of each rank whose
        state changed since the last beat."""
        states = {}
        for r, s in self.ranks.items():
            st = (s.pid, "" if s.exit_code is not None else "S", s.exit_code)
            if self.beaten.get(r) != st:
                self.beaten[r] = st
                states[str(r)] = {"pid": st[0], "state": st[1], "exit": st[2]}
        if states or self.sampling:  # the parent hears of a lost node from its connection, not from beats
            self.send_ctl({"type": "beat", "ranks": states})

    def from_parent(self, frames: list[bytes]) -> None:
        self.link.heard()
        if frames[0] == tunnel.FAN:
            try:
                channel, headers, shared = tunnel.unfan(frames[1:])
            except tunnel.TunnelError:
                return
            for r, header in headers:
                rank = self.ranks.get(r)
                if rank is not None:
                    rank.take(channel, self.signer.message(r, header, shared))
            return
        if frames[0] != tunnel.CTL:
            return
        try:
            event = tunnel.unpack_ctl(self.boot.hmac_key, frames[1:], tunnel.TO_NODE)
        except tunnel.TunnelError:
            return
        if event["type"] == "start" and not self.ranks:
            self.start_ranks()
        elif event["type"] == "signal":
            target = self.ranks.get(int(event["rank"]))
            if target is not None:
                target.signal(int(event["signum"]))
        elif event["type"] == "stop":
            self.ending = "the parent asked it to stop"
        elif event["type"] == "beat":
            self.sampling = bool(event.get("sample"))


def _watch_stdin(closed: threading.Event) -> None:
    """stdin stays open while the node starter runs: its EOF means the parent is gone."""
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    closed.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_kernel.testing.stub_node", description=__doc__.split("\n")[0])
    parser.add_argument("--parent", required=True, help="tcp://ADDR:PORT of the parent's listener")
    parser.add_argument("--node-rank", type=int, required=True)
    args = parser.parse_args(argv)
    node = StubNode(args.parent, args.node_rank, read_bootstrap(False, None), behaviour_from(os.environ))
    threading.Thread(target=_watch_stdin, args=(node.stdin_closed,), daemon=True).start()
    try:
        node.connect()
        node.run()
        with contextlib.suppress(Exception):
            node.send_ctl({"type": "ending", "node": node.node, "reason": node.ending})
        print(f"stub node {node.node} on {socket.gethostname()}: ending: {node.ending}", file=sys.stderr, flush=True)
    finally:
        node.ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
