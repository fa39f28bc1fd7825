"""Progress bars nested under another: drawn on a terminal only.

A nested bar redraws its line with cursor-up codes, which a log file keeps as ``[A`` garbage; off a terminal
(stderr redirected) only the outer bars are drawn, each a line of its own.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def nested_bar(iterable: Any = None, *, disable: bool = False, **kwargs: Any) -> tqdm:
    """`tqdm(iterable, leave=False, ...)`, off unless stderr is a terminal."""
    return tqdm(iterable, leave=False, disable=disable or not sys.stderr.isatty(), **kwargs)
