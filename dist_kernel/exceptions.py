"""Every error name a user sees, each carrying a message a user can act on, and the
``error`` output content the kernel builds from one (:func:`error_content`)."""

from __future__ import annotations

from collections.abc import Sequence

#: how every :class:`ConfigError` ends: where an option is set, and that the kernel must restart
FIX_HINT = (
    "Fix the option in the kernelspec (reinstall with `python -m dist_kernel install ...`) "
    "or the DIST_KERNEL_* environment variable, then restart the kernel."
)


class DistKernelError(Exception):
    """Base class: the message names what went wrong and how to fix it."""


class ConfigError(DistKernelError):
    """A kernelspec option or environment override is invalid."""


class RankSpecError(DistKernelError):
    """A ``%%rank`` selection does not parse or names a rank that does not exist."""


class RankStartError(DistKernelError):
    """One or more ranks could not start or could not join the process group."""


class RankDiedError(DistKernelError):
    """A rank process exited while the kernel was using it."""


class RankRequestError(DistKernelError):
    """A rank answered a typed request of the parent with an error (``ename``, ``evalue``: the
    rank's own words for it)."""

    def __init__(self, message: str, ename: str = "", evalue: str = "") -> None:
        super().__init__(message)
        self.ename, self.evalue = ename, evalue


# Errors the kernel reports in a cell (as an ``error`` output; never raised in the parent)
class RankStoppedError(DistKernelError):
    """The stop button ended a cell without a rank that is stopped (SIGSTOP, a debugger)."""


class CollectiveHangError(DistKernelError):
    """A rank was blocked in a collective that could not complete: the group was torn down."""


class DistributedError(DistKernelError):
    """Ranks failed a cell with different errors: each one is named with its traceback."""


class UsageError(DistKernelError):
    """A parent magic (``%dist_output``, ``%dist_empty_cache``) was given a bad argument."""


#: an error's name as users see it: the exception class, or a name a rank reported
ErrorName = type[BaseException] | str


def error_content(ename: ErrorName, evalue: str, lines: Sequence[str] = ()) -> dict:
    """The content of an ``error`` output the kernel makes itself (no Python traceback)."""
    name = ename if isinstance(ename, str) else ename.__name__
    return {"ename": name, "evalue": evalue, "traceback": [f"\x1b[1;31m{name}\x1b[0m: {evalue}", *lines]}
