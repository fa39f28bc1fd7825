"""Per-token losses of a text: fed through the model with caches in the loop, or in sliding windows.

Both return the negative log-likelihood of every token after the first (entry ``i`` is ``-log p(token i+1 | what
the model saw)``), so a text of ``n`` tokens gives ``n - 1`` losses and the two methods line up.

- ``chunked_token_losses``: ``chunk_tokens`` at a time with the cache kept between chunks, so eviction and
  quantization act exactly as while generating; caches needing no attention of their own share one batch (a
  ``StackedCache`` row each), so the weights are read once per chunk for all of them.
- ``sliding_window_token_losses``: the transformers guide's perplexity: ``window`` tokens every ``stride``, no
  cache, each token scored once with the longest context its window gives. Per-token losses are pooled, so every
  token weighs the same (the guide weighs each window's mean loss, which is right for the first window only).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_kvgov.hf.compat import decoder_config
from hf_kvgov.progress import nested_bar
from hf_kvgov.quality.lockstep import StackedCache
from hf_kvgov.registry import CacheSpec


def check_text_ids(input_ids: Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be long [1, n] with n >= 2 tokens; got shape {tuple(input_ids.shape)}.")


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """float64 ``[rows, q]`` losses from logits ``[rows, q, vocab]`` (any float) and long targets ``[rows, q]``."""
    rows, q, vocab = logits.shape
    losses = F.cross_entropy(logits.reshape(rows * q, vocab).float(), targets.reshape(rows * q), reduction="none")
    return losses.view(rows, q).double()


def chunked_token_losses(
    model: Any,
    input_ids: Tensor,
    specs: Sequence[CacheSpec],
    chunk_tokens: int,
    progress: str | None = None,
) -> tuple[Tensor, list[Any]]:
    """Feed the text ``chunk_tokens`` at a time, one batch row per cache of ``specs``.

    Args:
        input_ids: long ``[1, n]``, the text.
        specs: the caches; more than one must all work without an attention context of their own.
        chunk_tokens: tokens per forward step (1: exactly as decode sees them).
        progress: label of a progress bar over the chunks (None: silent).

    Returns:
        float64 ``[len(specs), n - 1]`` losses, and the caches as they are after the text (to measure them).
    """
    check_text_ids(input_ids)
    _check_group(specs)
    length = input_ids.shape[1]
    caches = [spec.build_for(model, length) for spec in specs]
    layers = int(decoder_config(model).num_hidden_layers)
    # A lone cache is fed directly: it may need its own attention, which a stacked batch cannot give it.
    served = caches[0] if len(caches) == 1 else StackedCache(caches, layers)
    rows = input_ids.to(model.device).expand(len(caches), -1)
    losses = torch.empty(len(caches), length - 1, dtype=torch.float64)
    steps = range(0, length - 1, chunk_tokens)
    with ExitStack() as stack:
        for spec in specs:
            stack.enter_context(spec.attention(model))
        stack.enter_context(torch.inference_mode())
        for start in nested_bar(steps, desc=progress, unit="step", disable=progress is None):
            stop = min(start + chunk_tokens, length - 1)  # the last token has nothing to predict
            logits = model(input_ids=rows[:, start:stop], cache=served, use_cache=True).logits
            losses[:, start:stop] = token_nll(logits, rows[:, start + 1 : stop + 1]).cpu()
    return losses, caches


def _check_group(specs: Sequence[CacheSpec]) -> None:
    if not specs:
        raise ValueError("chunked_token_losses needs at least one cache spec; got none.")
    own = [spec.name for spec in specs if spec.needs_attention_context]
    if len(specs) > 1 and own:
        raise ValueError(
            f"The caches {own} need their own attention, so each must be scored alone, not in a batch with "
            f"{[spec.name for spec in specs if spec.name not in own]}."
        )


def check_window(window: int, stride: int) -> None:
    for name, value in (("window", window), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"The sliding-window {name} must be a positive number of tokens; got {value!r}.")
    if window < 2 or stride >= window:
        # With stride == window the first token of every later window would have no context in it.
        raise ValueError(
            f"A sliding window needs window >= 2 and stride < window (windows overlap, so no token goes "
            f"unscored); got window={window} and stride={stride}."
        )


def sliding_window_token_losses(
    model: Any, input_ids: Tensor, window: int, stride: int, progress: str | None = None
) -> Tensor:
    """float64 ``[n - 1]`` losses by the guide's sliding windows (``input_ids`` long ``[1, n]``, no cache)."""
    check_text_ids(input_ids)
    check_window(window, stride)
    ids = input_ids.to(model.device)
    length = ids.shape[1]
    losses = torch.empty(length - 1, dtype=torch.float64)
    scored = 1  # tokens [0, scored) are done; token 0 has no context and is never scored
    # The guide's loop: windows start every `stride` tokens until one reaches the end of the text.
    begins = range(0, max(length - window, 0) + stride, stride)
    with torch.inference_mode():
        for begin in nested_bar(begins, desc=progress, unit="window", disable=progress is None):
            end = min(begin + window, length)
            logits = model(input_ids=ids[:, begin:end], use_cache=False).logits
            # Token t is predicted by the logits at t - 1; this window scores the tokens not scored yet.
            first = max(scored, begin + 1)
            losses[first - 1 : end - 1] = token_nll(logits[:, first - 1 - begin : end - 1 - begin], ids[:, first:end])[
                0
            ]
            scored = end
    return losses
