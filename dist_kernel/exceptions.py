"""The few exceptions dist_kernel raises, each carrying a message a user can act on."""

from __future__ import annotations


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
    """A rank answered a typed request of the parent with an error."""
