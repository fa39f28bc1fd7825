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

    def __init__(self, requested: int, free: int, capacity: int, block_size: int, beside: int | None = None) -> None:
        self.requested = requested
        self.free = free
        self.capacity = capacity
        self.block_size = block_size
        self.beside = beside  # bytes a holder asked to keep beside the blocks (`BlockPool.charge`), if that
        if beside is None:
            asked = f"{requested} block(s) of {block_size} tokens were requested but only {free} of its {capacity} "
            asked += "blocks are free"
        else:
            asked = (
                f"{beside} bytes of slot metadata, statistics or recall pages need {requested} block(s)' worth of "
                f"the cap, but only {free} free block(s) at the end of its memory can give their bytes back"
            )
        super().__init__(
            f"The KV block pool is exhausted: {asked} (cap reached). Release finished sequences, raise "
            "max_tokens/max_bytes, or lower the batch size or generation length."
        )


class SpillError(KVGovError):
    """Base class of the conditions the disk tier reports (space, corruption, a lost spill file)."""


class SpillSpaceExhausted(SpillError):
    """A block could not be written to the spill file: the disk is full or the write budget is spent.

    Nothing half-written is ever read: the block stays in memory and the slot it was going to use is
    free again. `reason` is ``"disk full"`` or ``"write budget"``.
    """

    def __init__(self, reason: str, path: str, detail: str) -> None:
        self.reason = reason
        self.path = path
        super().__init__(
            f"Cannot spill KV blocks to {path}: {reason} ({detail}). Free disk space, raise max_write_bytes, "
            "or build the cache with on_full='keep_resident' to keep blocks in memory instead."
        )


class SpillCorrupted(SpillError):
    """A spilled block read back from disk does not match the checksum taken when it was written.

    Attention never runs on such data. `block` is the tier's handle of the block, `layer` the layer whose
    bytes failed, `tokens` the token positions the block holds when the cache knows them.
    """

    def __init__(self, block: int, layer: int, path: str, offset: int, tokens: tuple[int, int] | None = None) -> None:
        self.block = block
        self.layer = layer
        self.path = path
        self.offset = offset
        self.tokens = tokens
        where = f" (tokens [{tokens[0]}, {tokens[1]}))" if tokens is not None else ""
        super().__init__(
            f"Spilled KV block {block}{where}, layer {layer}, is corrupted: its bytes at offset {offset} of {path} "
            "do not match the checksum written with them. The disk or the file was damaged; the cache cannot "
            "continue, release() it and recompute the sequence."
        )


class SpillFileLost(SpillError):
    """The spill file (or its directory) was removed or became unreadable while the cache still needed it."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(
            f"The KV spill file {path} is gone or unusable ({detail}); blocks spilled to it are lost. Keep the "
            "spill directory in place while the cache is alive; release() this cache and recompute the sequence."
        )
