"""What a cache that spills to the disk tier keeps in memory and may write: a validated, frozen record.

The cache (``hf_kvgov.hf.disk_cache``) applies it; nothing here decides anything at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_kvgov.tiers.disk_tier import DEFAULT_EXTENT_SLOTS
from hf_kvgov.tiers.recall_pages import (
    BUFFERS,
    DEFAULT_BUFFER,
    DEFAULT_NEIGHBOURS,
    DEFAULT_PAGE_TOKENS,
    DEFAULT_RECALL_PAGES,
    DEFAULT_SUMMARY,
    SUMMARY_ROWS,
    Recall,
)

ON_FULL: tuple[str, ...] = ("raise", "keep_resident")
DEFAULT_HOT_TOKENS = 512
DEFAULT_READ_BUFFER_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Disk:
    """The disk tier, a chain's ``spill=`` part: what a disk cache keeps in memory and may write (`DiskOffloadCache`'s
    docstring describes each field).

    In a chain with an eviction policy the tier holds what the policy evicts, in pages, and recalls them
    (`hf_kvgov.engine.slots.recall`): ``path`` and ``max_write_bytes`` apply, ``recall_pages`` pages are
    recalled per (sequence, layer, KV head) at each step, a page holds ``page_tokens`` tokens and
    ``recall_summary`` ranks them (`Recall.summary`: "centroid" or "bounds") and ``recall_buffer`` says where
    recalled pages are held (`Recall.buffer`: "layer" or "shared"), ``recall_neighbours`` the pages on each side of
    a chosen one that come with it (`Recall.neighbours`); the block
    fields (``hot_tokens``, ``max_resident_bytes``, ``read_buffer_bytes``, ``prefetch``, ``on_full``,
    ``extent_blocks``) have no meaning there and must stay at their defaults.
    """

    path: str | None = None
    hot_tokens: int = DEFAULT_HOT_TOKENS
    max_resident_bytes: int | None = None
    max_write_bytes: int | None = None
    read_buffer_bytes: int | None = None
    prefetch: bool = True
    on_full: str = "raise"
    extent_blocks: int = DEFAULT_EXTENT_SLOTS
    recall_pages: int = DEFAULT_RECALL_PAGES
    page_tokens: int = DEFAULT_PAGE_TOKENS
    recall_summary: str = DEFAULT_SUMMARY
    recall_buffer: str = DEFAULT_BUFFER
    recall_neighbours: int = DEFAULT_NEIGHBOURS

    def __post_init__(self) -> None:
        if self.path is not None and Path(self.path).exists() and not Path(self.path).is_dir():
            raise ValueError(f"path must be a directory for the spill file; {self.path!r} is not one.")
        _check_int("hot_tokens", self.hot_tokens, minimum=0)
        _check_int("extent_blocks", self.extent_blocks, minimum=1)
        _check_int("recall_pages", self.recall_pages, minimum=0)
        _check_int("page_tokens", self.page_tokens, minimum=1)
        _check_int("recall_neighbours", self.recall_neighbours, minimum=0)
        for name in ("max_resident_bytes", "max_write_bytes", "read_buffer_bytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1 if name != "read_buffer_bytes" else 0)
        if self.recall_summary not in SUMMARY_ROWS:
            raise ValueError(f"recall_summary must be one of {', '.join(SUMMARY_ROWS)}; got {self.recall_summary!r}.")
        if self.recall_buffer not in BUFFERS:
            raise ValueError(f"recall_buffer must be one of {', '.join(BUFFERS)}; got {self.recall_buffer!r}.")
        if self.on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}; got {self.on_full!r}.")
        if self.max_resident_bytes is not None and self.buffer_bytes >= self.max_resident_bytes:
            raise ValueError(
                f"read_buffer_bytes={self.buffer_bytes} leaves nothing of max_resident_bytes="
                f"{self.max_resident_bytes} for the pool; give the buffers a smaller share."
            )

    def recall(self) -> Recall:
        """The recall tier an eviction chain builds from this spill part."""
        pages, tokens, summary, buffer = self.recall_pages, self.page_tokens, self.recall_summary, self.recall_buffer
        return Recall(self.path, pages, tokens, self.max_write_bytes, summary, buffer, self.recall_neighbours)

    @classmethod
    def of_recall(cls, recall: Recall) -> Disk:
        """The spill part of an eviction cache built with ``recall=``."""
        return cls(
            path=recall.path, max_write_bytes=recall.max_write_bytes, recall_pages=recall.pages,
            page_tokens=recall.page_tokens, recall_summary=recall.summary, recall_buffer=recall.buffer,
            recall_neighbours=recall.neighbours,
        )  # fmt: skip

    def block_fields_changed(self) -> list[str]:
        """The block-spill fields set away from their defaults (meaningless in an eviction chain)."""
        default = Disk()
        fields = ("hot_tokens", "max_resident_bytes", "read_buffer_bytes", "prefetch", "on_full", "extent_blocks")
        return [name for name in fields if getattr(self, name) != getattr(default, name)]

    def recall_fields_changed(self) -> list[str]:
        """The recall fields set away from their defaults (meaningless without an eviction policy)."""
        default = Disk()
        fields = ("recall_pages", "page_tokens", "recall_summary", "recall_buffer")
        return [name for name in fields if getattr(self, name) != getattr(default, name)]

    @property
    def buffer_bytes(self) -> int:
        """The most read-ahead memory: as given, else a quarter of `max_resident_bytes`, else 16 MiB.

        A cap: the rows are allocated as spilled blocks are read back (one layer of them, `tiers.prefetch`),
        so a request that spills nothing holds none. They are charged to the pool, whose cap `max_resident_bytes`
        is: the pool's blocks may use what the rows leave, and the cache is refused at construction unless what
        one sequence keeps fits beside all of it (`pool_bytes`).
        """
        if not self.prefetch:
            return 0
        if self.read_buffer_bytes is not None:
            return self.read_buffer_bytes
        if self.max_resident_bytes is not None:
            return self.max_resident_bytes // 4
        return DEFAULT_READ_BUFFER_BYTES

    @property
    def pool_bytes(self) -> int | None:
        """What `max_resident_bytes` leaves for blocks when the read-ahead rows are all allocated."""
        return None if self.max_resident_bytes is None else self.max_resident_bytes - self.buffer_bytes


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}.")
