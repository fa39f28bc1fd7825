"""Counters of the remote prefix tier: what it read, wrote, dropped and why, as `prefix.stats().remote` shows."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from hf_kvgov.stats_repr import rounded_repr


@dataclass(frozen=True)
class RemoteStats:
    """A snapshot of a remote tier's counters.

    lookups / hits: local misses that asked the store, and those it answered with at least one block.
    blocks_read / bytes_read: blocks loaded from the store into the pool (values verified).
    blocks_written / bytes_written: blocks the writer stored; dropped_writes: blocks not written because the
    queue was full or the store was unreachable (the prefix is then only in this process).
    damaged_values: values that failed their checksum (deleted from the store, recomputed here).
    connection_failures: store commands that failed on the connection (each outage warns once);
    skipped_lookups: lookups not sent while the store was marked down (it is retried after `retry_s`).
    write_errors: writer batches that failed for any reason; the writer keeps running (`writer_alive`).
    """

    __repr__ = rounded_repr

    lookups: int = 0
    hits: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0
    damaged_values: int = 0
    connection_failures: int = 0
    skipped_lookups: int = 0
    write_errors: int = 0
    round_trips: int = 0
    rtt_mean_ms: float = 0.0
    rtt_max_ms: float = 0.0
    pending_writes: int = 0
    writer_alive: bool = True
    last_error: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# The counters `RemoteCounters.add` takes: RemoteStats' integer fields that are counted, not derived.
COUNTED = (
    "lookups", "hits", "blocks_read", "bytes_read", "blocks_written", "bytes_written", "dropped_writes",
    "damaged_values", "connection_failures", "skipped_lookups", "write_errors",
)  # fmt: skip


class RemoteCounters:
    """The mutable counters behind `RemoteStats`, shared by the caller's threads and the writer thread."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(COUNTED, 0)
        self.round_trips = 0
        self.rtt_total_s = 0.0
        self.rtt_max_s = 0.0
        self.last_error = ""
        self.lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, count in counts.items():
                self.counts[name] += count

    def round_trip(self, seconds: float) -> None:
        with self.lock:
            self.round_trips += 1
            self.rtt_total_s += seconds
            self.rtt_max_s = max(self.rtt_max_s, seconds)

    def error(self, message: str, **counts: int) -> None:
        with self.lock:
            self.last_error = message
        self.add(**counts)

    def snapshot(self, pending_writes: int, writer_alive: bool) -> RemoteStats:
        with self.lock:
            trips = self.round_trips
            return RemoteStats(
                **self.counts,
                round_trips=trips,
                rtt_mean_ms=1000 * self.rtt_total_s / trips if trips else 0.0,
                rtt_max_ms=1000 * self.rtt_max_s,
                pending_writes=pending_writes,
                writer_alive=writer_alive,
                last_error=self.last_error,
            )
