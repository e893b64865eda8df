"""The run-time switch magic of the integrations inside the ranks (``%dist_fastai``, ``%dist_lightning``)."""

from __future__ import annotations

from collections.abc import Callable


def switch_magic(line: str, library: str, magic: str, current: Callable[[], bool],
                 set_enabled: Callable[[bool], None]) -> None:
    """``%<magic> on|off``: switch ``library``'s integration; no argument shows its state."""
    arg = line.strip().lower()
    if arg in ("on", "true", "1"):
        set_enabled(True)
    elif arg in ("off", "false", "0"):
        set_enabled(False)
    elif arg:
        raise ValueError(f"%{magic} {line.strip()!r}: use `%{magic} on` or `%{magic} off`.")
    print(f"dist_kernel {library} integration: {'on' if current() else 'off'}")
