"""Score caches against a reference cache on one text, all in one batch, chunk by chunk.

Row r of the batch is the same text served by cache r (row 0: the reference, a lossless `PagedCache`),
through `StackedCache`, so one forward per chunk scores every candidate: the weights are read once per
chunk instead of once per cache, which is what makes a CPU run affordable. Feeding the text in chunks of
`chunk_tokens` lets each cache act as in generation: with `chunk_tokens` equal to the block size, every
token attends to exactly what it would see while generating (full-precision tail, sealed blocks before).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from hf_kvgov.hf.compat import Cache, CacheLayerMixin
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.quality.metrics import RunningScore
from hf_kvgov.quality.plan import Pass, lockstep_passes
from hf_kvgov.registry import kv_bytes

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]"  # its units are costs, not steps

CacheBuilder = Callable[[], Any]  # () -> a fresh transformers Cache for the model being scored


class _StackedLayer(CacheLayerMixin):
    """Layer `index` of a `StackedCache`: the rows hold the same text, so a full-attention layer's sizes are the
    first cache's. A layer that some cache treats as sliding (`is_sliding`) may keep a different amount of
    history before the window in each row (DynamicCache exactly `window - 1` tokens, a block cache from a block
    boundary, a cache without layer groups everything): the batch reads the last tokens every row keeps, which
    hold the window of every query of the step, and tells the mask where they start."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: StackedCache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.is_sliding = any(_sliding(cache, index) for cache in owner.caches)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.owner.update(key_states, value_states, self.index, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        sizes = [cache.get_mask_sizes(query_length, self.index) for cache in self.owner.caches]
        if not self.is_sliding:
            return sizes[0]
        start = max(offset for _, offset in sizes)  # the latest first token: what every row keeps
        return sizes[0][0] + sizes[0][1] - start, start

    def get_seq_length(self) -> int:
        return int(self.owner.caches[0].get_seq_length(self.index))

    def get_max_length(self) -> int:
        return -1


def _sliding(cache: Any, index: int) -> bool:
    layers = getattr(cache, "layers", ())
    return index < len(layers) and bool(getattr(layers[index], "is_sliding", False))


class StackedCache(Cache):
    """A batch whose row i is stored by `caches[i]` (each holding one row, contiguous attention path)."""

    def __init__(self, caches: Sequence[Any], num_layers: int) -> None:
        if not caches:
            raise ValueError("StackedCache needs at least one cache.")
        paged = [type(c).__name__ for c in caches if getattr(c, "attention", "contiguous") != "contiguous"]
        if paged:
            raise ValueError(f"StackedCache serves caches on the contiguous attention path only; got {paged}.")
        self.caches = list(caches)
        super().__init__(layers=[_StackedLayer(self, i) for i in range(num_layers)])

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Row i of `[rows, kv_heads, q_len, head_dim]` goes to cache i; returns the rows' K/V stacked."""
        parts = [
            cache.update(key_states[i : i + 1], value_states[i : i + 1], layer_idx, *args, **kwargs)
            for i, cache in enumerate(self.caches)
        ]
        lengths = sorted({int(k.shape[2]) for k, _ in parts})
        layer = self.layers[layer_idx]
        if len(lengths) > 1 and getattr(layer, "is_sliding", False):  # see `_StackedLayer`
            kept = lengths[0]
            parts = [(k[:, :, -kept:], v[:, :, -kept:]) for k, v in parts]
        elif len(lengths) > 1:
            raise ValueError(
                f"The stacked caches return {lengths} tokens for full-attention layer {layer_idx}: they keep "
                "different tokens (an eviction cache beside one that keeps every token), so they cannot share one "
                "batch."
            )
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.caches[0].get_seq_length(layer_idx))


@dataclass(frozen=True)
class CacheScore:
    """One candidate cache against the reference over the same tokens."""

    name: str
    tokens: int  # predicted tokens
    perplexity: float
    reference_perplexity: float
    ppl_increase_pct: float
    kl_mean: float
    top1_agreement: float
    bytes_per_token: float  # KV bytes the cache held at the end, per token
    compression: float  # reference bytes / candidate bytes


@dataclass
class LockstepResult:
    scores: dict[str, CacheScore]
    reference: PagedCache  # holds the whole text, for inspection (e.g. key outliers)


def score_in_lockstep(
    model: Any,
    input_ids: Tensor,
    candidates: Mapping[str, CacheBuilder],
    chunk_tokens: int,
    block_size: int,
    max_rows: int = 8,
    progress: str | None = None,
    bar: tqdm | None = None,
) -> LockstepResult:
    """Score every candidate against a `PagedCache` reference, `max_rows` candidates per pass.

    Args:
        input_ids: long `[1, n]`, the text.
        candidates: name -> builder of a fresh cache for `model`.
        chunk_tokens: tokens fed per forward step.
        progress: label of a progress bar on stderr (None: silent).
        bar: a progress bar to advance instead, by each step's `plan.Pass.step_cost` (its total is the caller's).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [1, n] with n >= 2; got {tuple(input_ids.shape)}.")
    if chunk_tokens < 1 or max_rows < 1:
        raise ValueError(f"chunk_tokens and max_rows must be positive; got {chunk_tokens} and {max_rows}.")
    names = list(candidates)
    passes = lockstep_passes(len(names), int(input_ids.shape[1]), chunk_tokens, max_rows, progress or "")
    scores: dict[str, CacheScore] = {}
    reference: PagedCache | None = None
    with _own_bar(passes, progress) if bar is None else contextlib.nullcontext(bar) as shown:
        for start, planned in zip(range(0, max(len(names), 1), max_rows), passes, strict=True):
            group = names[start : start + max_rows]
            reference = PagedCache(model, block_size=block_size)
            caches = [candidates[name]() for name in group]
            running = _run_pass(model, input_ids, [reference, *caches], planned, shown)
            ref_bytes = kv_bytes(reference)
            for name, cache, score in zip(group, caches, running, strict=True):
                scores[name] = _finish(name, score, cache, ref_bytes)
    assert reference is not None
    return LockstepResult(scores, reference)


def progress_bar(total: float, label: str) -> tqdm:
    """A bar on stderr counting `plan.Pass` costs: it shows the percentage done and the ETA, not its units."""
    return tqdm(total=total, desc=label, bar_format=BAR_FORMAT, leave=False)


def _own_bar(passes: Sequence[Pass], label: str | None) -> contextlib.AbstractContextManager[tqdm | None]:
    return contextlib.nullcontext() if label is None else progress_bar(sum(p.cost for p in passes), label)


def _run_pass(model: Any, input_ids: Tensor, caches: list[Any], planned: Pass, bar: tqdm | None) -> list[RunningScore]:
    """One pass over the text; returns one running score per cache after the first (the reference)."""
    assert len(caches) == planned.rows and input_ids.shape[1] == planned.tokens
    layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    stacked = StackedCache(caches, layers)
    rows = input_ids.expand(len(caches), -1).to(model.device)
    running = [RunningScore() for _ in caches[1:]]
    if bar is not None and planned.label:
        bar.set_description_str(planned.label)
    with torch.inference_mode():
        for start in planned.starts:
            stop = min(start + planned.chunk, planned.tokens - 1)  # the last token has nothing to predict
            logits = model(input_ids=rows[:, start:stop], cache=stacked, use_cache=True).logits
            targets = rows[0, start + 1 : stop + 1]
            for row, score in enumerate(running, start=1):
                score.add(logits[0], logits[row], targets)
            if bar is not None:
                bar.update(planned.step_cost(start))
    return running


def _finish(name: str, score: RunningScore, cache: Any, reference_bytes: int) -> CacheScore:
    held = kv_bytes(cache)
    tokens = max(1, int(cache.get_seq_length()))
    return CacheScore(
        name=name,
        tokens=score.tokens,
        perplexity=score.perplexity,
        reference_perplexity=score.reference_perplexity,
        ppl_increase_pct=score.ppl_increase_pct,
        kl_mean=score.kl_mean,
        top1_agreement=score.top1_agreement,
        bytes_per_token=held / tokens,
        compression=reference_bytes / held if held else 1.0,
    )
