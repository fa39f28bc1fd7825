"""Where recalled pages are held between the steps that attend them (`Recall.buffer`).

A buffer holds the pages of one layer: the last layer it served. Each layer of a cache with
``Recall(buffer="layer")`` has its own, so the pages a layer recalled at the previous step are still there
at the next (a run of decode steps asking about the same passage reads it once), and ``pages`` pages per
(sequence, layer, KV head) stay resident. With ``buffer="shared"`` every layer takes the cache's one buffer
in turn: the next layer's request drops the previous layer's pages, so only one layer's pages are ever
held (a ``1 / layers`` share), and each step's pages are read again. The pages attended are the same.
"""

from __future__ import annotations

from torch import Tensor

from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.recall_pages import PageTier

Page = tuple[Tensor, Tensor, Tensor]  # keys [page_tokens, d], values [page_tokens, d], positions long [page_tokens]


class RecallBuffer:
    """Pages (by tier handle) of the layer served last; with a pool, their bytes are charged to it."""

    def __init__(self, pool: BlockPool | None = None) -> None:
        self.pool = pool  # the eviction cache's pool: the pages count against its cap
        self.layer: int | None = None
        self.pages: dict[int, Page] = {}

    def take(self, tier: PageTier, layer: int, wanted: list[int]) -> tuple[dict[int, Page], int]:
        """The ``wanted`` pages of ``layer`` (handles), reading (and verifying) those not held; the pages
        now held, and how many were read. Pages not wanted are dropped. With a pool, `PoolExhausted` is raised
        before anything is read when the pages do not fit under its cap."""
        held = self.pages if self.layer == layer else {}
        missing = [handle for handle in wanted if handle not in held]
        if self.pool is not None:
            self.pool.charge(self, max(len(wanted) * tier.page_bytes, self._bytes()))
        fresh: dict[int, Page] = {}
        if missing:
            keys, values, positions = tier.read(missing, layer)  # raises before the buffer changes
            # One copy per page: a page kept at a later step must not keep the whole read alive.
            fresh = {
                handle: (keys[i].clone(), values[i].clone(), positions[i].clone()) for i, handle in enumerate(missing)
            }
        self.pages = {handle: held.get(handle) or fresh[handle] for handle in wanted}
        self.layer = layer
        self._charge()
        return self.pages, len(missing)

    def forget(self, layer: int) -> None:
        """Drop the pages of ``layer`` (a reset; another layer's pages in a shared buffer stay)."""
        if self.layer == layer:
            self.layer, self.pages = None, {}
            self._charge()

    def held_bytes(self, layer: int) -> int:
        """Bytes of pages held for ``layer`` (summed over a cache's layers, a shared buffer counts once)."""
        return self._bytes() if self.layer == layer else 0

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for page in self.pages.values() for t in page)

    def _charge(self) -> None:
        if self.pool is not None:
            self.pool.charge(self, self._bytes())
