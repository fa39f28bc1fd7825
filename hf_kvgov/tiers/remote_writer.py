"""The remote tier's background writer: a bounded queue of block snapshots and one thread that stores them.

`offer` never waits: when the queue already holds `max_pending` blocks, the blocks that do not fit are
dropped and counted (the earliest blocks of a chain are kept, as they serve the most prompts). The thread
encodes each batch (host copy, checksum) and hands it to `store`; an exception there is counted and the
thread goes on with the next batch, so it never dies silently (`alive` says whether it runs).

The thread is a daemon (a process must be able to exit while the store is unreachable), so at interpreter
exit every writer still open writes what is queued first, for up to `EXIT_FLUSH_SECONDS`: a process that
ends without `close()` does not lose the blocks it already offered.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from hf_kvgov.tiers.remote_stats import RemoteCounters

# Stores (key, value) pairs, all or nothing; returns the bytes written.
Store = Callable[[list[bytes], list[bytes]], int]
# How long interpreter exit waits for each open writer's queue.
EXIT_FLUSH_SECONDS = 10.0
_OPEN: weakref.WeakSet[RemoteWriter] = weakref.WeakSet()


class Snapshot(Protocol):
    """Copies of blocks to store, one value per key (`remote_values.BlockSnapshot`, `remote_entries.EntrySnapshot`)."""

    def head(self, n: int) -> Snapshot: ...
    def encode(self, keys: Sequence[bytes]) -> list[bytes]: ...


class RemoteWriter:
    """Args: store: writes one batch; counters: where drops, writes and errors are counted; max_pending: the
    most blocks queued at once (each holds a copy of its block until written)."""

    def __init__(self, store: Store, counters: RemoteCounters, max_pending: int) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be a positive number of blocks; got {max_pending}.")
        self._store = store
        self._counters = counters
        self.max_pending = max_pending
        self._queue: deque[tuple[list[bytes], Snapshot]] = deque()
        self._pending = 0  # blocks queued or being written
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvgov-remote-writer", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def offer(self, keys: Sequence[bytes], snap: Snapshot) -> int:
        """Queue `snap`'s blocks under `keys` without waiting; returns how many were queued (the rest dropped)."""
        with self._cond:
            room = 0 if self._closed else max(0, self.max_pending - self._pending)
            taken = min(room, len(keys))
            if taken:
                self._queue.append((list(keys[:taken]), snap.head(taken)))
                self._pending += taken
                self._cond.notify_all()
        if taken < len(keys):
            self._counters.add(dropped_writes=len(keys) - taken)
        return taken

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); False if `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0 or not self.alive, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        _OPEN.discard(self)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                keys, snap = self._queue.popleft()
            try:
                self._write(keys, snap)
            finally:
                with self._cond:
                    self._pending -= len(keys)
                    self._cond.notify_all()

    def _write(self, keys: list[bytes], snap: Snapshot) -> None:
        try:
            written = self._store(keys, snap.encode(keys))
        except Exception as error:  # counted and surfaced in stats: the thread must go on
            self._counters.error(f"write: {type(error).__name__}: {error}", write_errors=1, dropped_writes=len(keys))
            return
        self._counters.add(blocks_written=len(keys), bytes_written=written)


@atexit.register
def _close_open_writers() -> None:
    # atexit runs before daemon threads are stopped, so each writer's thread can still drain its queue.
    for writer in list(_OPEN):
        writer.close(EXIT_FLUSH_SECONDS)
