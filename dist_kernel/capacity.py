"""How many ranks this machine can hold: decided before any rank is started.

Every local rank is a Python process with torch imported and a process group formed. A rank
count this machine cannot hold (``--ranks 64`` on a laptop) would start every rank at once and
end in the out-of-memory killer, or in ranks too starved of CPU to answer: it is a
:class:`~dist_kernel.exceptions.ConfigError` in the first cell instead, unless
``--oversubscribe on`` says the user means it. Ranks on other machines (slurm/ssh) are not
checked here: this machine cannot see the nodes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

from dist_kernel.exceptions import ConfigError

#: memory one rank holds of its own (USS) once torch is imported and a gloo group is formed:
#: 301 MB measured (torch 2.14, CPU, Linux; RSS 740 MB, PSS 374 MB at 2 ranks)
RANK_MB = 300
#: memory the ranks share once, whatever their number: torch's libraries (RSS - USS, measured)
SHARED_MB = 440
#: more ranks per CPU core than this starve each other (and the parent) of CPU
RANKS_PER_CORE = 4

_CGROUP = "/sys/fs/cgroup"


class RankCount(Protocol):
    """What the check reads of a :class:`~dist_kernel.options.KernelConfig` (which imports this module)."""

    @property
    def world_size(self) -> int: ...

    @property
    def oversubscribe(self) -> bool: ...

    @property
    def remote(self) -> bool: ...


@dataclass(frozen=True)
class Machine:
    """What this machine offers the ranks."""

    cores: int  # CPU cores this process may run on (affinity, cgroup quota)
    available_mb: float  # memory available now (MemAvailable, within the cgroup's limit)


def most_ranks(machine: Machine) -> int:
    """The most ranks ``machine`` holds (at least 1)."""
    by_memory = int((machine.available_mb - SHARED_MB) // RANK_MB)
    return max(1, min(by_memory, machine.cores * RANKS_PER_CORE))


def check(config: RankCount, machine: Machine) -> list[str]:
    """Refuse a local rank count ``machine`` cannot hold; warnings when ``oversubscribe`` allows it."""
    n = config.world_size
    if config.remote or n <= most_ranks(machine):
        return []
    need_mb = SHARED_MB + n * RANK_MB
    limits = []
    if need_mb > machine.available_mb:
        limits.append(f"{n} ranks need about {need_mb / 1024:.1f} GB of memory ({RANK_MB} MB each, with torch "
                      f"imported, plus {SHARED_MB} MB shared) but {machine.available_mb / 1024:.1f} GB is available")
    if n > machine.cores * RANKS_PER_CORE:
        limits.append(f"{n} ranks on {machine.cores} CPU core{'s' if machine.cores != 1 else ''} is more than "
                      f"{RANKS_PER_CORE} per core (at most {machine.cores * RANKS_PER_CORE})")
    what = "; and ".join(limits)
    if config.oversubscribe:
        return [f"--oversubscribe on: {what}; the ranks may be slow, or end in the out-of-memory killer."]
    raise ConfigError(
        f"--ranks {n} is more than this machine can hold: {what}. No rank was started. Fix: use "
        f"--ranks {most_ranks(machine)} or fewer, or add --oversubscribe on if you mean it; reinstall the "
        f"kernelspec (`python -m dist_kernel install ...`) or set DIST_KERNEL_RANKS / "
        f"DIST_KERNEL_OVERSUBSCRIBE, then restart the kernel.")


def this_machine() -> Machine:
    """This machine's cores and available memory, as a container's limits shape them."""
    return Machine(cores=_cores(), available_mb=_available_mb())


def _cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _read(_cgroup_file("cpu.max")).split()
    if len(quota) == 2 and quota[0] != "max":
        cores = min(cores, math.ceil(int(quota[0]) / int(quota[1])))
    return max(1, cores)


def _available_mb() -> float:
    import psutil  # the parent's dependency; imported only when a kernel starts

    available = psutil.virtual_memory().available
    limit, used = _read(_cgroup_file("memory.max")), _read(_cgroup_file("memory.current"))
    if limit.isdigit() and used.isdigit():
        available = min(available, int(limit) - int(used))
    return max(0, available) / 2**20


def _cgroup_file(name: str) -> str:
    """A file of this process's cgroup (v2); "" when there is none."""
    for line in _read("/proc/self/cgroup").splitlines():
        if line.startswith("0::"):
            return os.path.join(_CGROUP, line[3:].lstrip("/"), name)
    return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
