"""The two KV-compression protocols, on the same tokens for every library: shared by bench_policies.py and
bench_kvpress.py, so it imports only torch and transformers' tokenizers (it runs in kvpress's own venv, where
transformers is older than 5.3 and hf_kvgov does not import).

- ``continue`` (a): prefill ``PREFILL`` tokens in one forward, compressing to ``KEEP`` of them; then score
  the next ``SCORED`` tokens teacher-forced in ``CHUNK``-token forwards with explicit positions, appended to
  the compressed cache without further eviction (a kvpress press compresses at prefill and leaves its
  cache so). Each continuation token predicts the next, so ``PREFILL + SCORED + 1`` tokens are read.
- ``stream`` (b): ``STREAM`` tokens in ``CHUNK``-token forwards through a cache holding ``KEEP`` of them
  throughout; perplexity from the first chunk that reads an evicted cache (earlier chunks equal the full
  cache's by construction, so they would only dilute the difference).

Perplexity is always compared with the full cache (`DynamicCache`) on the same tokens in the same run.
Passages: by default Pride and Prejudice as the package ships it, cut at fixed character offsets; ``--text``
and ``--offsets`` (`add_passage_arguments`) name other text, so a setting chosen on one novel is checked on
another. Every passage is tokenized on its own, so a tokenizer that adds BOS (Gemma-3) starts each window
with it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TEXT = Path(__file__).resolve().parents[1] / "hf_kvgov" / "data" / "text" / "prideprejudice.txt"
PASSAGES = {"p&p@100k": 100_000, "p&p@400k": 400_000}  # character offsets into the novel
DEFAULT_OFFSETS = tuple(PASSAGES.values())
PREFILL, SCORED, STREAM, CHUNK, KEEP = 1536, 512, 2048, 32, 0.2

Forward = Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]  # (ids, cache, positions) -> logits


def add_passage_arguments(parser: argparse.ArgumentParser) -> None:
    """``--text`` (a UTF-8 file) and ``--offsets`` (character offsets into it): the passages a run reads."""
    parser.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text to cut passages from")
    parser.add_argument(
        "--offsets", type=int, nargs="+", default=list(DEFAULT_OFFSETS), help="character offsets of the passages"
    )


def passages(args: argparse.Namespace) -> dict[str, tuple[Path, int]]:
    """Name (``<file stem>@<offset/1000>k``, as ``p&p@100k`` for the default) -> (text file, character offset)."""
    stem = "p&p" if args.text == TEXT else args.text.stem
    chosen = {f"{stem}@{offset // 1000}k": (args.text, offset) for offset in args.offsets}
    for name, (text, offset) in chosen.items():
        if offset < 0 or offset >= len(text.read_text(encoding="utf-8")):
            raise SystemExit(f"--offsets: {offset} is outside {text} ({name}); give 0 <= offset < its length.")
    return chosen


def passage_ids(tokenizer: Any, passage: tuple[Path, int], tokens: int) -> torch.Tensor:
    """Long ``[1, tokens]``: the passage (file, character offset) as the tokenizer encodes it (BOS first if added)."""
    path, offset = passage
    text = path.read_text(encoding="utf-8")[offset:]
    name = f"{path.name}@{offset}"
    ids = tokenizer(text[: 8 * tokens], return_tensors="pt")["input_ids"]
    assert ids.shape[1] >= tokens, f"passage {name} holds only {ids.shape[1]} tokens"
    return ids[:, :tokens]


def plain_forward(model: Any, cache_keyword: str = "cache") -> Forward:
    """The model's forward with a cache and explicit positions, returning float32 logits ``[n, vocab]``.

    transformers 5.24 names the cache argument ``cache`` (``past_key_values`` still works, with a warning);
    the 5.2 that kvpress pins knows only ``past_key_values``.
    """

    def forward(ids: torch.Tensor, cache: Any, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {cache_keyword: cache, "position_ids": positions, "use_cache": True}
        return model(ids, **kwargs).logits[0].float()

    return forward


def _chunk_nll(forward: Forward, cache: Any, ids: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Float ``[stop - start]``: losses of tokens ``start + 1 .. stop`` from ``CHUNK``-token forwards."""
    losses = []
    for first in range(start, stop, CHUNK):
        last = min(first + CHUNK, stop)
        positions = torch.arange(first, last)[None]
        logits = forward(ids[:, first:last], cache, positions)
        losses.append(torch.nn.functional.cross_entropy(logits, ids[0, first + 1 : last + 1], reduction="none"))
    return torch.cat(losses)


def continue_ppl(prefill: Forward, forward: Forward, cache: Any, ids: torch.Tensor) -> float:
    """Protocol (a): ``prefill`` compresses the first ``PREFILL`` tokens, ``forward`` scores the next ``SCORED``."""
    with torch.inference_mode():
        prefill(ids[:, :PREFILL], cache, torch.arange(PREFILL)[None])
        nll = _chunk_nll(forward, cache, ids, PREFILL, PREFILL + SCORED)
    return math.exp(nll.mean().item())


def stream_ppl(forward: Forward, cache: Any, ids: torch.Tensor, first_scored: int) -> float:
    """Protocol (b): perplexity of tokens ``first_scored + 1 ..`` of a ``CHUNK``-token stream of ``STREAM``."""
    with torch.inference_mode():
        nll = _chunk_nll(forward, cache, ids, 0, STREAM)
    return math.exp(nll[first_scored:].mean().item())


def first_evicted(keep: int) -> int:
    """The first position whose chunk reads an evicted cache when ``keep`` slots are held."""
    return (keep // CHUNK + 1) * CHUNK


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    """A Markdown table: one row per (model, passage, configuration), perplexity and its change vs full."""
    lines = [
        f"### {title}",
        "",
        "| model | passage | configuration | kept slots | ppl | full ppl | change |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['passage']} | {r['config']} | {r['kept']} | {r['ppl']:.3f} | "
            f"{r['full_ppl']:.3f} | {r['change_pct']:+.2f}% |"
        )
    return "\n".join(lines)


def row(model: str, passage: str, config: str, kept: int, ppl: float, full: float) -> dict[str, Any]:
    return {"model": model, "passage": passage, "config": config, "kept": kept, "ppl": ppl, "full_ppl": full} | {
        "change_pct": 100 * (ppl / full - 1)
    }
