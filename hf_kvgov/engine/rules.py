"""Which chains hf_kvgov can build, and why the others are refused.

A chain is checked in two passes, both tables rather than branches:

1. every pair of links in `REFUSED_PAIRS` is refused with its sentence (none today: every pair is built);
2. `LAYOUTS` lists the two ways a governed cache stores K/V and the links each takes; the chain goes to the
   first whose required links it has and whose accepted links cover it. "blocks" is the block store
   (`PagedCache`, whose codec and disk links are objects it calls); "slots" keeps per-head slots chosen by
   an eviction policy (`EvictionCache`), in a pool's blocks when given one, with its own codec and recall.

Per-layer overrides are checked against the links they need.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_kvgov.engine.parts import ChainParts, Paging, Sink
from hf_kvgov.storage.pool import BlockPool

# (link, link) -> why the two cannot be combined. Every pair is built today (an eviction policy keeps its
# slots in a pool's blocks, reads a shared prefix as computed and recalls what it spills); the table stays for
# the links to come.
REFUSED_PAIRS: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class StorageLayout:
    """One way a governed cache stores K/V: the links it needs and the links it accepts."""

    name: str
    needs: frozenset[str]
    accepts: frozenset[str]


LAYOUTS: tuple[StorageLayout, ...] = (
    # Heads keep different tokens, so a policy's kept K/V are per-head slots. With spill=, what it evicts is
    # written to disk pages and recalled (`Recall`); with pool=, its slots live in a shared pool's blocks.
    StorageLayout("slots", frozenset({"policy"}), frozenset({"policy", "pool", "prefix", "codec", "spill"})),
    # Every head keeps every token: one block table per layer group, the codec and disk links called by it.
    StorageLayout("blocks", frozenset(), frozenset({"pool", "prefix", "codec", "spill"})),
)


class ChainRefused(ValueError):
    """A combination of parts that cannot work; the message says why."""


def layout_for(parts: ChainParts, num_layers: int | None = None) -> StorageLayout:
    """The storage layout that serves `parts`, after refusing combinations that cannot work."""
    present = parts.present
    for pair, reason in REFUSED_PAIRS.items():
        if pair <= present:
            first, second = sorted(pair)
            raise ChainRefused(f"A chain cannot have both {first}= and {second}=: {reason}.")
    _check_overrides(parts, num_layers)
    _check_pool(parts)
    for layout in LAYOUTS:
        if layout.needs <= present <= layout.accepts:
            return layout
    raise AssertionError(f"no layout for the links {sorted(present)}")  # every pair outside the table fits one


def _check_overrides(parts: ChainParts, num_layers: int | None) -> None:
    for index, layer in parts.layers:
        if num_layers is not None and index >= num_layers:
            raise ChainRefused(
                f"layers names layer {index}, but the model has layers 0..{num_layers - 1}; override existing layers."
            )
        if layer.full_precision and parts.codec is None:
            raise ChainRefused(
                f"Layer {index} asks for full precision, but the chain has no codec: every layer is already stored in "
                "full precision. Add codec= or drop the override."
            )
        if layer.budget is not None and parts.policy is None:
            raise ChainRefused(
                f"Layer {index} has its own eviction budget, but the chain has no eviction policy to apply it. "
                "Add policy=HeavyHitter(...), Sink(...) or Evict(...), or drop the override."
            )


def _check_pool(parts: ChainParts) -> None:
    _check_spill_with_prefix(parts)
    _check_spill_with_policy(parts)
    # A block-spilling disk tier creates its own pool (with a tree it draws from the tree's); an eviction
    # policy's recall tier does not touch the pool.
    own_pool = parts.spill is not None and parts.prefix is None and parts.policy is None
    if own_pool and isinstance(parts.pool, Paging) and parts.pool.capped:
        raise ChainRefused(
            "With a disk tier the pool's cap is what stays in memory: give it as Disk(max_resident_bytes=...), "
            "not as Paging(max_tokens=/max_bytes=)."
        )
    if parts.policy is not None and parts.attention != "contiguous":
        raise ChainRefused(
            f"attention={parts.attention!r} reads pool blocks in place, but an eviction policy stores per-head slots "
            "and always attends with the hf_kvgov attention; leave attention at its default."
        )
    if own_pool and parts.pool is not None and not isinstance(parts.pool, Paging):
        raise ChainRefused(
            "A disk tier creates its own pool, capped by Disk(max_resident_bytes=...); pass Paging(...) for its block "
            "size and attention path, not an existing BlockPool."
        )
    if parts.prefix is None:
        return
    if parts.policy is not None:  # the policy's slots live apart from the tree's blocks, which it only reads
        _check_prefix_with_policy(parts)
        return
    if isinstance(parts.pool, BlockPool) and parts.pool is not parts.prefix.pool:
        raise ChainRefused("prefix= brings its own pool; pass that same pool as pool=, or Paging(...), or no pool.")
    if isinstance(parts.pool, Paging) and parts.pool.capped:
        raise ChainRefused(
            "prefix= brings its own pool, whose cap applies; cap it where it is created, not with "
            "Paging(max_tokens=/max_bytes=)."
        )
    if isinstance(parts.pool, Paging) and parts.pool.block_size != parts.prefix.block_size:
        raise ChainRefused(
            f"Paging(block_size={parts.pool.block_size}) differs from the prefix tree's "
            f"{parts.prefix.block_size}-token blocks; the cache draws its blocks from the tree's pool, so give the "
            "same block size."
        )


def _check_prefix_with_policy(parts: ChainParts) -> None:
    assert parts.prefix is not None
    if isinstance(parts.policy, Sink):
        raise ChainRefused(
            "Sink(...) keeps a sequence's first tokens as attention sinks, and with prefix= those are the shared "
            "prefix's, which every step already reads in full; use HeavyHitter(...) with a prefix tree, or Sink "
            "without one."
        )


def _check_spill_with_policy(parts: ChainParts) -> None:
    spill = parts.spill
    if spill is None:
        return
    if parts.policy is None:
        if spill.recall_fields_changed():
            raise ChainRefused(
                f"Disk({', '.join(f'{n}=...' for n in spill.recall_fields_changed())}) sets how evicted tokens are "
                "recalled, but the chain has no eviction policy; a disk tier without one spills whole cold blocks. "
                "Add policy= or drop those fields."
            )
        return
    if isinstance(parts.policy, Sink):
        raise ChainRefused(
            "Sink(...) re-rotates the keys it keeps to cache positions, so pages of evicted keys, stored as they "
            "were rotated, could not be attended beside them; recall works with HeavyHitter(...). Drop spill= "
            "or use HeavyHitter."
        )
    if spill.block_fields_changed():
        raise ChainRefused(
            f"With an eviction policy the disk tier holds evicted tokens in pages, so Disk("
            f"{', '.join(f'{n}=...' for n in spill.block_fields_changed())}) has no meaning there; give path=, "
            "max_write_bytes=, recall_pages=, page_tokens=, recall_summary= and recall_buffer= only."
        )


def _check_spill_with_prefix(parts: ChainParts) -> None:
    if parts.spill is None or parts.prefix is None or parts.spill.max_resident_bytes is None:
        return
    raise ChainRefused(
        f"Disk(max_resident_bytes={parts.spill.max_resident_bytes}) cannot cap a disk tier with prefix=: the cache "
        "draws its blocks from the tree's pool, which other requests share; cap that pool where it is created "
        "(BlockPool(..., max_bytes=...)) and leave max_resident_bytes=None."
    )
