"""Eviction priorities for the prefix tree: which unreferenced leaf goes first.

A priority is a tiny strategy object (SGLang's ``get_priority(node)``): it maps a node's metadata to a
sortable value, and the leaf with the *smallest* value is evicted first. The tree recomputes a node's
priority every time the node changes (touched by a match or insert, trimmed, split), so a priority must be
a pure function of the fields of :class:`NodeInfo`; a value that drifts on its own (wall-clock age) would
leave the eviction queue stale.

New policies plug in by passing an object with a ``priority`` method, or by adding a factory to
:data:`PRIORITIES` so that it can be chosen by name; the tree never branches on the policy's type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# What a priority returns; values returned by one policy must be comparable with each other.
Priority = float | tuple[float, ...]


class NodeInfo(Protocol):
    """The read-only view of a tree node that eviction priorities see.

    All blocks of one node share these values: the tree splits a node wherever an operation would
    treat its blocks differently.
    """

    @property
    def last_access(self) -> int:
        """Logical time (a counter that grows by one per match/insert) of the latest touch."""
        ...

    @property
    def access_count(self) -> int:
        """How many matches and inserts have touched the node."""
        ...

    @property
    def num_blocks(self) -> int:
        """Number of full blocks the node holds (its compressed run)."""
        ...

    @property
    def depth(self) -> int:
        """Blocks from the namespace root to the end of this node (its last block's position + 1)."""
        ...

    @property
    def namespace(self) -> str:
        """The namespace (cache salt) whose tree the node belongs to."""
        ...


@runtime_checkable
class EvictionPriority(Protocol):
    """Maps a candidate leaf to a sortable value; the smallest value is evicted first."""

    def priority(self, node: NodeInfo) -> Priority: ...


@dataclass(frozen=True)
class LRUPriority:
    """Least recently used first: the classic prefix-cache policy (vLLM, SGLang's default)."""

    def priority(self, node: NodeInfo) -> Priority:
        return node.last_access


@dataclass(frozen=True)
class LFUPriority:
    """Least frequently used first, ties broken by recency (SGLang's ``lfu``)."""

    def priority(self, node: NodeInfo) -> Priority:
        return (node.access_count, node.last_access)


PRIORITIES: dict[str, Callable[[], EvictionPriority]] = {
    "lru": LRUPriority,
    "lfu": LFUPriority,
}


def make_priority(spec: str | EvictionPriority) -> EvictionPriority:
    """Return the eviction priority named by ``spec`` (a key of :data:`PRIORITIES`) or ``spec`` itself."""
    if isinstance(spec, str):
        factory = PRIORITIES.get(spec)
        if factory is None:
            raise ValueError(
                f"Unknown eviction priority {spec!r}; accepted names are {sorted(PRIORITIES)}, or pass an "
                "object with a priority(node) method."
            )
        return factory()
    if not isinstance(spec, EvictionPriority):
        raise TypeError(
            f"An eviction priority must be a name in {sorted(PRIORITIES)} or an object with a "
            f"priority(node) method; got {type(spec).__name__}."
        )
    return spec
