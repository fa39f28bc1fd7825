"""Recall: what an eviction policy evicts goes to disk pages, and the pages a query needs come back.

With ``recall=Recall(...)`` an eviction cache keeps its budget of slots, but an evicted token joins its (sequence,
layer, KV head)'s pending page; a full page is written once to the disk tier (`hf_kvgov.tiers.recall_pages`) and
leaves a resident summary of its keys (`Recall.summary`: the mean key, or per-channel min and max). Each step,
before attention, the layer ranks its pages by its queries' scores on the mean keys or Quest's bound
(`hf_kvgov.policies.page_bounds`) and attends, beside its kept slots, to the pending page and the ``pages`` best
pages per (sequence, KV head), held in a bounded buffer (`hf_kvgov.engine.slots.recall_buffer`). Recalled slots are
attended, never kept: the policy's choice is as without recall, so with every page recalled attention reads every
token (the tests check it against a full cache). A sliding-window layer spills only what it evicts inside its
window, since later queries cannot see the rest, and never recalls a page wholly older than it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_kvgov.engine.slots.recall_buffer import RecallBuffer
from hf_kvgov.policies import gather_kept
from hf_kvgov.policies.page_bounds import page_centroid_scores, page_upper_bounds
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.recall_pages import SUMMARY_ROWS, PageTier, Recall

GROWTH_PAGES = 16

__all__ = ["LayerRecall", "Recall", "RecallStats", "RecalledSlots", "layer_recalls", "recall_stats"]


@dataclass(frozen=True)
class RecalledSlots:
    """Slots attended beside the kept ones for one step: ``[batch, kv_heads, slots, ...]``."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    valid: Tensor

    @property
    def count(self) -> int:
        return int(self.keys.shape[2])

    @staticmethod
    def join(parts: list[RecalledSlots]) -> RecalledSlots | None:
        """``parts`` one after another along the slot axis (None when there are none)."""
        if len(parts) < 2:
            return parts[0] if parts else None
        fields = [(p.keys, p.values, p.positions, p.valid) for p in parts]
        return RecalledSlots(*(torch.cat(tensors, dim=2) for tensors in zip(*fields, strict=True)))


@dataclass(frozen=True)
class RecallStats:
    """What the recall tier wrote and read.

    ``write_amplification`` is bytes written over the bytes of the tokens spilled (1.0: each evicted token
    written once, nothing rewritten). ``pages_read`` counts reads from disk; ``pages_recalled`` the pages
    attended (read, or reused from the buffer); ``max_pages_read_per_step`` the most one layer step read.
    ``resident_bytes`` is what recall holds in memory: pending pages, page summaries, page tables, the buffer.
    """

    path: str | None
    page_tokens: int
    pages: int
    tokens_spilled: int
    pages_written: int
    bytes_written: int
    write_amplification: float
    layer_steps: int
    pages_read: int
    bytes_read: int
    pages_recalled: int
    max_pages_read_per_step: int
    resident_bytes: int


class RecallCounters:
    """The counts every layer's recall adds to (one per cache)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens_spilled = self.layer_steps = self.pages_read = self.pages_recalled = 0
        self.max_pages_read_per_step = 0


class LayerRecall:
    """One layer's pending pages, page table with key summaries, and recall buffer (see the module docstring;
    ``buffer`` is the layer's own, or the one its cache's layers share)."""

    def __init__(
        self, tier: PageTier, layer: int, recall: Recall, counters: RecallCounters, buffer: RecallBuffer
    ) -> None:
        self.tier = tier
        self.buffer = buffer
        self.layer = layer
        self.pages = recall.pages
        self.neighbours = recall.neighbours
        self.summary = recall.summary
        self.summary_rows = SUMMARY_ROWS[recall.summary]
        self.counters = counters
        self.page_tokens = tier.page_tokens
        self._clear()

    def _clear(self) -> None:
        self.pending_keys: Tensor | None = None  # [b, hk, page_tokens, d]
        self.pending_values: Tensor | None = None
        self.pending_positions: Tensor | None = None  # long [b, hk, page_tokens]
        self.pending_count: Tensor | None = None  # long [b, hk]
        self.handles = torch.empty(0, 0, 0, dtype=torch.long)  # long [b, hk, pages], -1: empty (CPU)
        self.page_summary: Tensor | None = None  # [b, hk, pages, rows, d]: (min, max) or (mean,) of the keys
        self.page_last: Tensor | None = None  # long [b, hk, pages]: each page's newest position
        self.page_count: Tensor | None = None  # long [b, hk]
        self.buffer.forget(self.layer)

    # ------------------------------------------------------------------ spilling

    def spill(self, keys: Tensor, values: Tensor, positions: Tensor, evicted: Tensor) -> None:
        """Add the ``evicted`` slots (bool ``[b, hk, slots]``) of a step's attended slots to the pages.

        ``keys``/``values`` ``[b, hk, slots, d]``, ``positions`` ``[b, hk, slots]``. Evicted tokens join the
        pending page in position order; every page that fills is written (all or nothing: on a full disk
        or write budget the tier raises `SpillSpaceExhausted` and the pages stay as they were).
        """
        batch, heads, _, head_dim = keys.shape
        counts = evicted.sum(dim=-1)
        most = int(counts.max()) if counts.numel() else 0
        if most == 0:  # a layer that never evicts what a later query can see holds no recall state at all
            return
        if self.pending_count is None:
            self._start(batch, heads, head_dim, keys)
        assert self.pending_keys is not None and self.pending_values is not None
        assert self.pending_positions is not None and self.pending_count is not None
        latest = torch.iinfo(torch.long).max
        order = torch.where(evicted, positions, latest).argsort(dim=-1, stable=True)[..., :most]
        size = self.page_tokens
        stream_valid = torch.cat((_first(self.pending_count, size), _first(counts, most)), dim=-1)
        # Pending tokens, then this step's evicted ones, compacted to the front of each (row, head).
        compact = (~stream_valid).to(torch.int8).argsort(dim=-1, stable=True)
        stream_keys = gather_kept(torch.cat((self.pending_keys, gather_kept(keys, order)), dim=2), compact)
        stream_values = gather_kept(torch.cat((self.pending_values, gather_kept(values, order)), dim=2), compact)
        stream_positions = gather_kept(torch.cat((self.pending_positions, gather_kept(positions, order)), -1), compact)
        total = self.pending_count + counts
        full = total // size  # pages that fill, per (row, head)
        slots = stream_keys.shape[2]
        padded = -(-slots // size) * size
        stream_keys, stream_values = _pad(stream_keys, padded), _pad(stream_values, padded)
        stream_positions = _pad(stream_positions, padded)
        if int(full.max()) > 0:
            self._write_pages(stream_keys, stream_values, stream_positions, full)
        rest = (full[..., None] * size + torch.arange(size, device=full.device)).clamp(max=padded - 1)
        self.pending_keys = gather_kept(stream_keys, rest)
        self.pending_values = gather_kept(stream_values, rest)
        self.pending_positions = gather_kept(stream_positions, rest)
        self.pending_count = total - full * size
        self.counters.tokens_spilled += int(full.sum()) * size

    def undo_point(self) -> Callable[[], None]:
        """A function that puts the pages back as they are now and frees those written since: a step whose slots
        the pool then refuses leaves recall as it was (the pool's cap counts what recall holds)."""
        names = ("pending_keys", "pending_values", "pending_positions", "pending_count", "page_summary", "page_last")
        saved = {name: getattr(self, name) for name in (*names, "page_count")}  # `spill` replaces these
        handles, spilled = self.handles.clone(), self.counters.tokens_spilled  # it writes into the table's new slots

        def undo() -> None:
            written = set(self.handles[self.handles >= 0].tolist()) - set(handles[handles >= 0].tolist())
            if written:
                self.tier.decref(sorted(written))
            for name, value in saved.items():
                setattr(self, name, value)
            self.handles, self.counters.tokens_spilled = handles, spilled

        return undo

    def _start(self, batch: int, heads: int, head_dim: int, like: Tensor) -> None:
        size, device = self.page_tokens, like.device
        self.pending_keys = like.new_zeros(batch, heads, size, head_dim)
        self.pending_values = like.new_zeros(batch, heads, size, head_dim)
        self.pending_positions = torch.zeros(batch, heads, size, dtype=torch.long, device=device)
        self.pending_count = torch.zeros(batch, heads, dtype=torch.long, device=device)
        self.handles = torch.full((batch, heads, 0), -1, dtype=torch.long)
        self.page_summary = like.new_zeros(batch, heads, 0, self.summary_rows, head_dim)
        self.page_last = torch.zeros(batch, heads, 0, dtype=torch.long, device=device)
        self.page_count = torch.zeros(batch, heads, dtype=torch.long, device=device)

    def _write_pages(self, keys: Tensor, values: Tensor, positions: Tensor, full: Tensor) -> None:
        """Write the first ``full[b, h]`` pages of each (row, head) of the compacted stream; record them."""
        assert self.page_count is not None and self.page_summary is not None and self.page_last is not None
        batch, heads, slots, head_dim = keys.shape
        size = self.page_tokens
        per_row = slots // size
        is_full = torch.arange(per_row, device=full.device) < full[..., None]  # [b, hk, pages of the stream]
        page_keys = keys.reshape(batch, heads, per_row, size, head_dim)[is_full]
        page_values = values.reshape(batch, heads, per_row, size, head_dim)[is_full]
        page_positions = positions.reshape(batch, heads, per_row, size)[is_full]
        handles = self.tier.write(page_keys, page_values, page_positions)  # raises before anything changes
        rows, head_index, rank = is_full.nonzero(as_tuple=True)
        slot = self.page_count[rows, head_index] + rank
        self._grow(int((self.page_count + full).max()))
        self.handles[rows.cpu(), head_index.cpu(), slot.cpu()] = torch.tensor(handles, dtype=torch.long)
        self.page_summary[rows, head_index, slot] = self._summarise(page_keys)
        self.page_last[rows, head_index, slot] = page_positions.amax(dim=1)
        self.page_count = self.page_count + full

    def _summarise(self, page_keys: Tensor) -> Tensor:
        """``[pages, page_tokens, d]`` keys -> ``[pages, rows, d]`` summaries (min and max, or the mean)."""
        if self.summary == "centroid":
            return page_keys.float().mean(dim=1, keepdim=True).to(page_keys.dtype)
        return torch.stack((page_keys.amin(dim=1), page_keys.amax(dim=1)), dim=1)

    def _grow(self, needed: int) -> None:
        """Widen the page table to ``needed`` pages per (row, head) and ``GROWTH_PAGES`` more: growth is rare
        (a decode step fills a page every ``page_tokens`` steps) and the spare summaries stay small."""
        assert self.page_summary is not None and self.page_last is not None
        have = self.handles.shape[-1]
        if needed <= have:
            return
        extra = needed + GROWTH_PAGES - have
        self.handles = torch.cat((self.handles, self.handles.new_full((*self.handles.shape[:2], extra), -1)), -1)
        self.page_summary = _widen(self.page_summary, extra)
        self.page_last = torch.cat((self.page_last, self.page_last.new_zeros(*self.page_last.shape[:2], extra)), -1)

    # ------------------------------------------------------------------ recalling

    def recalled(self, query: Tensor, first_query: Tensor, window: int | None) -> RecalledSlots | None:
        """The slots attended beside the kept ones for ``query`` ``[b, q_heads, q_len, d]``: the pending page,
        then the best ``pages`` pages by their bound. ``first_query`` long ``[b]`` is the position of each
        row's first query (a window layer never recalls a page wholly older than its window from it)."""
        if self.pending_count is None:
            return None
        assert self.pending_keys is not None and self.pending_values is not None
        assert self.pending_positions is not None
        pending_valid = _first(self.pending_count, self.page_tokens)
        parts = [(self.pending_keys, self.pending_values, self.pending_positions, pending_valid)]
        pages = self._best_pages(query, first_query, window)
        if pages is not None:
            parts.insert(0, pages)
        keys, values, positions, valid = (torch.cat(tensors, dim=2) for tensors in zip(*parts, strict=True))
        return RecalledSlots(keys.to(query.dtype), values.to(query.dtype), positions, valid)

    def _best_pages(
        self, query: Tensor, first_query: Tensor, window: int | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        assert self.page_count is not None and self.page_summary is not None and self.page_last is not None
        table = self.handles.shape[-1]
        if self.pages == 0 or table == 0 or int(self.page_count.max()) == 0:
            return None
        written = torch.arange(table, device=self.page_count.device) < self.page_count[..., None]
        if window is not None:
            written = written & (self.page_last > first_query[:, None, None] - window)
        summary = self.page_summary
        if self.summary == "centroid":
            scores = page_centroid_scores(query, summary[..., 0, :], written)
        else:
            scores = page_upper_bounds(query, summary[..., 0, :], summary[..., 1, :], written)
        count = min(self.pages, table)
        if self.neighbours:
            best, index = self._with_neighbours(scores, written, count)
        else:
            best, index = scores.topk(count, dim=-1)  # [b, hk, k]
        chosen = self.handles.gather(-1, index.cpu())
        chosen = chosen.masked_fill(~torch.isfinite(best).cpu(), -1)
        keys, values, positions = self._fetch(chosen)
        batch, heads, count = chosen.shape
        valid = (chosen >= 0).to(query.device)[..., None].expand(batch, heads, count, self.page_tokens)
        flat = (batch, heads, count * self.page_tokens)
        device = query.device
        return (
            keys.to(device).reshape(*flat, -1),
            values.to(device).reshape(*flat, -1),
            positions.to(device).reshape(flat),
            valid.reshape(flat),
        )

    def _with_neighbours(self, scores: Tensor, written: Tensor, count: int) -> tuple[Tensor, Tensor]:
        """The ``count`` pages ranked by the best score within ``neighbours`` of each (a chosen page's neighbours
        come along); among equal ranks a page's own score decides, so a seed precedes its neighbours."""
        reach, table = 2 * self.neighbours + 1, scores.shape[-1]
        pooled = torch.nn.functional.max_pool1d(scores.reshape(-1, 1, table), reach, stride=1, padding=self.neighbours)
        pooled = torch.where(written, pooled.reshape(scores.shape), -torch.inf)
        by_own = scores.argsort(dim=-1, descending=True, stable=True)
        by_rank = pooled.gather(-1, by_own).argsort(dim=-1, descending=True, stable=True)
        index = by_own.gather(-1, by_rank)[..., :count]
        return pooled.gather(-1, index), index

    def _fetch(self, chosen: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Keys, values ``[b, hk, k, page_tokens, d]`` and positions of the ``chosen`` handles (-1: none):
        from the buffer when it still holds them, else read (and verified) from disk."""
        wanted = sorted({int(h) for h in chosen.flatten().tolist() if h >= 0})
        pages, read = self.buffer.take(self.tier, self.layer, wanted)
        counters = self.counters
        counters.layer_steps += 1
        counters.pages_read += read
        counters.pages_recalled += len(wanted)
        counters.max_pages_read_per_step = max(counters.max_pages_read_per_step, read)
        slot_of = {handle: i + 1 for i, handle in enumerate(wanted)}  # 0: the zero page of an empty choice
        index = torch.tensor([slot_of.get(int(h), 0) for h in chosen.flatten().tolist()]).reshape(chosen.shape)
        zero_keys = torch.zeros(self.page_tokens, self.tier.head_dim, dtype=self.tier.dtype)
        stacked = [
            torch.stack([zero_keys, *(pages[h][0] for h in wanted)]),
            torch.stack([zero_keys, *(pages[h][1] for h in wanted)]),
            torch.stack([torch.zeros(self.page_tokens, dtype=torch.long), *(pages[h][2] for h in wanted)]),
        ]
        return stacked[0][index], stacked[1][index], stacked[2][index]

    # ------------------------------------------------------------------ rows, reset, accounting

    def select_rows(self, rows: Tensor) -> None:
        """Beam search and batch expansion: row i becomes old row ``rows[i]``; shared pages share handles."""
        if self.pending_count is None:
            return
        old = self.handles
        self.handles = old.index_select(0, rows.cpu())
        self.tier.incref(self.handles[self.handles >= 0].tolist())
        self.tier.decref(old[old >= 0].tolist())
        for name in ("pending_keys", "pending_values", "pending_positions", "pending_count", "page_summary",
                     "page_last", "page_count"):  # fmt: skip
            tensor = getattr(self, name)
            setattr(self, name, tensor.index_select(0, rows.to(tensor.device)))

    def reset(self) -> None:
        """Forget every page (their file slots are freed for reuse)."""
        held = self.handles[self.handles >= 0].tolist()
        if held:
            self.tier.decref(held)
        self._clear()

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: `own_bytes` and the recall buffer's pages of this layer (a shared buffer is
        counted by the layer whose pages it holds)."""
        return self.own_bytes + self.buffer.held_bytes(self.layer)

    @property
    def own_bytes(self) -> int:
        """Bytes of the pending pages, page summaries and page table (the buffer charges its pages itself)."""
        tensors = [
            self.pending_keys, self.pending_values, self.pending_positions, self.pending_count, self.handles,
            self.page_summary, self.page_last, self.page_count,
        ]  # fmt: skip
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def layer_recalls(
    tier: PageTier, layers: list[int], recall: Recall, counters: RecallCounters, pool: BlockPool | None = None
) -> list[LayerRecall]:
    """The recall state of each of a cache's ``layers``: each with its own buffer, or all taking one in turn (the
    buffers charge their pages to ``pool``, when the cache has one)."""
    shared = RecallBuffer(pool)
    return [
        LayerRecall(tier, layer, recall, counters, shared if recall.buffer == "shared" else RecallBuffer(pool))
        for layer in layers
    ]


def page_tier_for(recall: Recall, model: Any, head_dim: int, read_keys: object, owner: str) -> PageTier:
    """The page tier of one eviction cache, after refusing what recall cannot serve."""
    if not isinstance(recall, Recall):
        raise TypeError(f"{owner}: recall must be a hf_kvgov Recall(...) or None; got {type(recall).__name__}.")
    if read_keys is not None:
        raise ValueError(
            f"{owner} re-rotates the keys it keeps before attention reads them, so pages of evicted keys could "
            "not be attended beside them; recall works with caches that attend keys as stored "
            "(HeavyHitterCache, PolicyCache)."
        )
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{owner}: recall needs the model itself (its dtype sizes the pages), not its config.")
    return recall.tier(head_dim, dtype)


def recall_stats(tier: PageTier, counters: RecallCounters, pages: int, layers: list[LayerRecall]) -> RecallStats:
    tier_stats = tier.stats()
    token_bytes = tier.page_bytes // tier.page_tokens
    spilled_bytes = counters.tokens_spilled * token_bytes
    return RecallStats(
        path=tier_stats.path,
        page_tokens=tier.page_tokens,
        pages=pages,
        tokens_spilled=counters.tokens_spilled,
        pages_written=tier_stats.blocks_written,
        bytes_written=tier_stats.bytes_written,
        write_amplification=tier_stats.bytes_written / spilled_bytes if spilled_bytes else 0.0,
        layer_steps=counters.layer_steps,
        pages_read=counters.pages_read,
        bytes_read=tier_stats.bytes_read,
        pages_recalled=counters.pages_recalled,
        max_pages_read_per_step=counters.max_pages_read_per_step,
        resident_bytes=sum(layer.nbytes for layer in layers),
    )


def _first(counts: Tensor, size: int) -> Tensor:
    """Bool ``[..., size]``: True for the first ``counts[...]`` entries."""
    return torch.arange(size, device=counts.device) < counts[..., None]


def _pad(tensor: Tensor, slots: int) -> Tensor:
    """``tensor`` ``[b, hk, s, ...]`` zero-padded to ``slots`` along dim 2."""
    missing = slots - tensor.shape[2]
    if missing == 0:
        return tensor
    return torch.cat((tensor, tensor.new_zeros(*tensor.shape[:2], missing, *tensor.shape[3:])), dim=2)


def _widen(tensor: Tensor, extra: int) -> Tensor:
    return torch.cat((tensor, tensor.new_zeros(*tensor.shape[:2], extra, *tensor.shape[3:])), dim=2)
