"""The small immutable records the prefix tree hands back: match results, insert results, statistics."""

from __future__ import annotations

from dataclasses import dataclass, fields

from hf_kvgov.stats_repr import rounded_repr


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a prompt, in whole blocks.

    Attributes:
        block_ids: ids of the cached blocks, in prompt order (block ``i`` holds tokens
            ``[i * block_size, (i + 1) * block_size)``).
        num_tokens: tokens covered, ``len(block_ids) * block_size``.
    """

    block_ids: tuple[int, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"PrefixMatch.num_tokens must be >= 0; got {self.num_tokens}.")
        if self.num_tokens == 0 and self.block_ids:
            raise ValueError(f"PrefixMatch has {len(self.block_ids)} block(s) but num_tokens is 0.")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class InsertResult:
    """What :meth:`RadixTree.insert` did with each full block the caller offered.

    Every caller block id lands in exactly one of ``adopted``, ``duplicates`` (as the first element of a
    pair) or ``present``, which is what keeps reference counts exact:

    - ``adopted``: new to the tree. The tree now holds one reference on each (the pool's count for the
      tree's reference must be taken, e.g. ``pool.incref(adopted)``), until :meth:`RadixTree.evict`
      returns the id.
    - ``duplicates``: ``(caller_id, tree_id)`` pairs. An identical block (same namespace and same token
      chain) was already cached under ``tree_id``; the tree took nothing on ``caller_id``. The caller may
      switch its block table to ``tree_id`` and release ``caller_id``.
    - ``present``: the caller passed the very id the tree already caches at that position (typically
      blocks it got from :meth:`RadixTree.match`); nothing changed for them.

    ``block_ids`` is the tree's id for every full block of the prompt, in order, after deduplication.
    """

    block_ids: tuple[int, ...]
    adopted: tuple[int, ...]
    duplicates: tuple[tuple[int, int], ...]
    present: tuple[int, ...]

    def __post_init__(self) -> None:
        offered = len(self.adopted) + len(self.duplicates) + len(self.present)
        if offered != len(self.block_ids):
            raise ValueError(
                f"InsertResult accounts for {offered} block(s) (adopted + duplicates + present) but the "
                f"prompt has {len(self.block_ids)} full block(s)."
            )


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of a :class:`RadixTree`; sizes are in blocks, lookups in tokens.

    ``lookup_tokens`` counts every token of every prompt passed to ``match`` (as vLLM's prefix-cache
    "queries"), ``hit_tokens`` the tokens served from the cache, so ``hit_rate`` is the fraction of
    prompt tokens whose KV did not have to be computed.
    """

    __repr__ = rounded_repr

    block_size: int
    cached_blocks: int
    locked_blocks: int
    evictable_blocks: int
    nodes: int
    namespaces: int
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    inserted_blocks: int
    duplicate_blocks: int
    evicted_blocks: int

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"PrefixCacheStats.{field.name} must be an int >= 0; got {value!r}.")
        if self.locked_blocks + self.evictable_blocks > self.cached_blocks:
            raise ValueError(
                f"PrefixCacheStats has {self.locked_blocks} locked and {self.evictable_blocks} evictable "
                f"blocks, more than the {self.cached_blocks} cached."
            )
        if self.hit_tokens > self.lookup_tokens or self.hits > self.lookups:
            raise ValueError(
                f"PrefixCacheStats reports {self.hits} hits / {self.hit_tokens} hit tokens for "
                f"{self.lookups} lookups / {self.lookup_tokens} looked-up tokens; hits cannot exceed lookups."
            )

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens found in the cache (0.0 before any lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        """All counters plus ``hit_rate``, for logging and for merging into a cache's stats."""
        out: dict[str, float] = {field.name: getattr(self, field.name) for field in fields(self)}
        out["hit_rate"] = self.hit_rate
        return out
