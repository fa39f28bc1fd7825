"""Append-only pages of evicted tokens on disk: what an eviction cache with recall writes and reads back.

A page is ``page_tokens`` evicted tokens of one (sequence, layer, KV head), in position order, one segment of the
disk tier with three parts, in the model's dtype and the machine's byte order::

    part 0 = keys       page_tokens x head_dim      (rotated at each token's own position, as cached)
    part 1 = values     page_tokens x head_dim
    part 2 = positions  page_tokens x int64

Written once, when full; beams share a page's handle, and its slot is reused only after the last reference goes.
The tier's checks apply unchanged, so a damaged page, a full disk or a lost file raise as a disk cache's blocks do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from hf_kvgov.errors import SpillCorrupted
from hf_kvgov.tiers.accounting import TierStats
from hf_kvgov.tiers.disk_tier import DiskTier, TierLayout
from hf_kvgov.tiers.kv_segments import byte_view
from hf_kvgov.tiers.slot_file import check_writable

DEFAULT_EXTENT_PAGES = 256
DEFAULT_RECALL_PAGES = 8
DEFAULT_PAGE_TOKENS = 16
# What each written page leaves resident, and how many key rows it takes: the mean key ("centroid", the
# default) or Quest's per-channel min and max ("bounds", an upper bound on a page's attention, twice the bytes).
SUMMARY_ROWS = {"bounds": 2, "centroid": 1}
DEFAULT_SUMMARY = "centroid"
# Where recalled pages are held between reads: one buffer per layer, or one buffer every layer takes in turn.
BUFFERS = ("layer", "shared")
DEFAULT_BUFFER = "shared"
# A chosen page's neighbours come with it, so a needle split over a page boundary returns whole. It answered one
# such Gemma-3 case; streaming perplexity moved by +0.13 points on average over ten passages, up to +1.0 on one
# (eval/RESULTS.md, "Recall brings a chosen page's neighbours by default").
DEFAULT_NEIGHBOURS = 1


@dataclass(frozen=True)
class Recall:
    """Spill evicted tokens to disk pages and recall the ones the queries need.

    Args:
        path: directory for the spill file (created if missing, checked writable when the cache is built);
            None: a private temporary directory, deleted with the file.
        pages: pages recalled per (sequence, layer, KV head) at each step (0: spill, never recall).
        page_tokens: evicted tokens per page (Quest's pages are 16).
        max_write_bytes: cap on the bytes ever written (SSD wear budget); None: no cap. Past it a spill
            raises `SpillSpaceExhausted`.
        summary: how pages are ranked: "centroid" (the query's score on each page's mean key, one key row
            resident per page) or "bounds" (Quest's upper bound from each page's per-channel key min and max,
            two rows). The centroid is the default: it answered more passkeys on Gemma-3 at 4k and 8k and lost
            less streaming perplexity on SmolLM2 (`eval/RESULTS.md`), where the bound's worst case over
            wide heads ranks spread-out pages first. See `hf_kvgov.policies.page_bounds`.
        buffer: where recalled pages are held: "shared" (the default: one buffer that the layers take in turn,
            holding only the pages of the layer being attended, so every step's pages are read again) or
            "layer" (each layer keeps the pages it recalled at the previous step, so a run of steps asking
            about the same passage reads it once, and ``pages`` pages per sequence, layer and KV head stay
            resident: ``layers`` times the memory). The pages attended are the same either way; at equal
            memory the shared buffer leaves more slots to the policy (`eval/RESULTS.md`).
        neighbours: pages on each side of a chosen page (in the order they were written, which for the tokens one
            step evicts is position order) that come back with it, within the ``pages`` attended: each page is
            ranked by the best score within ``neighbours`` of it, so a passage split over a page boundary returns
            whole (the default, 1). 0 ranks every page alone.
    """

    path: str | None = None
    pages: int = DEFAULT_RECALL_PAGES
    page_tokens: int = DEFAULT_PAGE_TOKENS
    max_write_bytes: int | None = None
    summary: str = DEFAULT_SUMMARY
    buffer: str = DEFAULT_BUFFER
    neighbours: int = DEFAULT_NEIGHBOURS

    def __post_init__(self) -> None:
        if self.summary not in SUMMARY_ROWS:
            raise ValueError(f"Recall: summary must be one of {', '.join(SUMMARY_ROWS)}; got {self.summary!r}.")
        if self.buffer not in BUFFERS:
            raise ValueError(f"Recall: buffer must be one of {', '.join(BUFFERS)}; got {self.buffer!r}.")
        for name, minimum in (("pages", 0), ("page_tokens", 1), ("neighbours", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"Recall: {name} must be an int >= {minimum}; got {value!r}.")
        if self.max_write_bytes is not None and (
            isinstance(self.max_write_bytes, bool)
            or not isinstance(self.max_write_bytes, int)
            or self.max_write_bytes < 1
        ):
            raise ValueError(f"Recall: max_write_bytes must be a positive int or None; got {self.max_write_bytes!r}.")
        if self.path is not None and Path(self.path).exists() and not Path(self.path).is_dir():
            raise ValueError(f"Recall: path must be a directory for the spill file; {self.path!r} is not one.")

    @property
    def buffer_words(self) -> str:
        """Where recalled pages are held, in words (cache and registry descriptions)."""
        return "one buffer the layers share" if self.buffer == "shared" else "each layer's own buffer"

    def kept_within(self, resident_slots: int, tokens: int, layers: int = 1) -> int:
        """The budget that keeps one (sequence, layer, KV head) within ``resident_slots`` token-equivalents of
        K/V memory over ``tokens`` tokens, recall included: the budget, one pending page, the recalled pages
        (``pages`` of them; with a shared buffer, their share over the ``layers`` layers that recall) and one
        summary per written page (min and max: the bytes of one token's key and value; a centroid: half of
        them).

        Raises ValueError when recall's own pages already take ``resident_slots``.
        """
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"Recall.kept_within: layers must be an int >= 1; got {layers!r}.")
        recalled = self.pages * self.page_tokens
        fixed = self.page_tokens + (recalled if self.buffer == "layer" else math.ceil(recalled / layers))
        kept = resident_slots - fixed
        rows = SUMMARY_ROWS[self.summary]  # key rows per page; two are one token's K/V

        def summaries(kept: int) -> int:  # token-equivalents of the summaries of the pages the rest fills
            return math.ceil(math.ceil((tokens - kept) / self.page_tokens) * rows / 2)

        while kept > 0 and kept + fixed + summaries(kept) > resident_slots:
            kept -= 1
        if kept < 1:
            raise ValueError(
                f"Recall(pages={self.pages}, page_tokens={self.page_tokens}, buffer={self.buffer!r}) holds {fixed} "
                "slots of pages per "
                f"(sequence, layer, KV head) plus page summaries, more than {resident_slots} resident slots over "
                f"{tokens} tokens; recall fewer pages or give a larger budget."
            )
        return kept

    def tier(self, head_dim: int, dtype: torch.dtype) -> PageTier:
        """The page tier of one cache (its spill path checked writable now, not at the first spill)."""
        if self.path is not None:
            check_writable(Path(self.path))
        return PageTier(self.page_tokens, head_dim, dtype, self.path, self.max_write_bytes)


class PageTier:
    """Pages of ``page_tokens`` tokens of ``head_dim`` channels in ``dtype``, in one private spill file.

    Args:
        page_tokens: tokens per page.
        head_dim: channels of a key or value.
        dtype: the model's K/V dtype (pages are read back exactly as written).
        directory: where the spill file is created (checked writable now); None: a private temp directory.
        max_write_bytes: cap on the bytes ever written (SSD wear budget); None: no cap.
        extent_pages: pages reserved on disk per file growth step.
    """

    def __init__(
        self,
        page_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        directory: str | Path | None = None,
        max_write_bytes: int | None = None,
        extent_pages: int = DEFAULT_EXTENT_PAGES,
    ) -> None:
        self.page_tokens = page_tokens
        self.head_dim = head_dim
        self.dtype = dtype
        element = torch.empty((), dtype=dtype).element_size()
        kv = page_tokens * head_dim * element
        self.part_bytes = (kv, kv, page_tokens * 8)
        self.tier = DiskTier(TierLayout(1, self.part_bytes, extent_pages), directory, max_write_bytes)

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)

    def write(self, keys: Tensor, values: Tensor, positions: Tensor) -> list[int]:
        """Store ``n`` pages (keys, values ``[n, page_tokens, head_dim]``, positions ``[n, page_tokens]``);
        returns their handles, one reference each. Raises `SpillSpaceExhausted` and stores nothing when the
        disk or the write budget is full."""
        parts = [_host(keys.to(self.dtype)), _host(values.to(self.dtype)), _host(positions.to(torch.int64))]
        count = int(keys.shape[0])
        views = [[byte_view(part[i]) for part in parts] for i in range(count)]
        return self.tier.put(count, [1] * count, lambda _segment: views)

    def read(self, handles: Sequence[int], layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Pages ``handles`` of layer ``layer``, verified: keys, values ``[n, page_tokens, head_dim]`` and
        positions ``[n, page_tokens]`` on the CPU. Raises `SpillCorrupted` naming the layer and the tokens."""
        count = len(handles)
        keys = torch.empty(count, self.page_tokens, self.head_dim, dtype=self.dtype)
        values = torch.empty_like(keys)
        positions = torch.empty(count, self.page_tokens, dtype=torch.int64)
        try:
            self.tier.read(0, handles, [byte_view(keys), byte_view(values), byte_view(positions)])
        except SpillCorrupted as err:
            raise SpillCorrupted(err.block, layer, err.path, err.offset, self._tokens(err.block)) from err
        return keys, values, positions

    def _tokens(self, handle: int) -> tuple[int, int] | None:
        """The positions a damaged page holds, read without the checksum (only to name them)."""
        positions = torch.empty(1, self.page_tokens, dtype=torch.int64)
        path, offset = self.tier.location(handle, 0)
        try:
            with open(path, "rb") as file:
                file.seek(offset + self.part_bytes[0] + self.part_bytes[1])
                file.readinto(byte_view(positions))
        except OSError:
            return None
        return int(positions.min()), int(positions.max()) + 1

    def incref(self, handles: Sequence[int]) -> None:
        self.tier.incref(handles)

    def decref(self, handles: Sequence[int]) -> None:
        self.tier.decref(handles)

    def stats(self) -> TierStats:
        return self.tier.stats()

    def close(self) -> None:
        """Delete the spill file (the tier stays usable: the next write creates a new one)."""
        self.tier.close()


def _host(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu").contiguous()
