"""Ctrl-C in the middle of a run: keep the rows that finished.

A runner keeps its finished rows as it goes and runs its loop inside ``on_interrupt(partial)``: when
KeyboardInterrupt arrives, ``partial()`` builds the `Interrupted` to raise instead, holding the report of
the rows finished so far (the same report type, built by the same code as a whole run's) and a
`Progress` saying how far the run got. The command line prints and writes that report marked partial
(`mark_partial`, `partial_note`) and exits with 130.

In a run over several processes each process reports only its own finished rows: gathering them would
need every process to reach the same collective call, which a Ctrl-C gives no reason to expect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """How far a stopped run got: ``done`` of its ``total`` rows, counted in ``unit`` (a plural noun).

    ``processes`` > 1: ``done`` counts the rows of this process alone (nothing was gathered).
    """

    done: int
    total: int
    unit: str
    processes: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.done <= self.total:
            raise ValueError(f"done must lie in [0, total]; got {self.done} of {self.total} {self.unit}.")

    @property
    def scope(self) -> str:
        """'' for a single process, else what the counts cover."""
        if self.processes == 1:
            return ""
        return f" on the main process (of {self.processes}; the other processes' rows are not gathered)"

    def __str__(self) -> str:
        return f"{self.done} of {self.total} {self.unit}{self.scope}"

    def to_dict(self) -> dict[str, Any]:
        return {"done": self.done, "total": self.total, "unit": self.unit, "main_process_only": self.processes > 1}


class Interrupted(Exception):
    """Ctrl-C stopped a run: ``report`` is the report of the rows finished before it, None when none had."""

    def __init__(self, report: Any | None, progress: Progress) -> None:
        super().__init__(f"interrupted after {progress}")
        self.report = report if progress.done else None
        self.progress = progress


@contextmanager
def on_interrupt(partial: Callable[[], Interrupted]) -> Iterator[None]:
    """Turn a KeyboardInterrupt inside the block into ``partial()``: what to report of the rows finished so far."""
    try:
        yield
    except KeyboardInterrupt:
        raise partial() from None


def mark_partial(data: dict[str, Any], completed: Progress | None) -> dict[str, Any]:
    """A report's JSON as written: with ``"partial": true`` and ``"completed"`` first when the run was stopped."""
    if completed is None:
        return data
    return {"partial": True, "completed": completed.to_dict(), **data}


def partial_note(completed: Progress | None) -> str:
    """The line printed above the table of a stopped run ('' for a whole run)."""
    if completed is None:
        return ""
    return f"**Partial**: interrupted after {completed}; only the finished rows are shown.\n\n"
