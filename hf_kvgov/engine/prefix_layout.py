"""Where the tokens of a batch go when rows reuse cached prefixes of different lengths.

A cached block is only valid at the positions it was computed at (its keys carry RoPE there), and every row of a
paged batch holds the same number of tokens. So a row reusing `m` cached tokens keeps them at slots 0..m-1, and
rows reusing fewer than the longest match `M` get masked padding after their prefix; transformers derives
positions from the mask's cumulative sum, so padding in the middle shifts nothing::

    row 0 (hit 32):  [p p p ... p | p p p ... p]  [pad pad] [s s s s]     (M = 32, S = 4)
    row 1 (hit 16):  [p p ... p | pad ... pad ]   [pad]     [s s s s s]... left-padded suffix
    row 2 (miss):    [pad ............... pad ]   [s s s s s s]
    slots 0..M-1: cached blocks of the row, then fresh (masked) pad blocks; slots M..: computed now.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    """One row after matching: its real tokens, how many were cached, and the first padded slot."""

    tokens: list[int]
    cached: int  # tokens served from the cache (a multiple of the block size)
    first_pad: int | None  # first slot holding padding, None when the row has none


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens without its left padding; refuses masks with holes (not left padding)."""
    if attention_mask is None:
        return [row.tolist() for row in input_ids]
    rows = []
    for ids, mask in zip(input_ids, attention_mask, strict=True):
        ones = int(mask.sum())
        if ones == 0 or not bool(mask[-ones:].all()):
            raise ValueError(
                "Prefix matching expects left-padded rows (zeros then ones in attention_mask, at least "
                "one real token per row); got a mask with padding elsewhere."
            )
        rows.append(ids[-ones:].tolist())
    return rows


def middle_padded(rows: list[RowLayout], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both long `[batch, M + S]`, laid out as in the module docstring."""
    longest_hit = max(row.cached for row in rows)
    longest_rest = max(len(row.tokens) - row.cached for row in rows)
    ids, masks = [], []
    for row in rows:
        rest = row.tokens[row.cached :]
        pads = longest_hit - row.cached + longest_rest - len(rest)
        ids.append(row.tokens[: row.cached] + [pad_token_id] * pads + rest)
        masks.append([1] * row.cached + [0] * pads + [1] * len(rest))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(masks, dtype=torch.long)


def layouts(rows: list[list[int]], cached: list[int]) -> list[RowLayout]:
    """RowLayouts for rows whose first `cached[i]` tokens come from the prefix cache."""
    longest_hit = max(cached)
    longest_rest = max(len(tokens) - hit for tokens, hit in zip(rows, cached, strict=True))
    result = []
    for tokens, hit in zip(rows, cached, strict=True):
        padded = hit < longest_hit or len(tokens) - hit < longest_rest
        result.append(RowLayout(tokens, hit, hit if padded else None))
    return result


def padding_inside_a_window(rows: list[RowLayout], windows: tuple[int | None, ...]) -> str | None:
    """Why this layout is not exact on a sliding-window model, or None when it is.

    transformers' sliding-window mask counts slots, not positions: padding between a row's cached prefix and its
    new tokens takes places in their window that real tokens held when the row ran alone, now or once decoding
    has gone far enough past the prompt. Left padding before every real token is harmless, as everywhere.
    """
    sliding = [(layer, window) for layer, window in enumerate(windows) if window is not None]
    if not sliding:
        return None
    width = max(row.cached for row in rows) + max(len(row.tokens) - row.cached for row in rows)
    for index, row in enumerate(rows):
        gap = width - len(row.tokens)
        if row.cached and gap:
            layer, window = min(sliding, key=lambda pair: pair[1])
            return (
                f"row {index} reuses {row.cached} cached tokens, and its {gap} padding slots would sit between them "
                f"and its new tokens, inside layer {layer}'s {window}-token sliding window (transformers' mask "
                "counts slots, not positions), so its tokens would differ from the row run alone"
            )
    return None


def publishable_tokens(sequence: torch.Tensor, stored: int, first_pad: int | None) -> list[int]:
    """The tokens of one row whose slot equals their position: safe to key a prefix block on."""
    end = stored if first_pad is None else min(stored, first_pad)
    return sequence[:end].tolist()
