"""Exceptions that hf_kvgov raises on purpose.

Every error a user can provoke is a full sentence saying what was given and what is accepted. The
classes below exist so that callers can catch a specific condition (a full pool, a damaged spill file)
instead of parsing messages.
"""

from __future__ import annotations


class KVGovError(RuntimeError):
    """Base class of the run-time conditions hf_kvgov reports (bad arguments raise ValueError/TypeError)."""


class PoolExhausted(KVGovError):
    """The block pool cannot hand out the blocks asked for without exceeding its cap.

    Nothing was allocated or overwritten when this is raised: the caller may free blocks (finish or evict
    sequences) and retry.
    """

    def __init__(self, requested: int, free: int, capacity: int, block_size: int) -> None:
        self.requested = requested
        self.free = free
        self.capacity = capacity
        self.block_size = block_size
        super().__init__(
            f"The KV block pool is exhausted: {requested} block(s) of {block_size} tokens were requested but "
            f"only {free} of its {capacity} blocks are free (cap reached). Release finished sequences, raise "
            "max_tokens/max_bytes, or lower the batch size or generation length."
        )
