"""Output paths checked before a command runs: a ``--json``, ``--plot``, ``--plots`` or ``--recommend`` that could
not be written is refused in one line at the start, not as a traceback after minutes of measuring.

A file's directory, and a plots directory, may be missing (the writers make them); the nearest directory that
exists must take a new file, which is tried (a file made and removed there), since permission bits do not say it
for every file system or user.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

OUTPUT_FILES = (("json", "--json"), ("plot", "--plot"), ("recommend", "--recommend"))  # '-': standard output
OUTPUT_DIRECTORIES = (("plots", "--plots"),)


def check_outputs(args: argparse.Namespace) -> None:
    """Raise ValueError naming the option when one of `args`' output paths cannot be written."""
    for name, option in OUTPUT_FILES:
        value = getattr(args, name, None)
        if value and value != "-":
            path = Path(value)
            if path.is_dir():
                raise ValueError(f"{option} {path} is a directory; give a file path such as {path / 'results.json'}.")
            _check_creatable(option, path, path.parent)
    for name, option in OUTPUT_DIRECTORIES:
        value = getattr(args, name, None)
        if value:
            path = Path(value)
            if path.exists() and not path.is_dir():
                raise ValueError(f"{option} {path} is a file; give a directory (it is made if missing).")
            _check_creatable(option, path, path)


def _check_creatable(option: str, path: Path, directory: Path) -> None:
    existing = directory.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {path} cannot be written: {existing} is a file, not a directory.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvgov-probe-", dir=existing)
    except OSError as err:
        raise ValueError(
            f"{option} {path} cannot be written: {existing} takes no new file ({err.strerror or err}); give a path "
            "in a directory you can write."
        ) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
