"""Lazy access to the optional packages behind the official LongBench metrics.

The metrics must give the official numbers sample for sample, so they use the very packages the
official harness uses: ``rouge`` 1.0.1, ``fuzzywuzzy`` 0.18.0 and ``jieba``. Look-alikes
(``rouge-score``, ``rapidfuzz``) score the same strings differently. None of them is imported
until a metric needs it, so the rest of the library works without the ``eval`` extra.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

INSTALL_HINT = "pip install hf-kvgov[eval]"


def _missing(package: str, purpose: str) -> ImportError:
    return ImportError(
        f"The package {package!r} is needed for {purpose} but is not installed; "
        f"install the evaluation extras with `{INSTALL_HINT}`."
    )


@functools.cache
def rouge_scorer() -> Any:
    """A ``rouge.Rouge()`` instance (package ``rouge`` 1.0.1, as the official harness uses)."""
    try:
        from rouge import Rouge
    except ImportError as err:
        raise _missing("rouge", "the LongBench ROUGE-L metrics (rouge==1.0.1)") from err
    return Rouge()


@functools.cache
def fuzz_ratio() -> Callable[[str, str], int]:
    """``fuzzywuzzy.fuzz.ratio``: an int in [0, 100], ``round(100 * SequenceMatcher.ratio())``.

    The official numbers come from fuzzywuzzy installed *without* python-Levenshtein, in which case
    ``fuzz.ratio`` is backed by ``difflib.SequenceMatcher``. With python-Levenshtein present,
    fuzzywuzzy switches to a different matcher whose ratios differ on some strings, so that case is
    reported with a warning instead of silently drifting from the official scores.
    """
    try:
        with warnings.catch_warnings():
            # The difflib fallback is exactly what we want; its "slow" warning is noise here.
            warnings.filterwarnings("ignore", message="Using slow pure-python SequenceMatcher")
            from fuzzywuzzy import fuzz
    except ImportError as err:
        raise _missing("fuzzywuzzy", "the LongBench code similarity metric (fuzzywuzzy==0.18.0)") from err
    if getattr(fuzz, "SequenceMatcher", None) is not difflib.SequenceMatcher:
        warnings.warn(
            "fuzzywuzzy is using python-Levenshtein instead of difflib; code similarity scores may "
            "differ from the official LongBench numbers. Uninstall python-Levenshtein to match them.",
            RuntimeWarning,
            stacklevel=2,
        )
    ratio: Callable[[str, str], int] = fuzz.ratio
    return ratio


@functools.cache
def jieba_cut() -> Callable[..., Iterable[str]]:
    """``jieba.cut``, the Chinese word segmenter of the official Chinese metrics."""
    try:
        import jieba
    except ImportError as err:
        raise _missing("jieba", "the Chinese LongBench metrics") from err
    cut: Callable[..., Iterable[str]] = jieba.cut
    return cut
