"""What every `kvgov eval` command writes: JSON, a Markdown table on stdout, PNG plots."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from hf_kvgov.partial import Progress, mark_partial, partial_note


class EvalReport(Protocol):
    """The result of one eval command."""

    def to_dict(self) -> dict[str, Any]:
        """Everything measured, JSON-ready (floats, ints, strings, lists, dicts; NaN allowed)."""
        ...

    def markdown(self) -> str:
        """The summary tables in Markdown."""
        ...

    def plots(self, directory: Path) -> list[Path]:
        """Write the report's PNG plots into ``directory`` (created) and return their paths."""
        ...


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], align_left: int = 1, decimals: int | None = None
) -> str:
    """A GitHub Markdown table; the first ``align_left`` columns are left-aligned, the others right-aligned.

    Floats get ``decimals`` decimals, or by default 4 below 10 and 2 from 10 up.
    """
    rule = [":---" if index < align_left else "---:" for index in range(len(headers))]
    lines = [_row(headers), _row(rule)]
    lines.extend(_row([format_cell(cell, decimals) for cell in row]) for row in rows)
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def format_cell(value: Any, decimals: int | None = None) -> str:
    """Ints with thousands separators, floats rounded (see `markdown_table`), None and NaN as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool | str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        places = decimals if decimals is not None else (4 if abs(value) < 10 else 2)
        return f"{value:,.{places}f}"
    return str(value)


def json_ready(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so the JSON is valid for every reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value


def write_json(data: dict[str, Any], path: str) -> None:
    """Write ``data`` as indented JSON to ``path``, or to stdout when ``path`` is ``-``."""
    text = json.dumps(json_ready(data), indent=2, ensure_ascii=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n", encoding="utf-8")


def emit(
    report: EvalReport, json_path: str | None, plots_dir: str | None, completed: Progress | None = None
) -> list[Path]:
    """Print the Markdown (unless the JSON goes to stdout), write the JSON and the plots; returns the plots.

    ``completed``: the report holds the rows finished before Ctrl-C stopped the run; the table says so, the
    JSON is marked partial (`hf_kvgov.partial.mark_partial`) and no plots are drawn.
    """
    if json_path != "-":
        print(partial_note(completed) + report.markdown())
    if json_path is not None:
        write_json(mark_partial(report.to_dict(), completed), json_path)
    if plots_dir is None or completed is not None:
        return []
    written = report.plots(Path(plots_dir))
    if json_path != "-":
        for path in written:
            print(f"plot: {path}")
    return written
