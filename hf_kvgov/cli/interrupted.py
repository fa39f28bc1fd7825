"""Ctrl-C on the command line: one line on stderr, exit status 130, and the rows finished so far kept.

`run_reported` runs a command's measurement and shows its report. When Ctrl-C stops the run after
some rows finished, it shows the report of those rows, marked partial (the runner raises
`hf_kvgov.partial.Interrupted` with it); when none had finished, it writes nothing, so an earlier
``--json`` file at the same path is left as it was.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from hf_kvgov.partial import Interrupted, Progress

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C

R = TypeVar("R")


def run_reported(
    command: str,
    run: Callable[[], R],
    show: Callable[[R, Progress | None], None],
    json_path: str | None,
    is_main: bool = True,
) -> int:
    """``show(run(), None)`` and 0; on Ctrl-C ``show(partial report, progress)`` when rows finished, and 130.

    Args:
        command: the prefix of the line, e.g. 'kvgov eval ppl'.
        show: prints the table and writes ``--json`` (and plots for a whole run) of a report.
        json_path: the ``--json`` argument, named in the line.
        is_main: False on the other processes of a multi-process run, which print and write nothing.
    """
    try:
        report = run()
    except Interrupted as stop:
        if is_main:
            if stop.report is not None:
                show(stop.report, stop.progress)
            print(f"{command}: {_outcome(stop.progress, json_path)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before the rows started: loading the model, reading the data
        if is_main:
            print(f"{command}: interrupted before any row finished; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    if is_main:
        show(report, None)
    return 0


def _outcome(progress: Progress, json_path: str | None) -> str:
    if not progress.done:
        return f"interrupted before any of {progress.total} {progress.unit} finished{progress.scope}; nothing written"
    if json_path is None:
        where = "the partial table is printed above"
    else:
        where = "partial results written to " + ("stdout" if json_path == "-" else json_path)
    return f"interrupted after {progress}; {where}"
