"""What the disk tier counts: bytes moved, read latencies, and the figures derived from them."""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

DEFAULT_LATENCY_WINDOW = 65_536


class LatencyRecorder:
    """Count and mean of every duration added; p99 over the latest `window` of them (bounded memory).

    Thread-safe: the prefetch thread and the caller's thread both record reads.
    """

    def __init__(self, window: int = DEFAULT_LATENCY_WINDOW) -> None:
        if window <= 0:
            raise ValueError(f"The latency window must hold at least one sample; got {window}.")
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.count = 0
        self.total_s = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._recent.append(seconds)
            self.count += 1
            self.total_s += seconds

    @property
    def mean_s(self) -> float:
        with self._lock:
            return self.total_s / self.count if self.count else 0.0

    def percentile_s(self, q: float) -> float:
        """Nearest-rank percentile (`q` in (0, 100]) of the recent window; 0.0 when nothing was recorded."""
        if not 0 < q <= 100:
            raise ValueError(f"Percentiles are in (0, 100]; got {q}.")
        with self._lock:
            ordered = sorted(self._recent)
        if not ordered:
            return 0.0
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class TierStats:
    """Counters of one `DiskTier` since it was created.

    A fetch is one read of one layer of a run of blocks in adjacent slots (one ``preadv`` per part),
    checksums verified; its latency includes the verification.
    """

    path: str | None  # the spill file, None before the first spill
    slot_bytes: int  # one block, every layer
    slots_in_use: int
    file_bytes: int  # reserved on disk (whole extents)
    blocks_written: int
    bytes_written: int  # handed to the OS, including bytes of writes that failed
    payload_bytes_written: int  # bytes of the blocks that were stored successfully
    bytes_read: int
    fetches: int
    blocks_fetched: int  # (block, layer) segments read
    fetch_latency_mean_s: float
    fetch_latency_p99_s: float
    failed_writes: int

    @property
    def write_amplification(self) -> float:
        """Bytes written per byte of block stored; 1.0 unless writes failed halfway."""
        return self.bytes_written / self.payload_bytes_written if self.payload_bytes_written else 0.0
