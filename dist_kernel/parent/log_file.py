"""Where a kernel's output log lives and the file itself: owner-only, bounded, kept after the kernel.

- **Where**: ``dist_kernel/`` in Jupyter's runtime directory (``jupyter --runtime-dir``, where
  JupyterLab writes the connection files), named after the kernel's connection file:
  ``kernel-<id>.json`` gives ``dist_kernel/kernel-<id>.log``, the kernel id JupyterLab and
  ``%connect_info`` show. Not beside a connection file elsewhere (a bare KernelManager writes it in
  ``/tmp``, shared by every user), and not in the kernel's private runtime directory, which is
  removed when the kernel ends: the log is read after.
- **Who may read it**: the directory is 0700 and the file 0600 (outputs can hold secrets); a
  directory owned by someone else, or a link, is refused.
- **How big**: at ``max_bytes`` the file is renamed ``.log.1`` (replacing the one before) and a new
  one begun, so a kernel keeps at most twice that. ``tail -F`` follows it across the rename.
- **How many**: a kernel that opens its log removes the logs of all but the :data:`KEEP_KERNELS`
  most recently written kernels; a log whose kernel still runs (it holds a ``flock`` on it) is kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat

from jupyter_core.paths import jupyter_runtime_dir

DIR_NAME = "dist_kernel"
SUFFIX = ".log"
#: how many kernels' logs are kept in a log directory (the newest, plus every live kernel's)
KEEP_KERNELS = 10


def log_path(connection_file: str) -> str:
    """The log of the kernel whose connection file is ``connection_file``."""
    name = os.path.basename(connection_file)
    stem = name[:-len(".json")] if name.endswith(".json") else name
    return os.path.join(jupyter_runtime_dir(), DIR_NAME, stem + SUFFIX)


def private_dir(path: str) -> None:
    """Make ``path`` a directory only its owner can enter, or raise ``OSError`` saying why not."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise OSError(f"{path} belongs to another user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


class RotatingFile:
    """An append-only owner-only file, rotated at ``max_bytes`` (see the module doc)."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        private_dir(os.path.dirname(path))
        self.fd = -1
        self.size = 0
        self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # an older file of the same name may have had another mode
        # held while the kernel lives: prune() in another kernel leaves this log alone
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.fd, self.size = fd, os.fstat(fd).st_size

    def write(self, text: str) -> None:
        """Append ``text`` (straight to the file: ``tail -f`` sees it at once)."""
        data = text.encode("utf-8", "replace")
        if len(data) > self.max_bytes:  # one write larger than the file: its end is what is kept
            data = f"[... {len(data) - self.max_bytes // 2} bytes left out ...]\n".encode() \
                + data[-(self.max_bytes // 2):]
        if self.size and self.size + len(data) > self.max_bytes:
            self.rotate()
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.size += len(data)

    def rotate(self) -> None:
        """``.log`` becomes ``.log.1`` (the one before goes) and a new ``.log`` begins."""
        os.replace(self.path, self.path + ".1")
        os.close(self.fd)
        self._open()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def prune(folder: str, keep: int = KEEP_KERNELS) -> list[str]:
    """Remove the logs of all but the ``keep`` most recently written kernels in ``folder``, except
    those a live kernel holds; the files removed."""
    logs: dict[str, float] = {}  # a kernel's log (without .1) -> when it or its .1 was last written
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            base = entry.name[:-2] if entry.name.endswith(SUFFIX + ".1") else entry.name
            if base.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                    logs[base] = max(logs.get(base, 0.0), mtime)
    removed: list[str] = []
    for base in sorted(logs, key=logs.__getitem__, reverse=True)[keep:]:
        path = os.path.join(folder, base)
        if _held(path):
            continue
        for name in (path, path + ".1"):
            with contextlib.suppress(OSError):  # gone already, or not ours to remove
                os.unlink(name)
                removed.append(name)
    return removed


def _held(path: str) -> bool:
    """Does a live kernel hold this log (its ``flock``)?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # only its .1 is left: no kernel writes it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock taken just now
    return False
