"""How a command refuses what it was given: one line on stderr, ``<command>: error: <why>``, and an exit status."""

from __future__ import annotations

import sys


def refuse(command: str, error: BaseException | str, status: int = 2) -> int:
    """Print `error` (an exception, or the reason in words) as the one line of `command`'s refusal; return `status`
    (2: a mistake in what was given)."""
    print(f"{command}: error: {error if isinstance(error, str) else reason(error)}", file=sys.stderr)
    return status


def reason(error: BaseException) -> str:
    """The error in words: a file that could not be read names the file and why, not an errno."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"cannot read {error.filename}: {error.strerror or error}"
    return str(error)
