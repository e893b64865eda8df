"""The parent <-> node-agent wire and rank placement: pure rules, no processes."""

from __future__ import annotations

import contextlib

import pytest

from dist_kernel import tunnel
from dist_kernel.placement import rank_env, rank_of
from dist_kernel.tunnel.keys import Bootstrap, new_secrets
from dist_kernel.tunnel.link import interface_of, parse_endpoint, route_address


def test_a_control_event_round_trips_when_signed_with_the_kernels_key():
    frames = tunnel.pack_ctl("k" * 64, {"type": "hello", "node": 1, "host": "n2"})
    assert frames[0] == tunnel.CTL
    assert tunnel.unpack_ctl("k" * 64, frames[1:], tunnel.FROM_NODE) == {"type": "hello", "node": 1, "host": "n2"}


@pytest.mark.parametrize("mangle", [
    lambda f: [f[0], tunnel.sign("other key", f[0])],  # signed with another key
    lambda f: [f[0].replace(b"hello", b"hellp"), f[1]],  # payload changed after signing
    lambda f: [f[0]],  # signature missing
])
def test_a_control_event_that_does_not_verify_is_refused(mangle):
    frames = tunnel.pack_ctl("secret", {"type": "hello"})
    with pytest.raises(tunnel.TunnelError):
        tunnel.unpack_ctl("secret", mangle(frames[1:]), tunnel.FROM_NODE)


def test_each_side_accepts_only_the_events_of_its_direction():
    frames = tunnel.pack_ctl("secret", {"type": "start", "master_addr": "10.0.0.1"})
    with pytest.raises(tunnel.TunnelError, match="unknown control event"):
        tunnel.unpack_ctl("secret", frames[1:], tunnel.FROM_NODE)  # a node never sends "start"
    assert tunnel.unpack_ctl("secret", frames[1:], tunnel.TO_NODE)["type"] == "start"


def test_the_bootstrap_line_carries_keys_and_shape_and_rejects_garbage():
    keys = new_secrets()
    boot = Bootstrap(server_key=keys["server_public"], client_public=keys["client_public"],
                            client_secret=keys["client_secret"], hmac_key=keys["hmac_key"],
                            rank_keys={"0": "a", "1": "b", "2": "c", "3": "d"}, nodes=2, ranks_per_node=2)
    line = boot.encode()
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # exactly one line on stdin
    assert Bootstrap.decode(line) == boot and boot.world_size == 4
    assert len(keys["server_public"]) == 40 and keys["server_public"] != keys["client_public"]
    for bad in (b"not json\n", b'{"server_key": 1}\n', b"[]\n"):
        with pytest.raises(tunnel.TunnelError):
            Bootstrap.decode(bad)


def test_fresh_keys_are_fresh_per_kernel_start():
    assert new_secrets()["hmac_key"] != new_secrets()["hmac_key"]


def test_endpoints_parse():
    assert parse_endpoint("tcp://10.77.0.1:5555") == ("10.77.0.1", 5555)
    with pytest.raises(ValueError):
        parse_endpoint("10.77.0.1:5555")


def test_the_route_to_loopback_is_loopback_and_lo_holds_it():
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # an address this machine does not hold


def test_ranks_are_numbered_node_major_as_torchrun_numbers_them():
    assert [rank_of(n, lr, 2) for n in range(2) for lr in range(2)] == [0, 1, 2, 3]


def test_a_ranks_environment_is_what_torchrun_sets():
    env = rank_env({"PATH": "/bin"}, rank=3, ranks_per_node=2, world_size=4, master_addr="10.77.0.11",
                   master_port=29511, runtime_dir="/tmp/x", parent_pid=42, gpus=[], ifname="lab0", cpu_count=4)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "NODE_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.77.0.11", "MASTER_PORT": "29511"}
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lab0"
    assert env["OMP_NUM_THREADS"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "" and env["PATH"] == "/bin"


def test_a_users_interface_choice_and_gpu_mask_win():
    env = rank_env({"GLOO_SOCKET_IFNAME": "ib0", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, rank=1, ranks_per_node=2,
                   world_size=2, master_addr="127.0.0.1", master_port=None, runtime_dir="/tmp/x", parent_pid=1,
                   gpus=[2, 3], ifname="lab0")
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_SOCKET_IFNAME"] == "lab0"
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"  # physical ids picked from the inherited mask
    assert "MASTER_PORT" not in env and "ACCELERATE_USE_CPU" not in env


# ------------------------------------------------------------------ the listener (loopback only)
def _listener(tmp_path):
    import asyncio
    import logging
    import threading

    from dist_kernel.options import KernelConfig
    from dist_kernel.parent.launch.remote import AgentListener

    keys = new_secrets()
    keys["rank_keys"] = {"0": "k0", "1": "k1"}
    heard: list[tuple[int, dict]] = []
    got = threading.Event()

    def on_event(node, event):
        heard.append((node, event))
        got.set()

    cfg = KernelConfig(world_size=2, backend="gloo", launcher="ssh", nodes=2, ranks_per_node=1, hosts=("a", "b"))
    t = AgentListener(cfg, keys, on_event, logging.getLogger("test"))
    port = t.bind("127.0.0.1")
    # the listener lives on the kernel's event loop: here, one of its own in a thread
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start() -> None:
        t.start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    return t, keys, port, heard, got


def _client(port, server_key, public=None, secret=None, curve=True):
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    if curve:
        s.curve_serverkey = server_key.encode()
        if public is None:
            public, secret = (k.decode() for k in zmq.curve_keypair())
        s.curve_publickey, s.curve_secretkey = public.encode(), secret.encode()
    s.setsockopt(zmq.IDENTITY, b"node0")
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def test_the_listener_admits_the_kernels_client_key_and_answers_with_beats(tmp_path):
    import zmq

    t, keys, port, heard, got = _listener(tmp_path)
    try:
        s = _client(port, keys["server_public"], keys["client_public"], keys["client_secret"])
        s.send_multipart(tunnel.pack_ctl(keys["hmac_key"], {"type": "hello", "node": 0, "host": "n1"}))
        assert got.wait(5), "a hello with the right keys never arrived"
        assert heard[0] == (0, {"type": "hello", "node": 0, "host": "n1"})
        assert s.poll(3000, zmq.POLLIN), "the parent did not beat to an admitted node"
        frames = s.recv_multipart()
        assert tunnel.unpack_ctl(keys["hmac_key"], frames[1:], tunnel.TO_NODE)["type"] == "beat"
        s.close()
    finally:
        t.close()


@pytest.mark.parametrize("who", ["a random client key", "no CurveZMQ at all", "a wrong server key"])
def test_a_connection_without_the_keys_is_refused_and_delivers_nothing(tmp_path, who):
    import zmq

    t, keys, port, heard, got = _listener(tmp_path)
    try:
        if who == "a random client key":
            s = _client(port, keys["server_public"])
        elif who == "no CurveZMQ at all":
            s = _client(port, "", curve=False)
        else:
            s = _client(port, zmq.curve_keypair()[0].decode())
        # even a correctly signed event (the HMAC key leaked) gets no further than the handshake.
        # Once the listener refused the handshake, libzmq drops the client's pipe and a send would
        # wait for a peer for good (a loaded machine gets there before the send): not sent at all
        # is refused too
        with contextlib.suppress(zmq.Again):
            s.send_multipart(tunnel.pack_ctl(keys["hmac_key"], {"type": "hello", "node": 0}), zmq.NOBLOCK)
        assert not got.wait(2), f"{who}: the listener accepted {heard}"
        assert not s.poll(500, zmq.POLLIN)
        s.close()
    finally:
        t.close()
