"""gloo across lab namespaces (used by `lab.sh run-gloo-check`).

    python gloo_check.py store HOST PORT SECONDS      # TCPStore server (root namespace)
    python gloo_check.py rank  HOST PORT RANK WORLD   # one rank; joins the store at HOST:PORT

Each rank all_reduces tensor([rank + 1]) and prints the sum, its hostname and the
GLOO_SOCKET_IFNAME it ran with.
"""
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "store":
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        print(f"store listening on {host}:{port}", flush=True)
        time.sleep(float(sys.argv[4]))
        del store
        return
    rank, world = int(sys.argv[4]), int(sys.argv[5])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    t0 = time.monotonic()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    print(f"rank {rank}/{world} host={socket.gethostname()} "
          f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '<unset>')} "
          f"all_reduce={t.item():g} (expected {world * (world + 1) / 2:g}) "
          f"in {time.monotonic() - t0:.2f}s", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if t.item() == world * (world + 1) / 2 else 3)


if __name__ == "__main__":
    main()
