"""Read-ahead of spilled blocks into resident buffers sized by what is spilled, one layer ahead of the model.

    layer l calls take(l)   -> its rows are copied to the caller's tensors (waiting for any still loading),
                               blocks not read ahead are read now, straight into them; the rows are free again
    then request(l + 1)     -> a background thread reads layer l+1's blocks into free rows while
                               layer l's attention and MLP run

A row holds one segment and a layer asks one per spilled block, so rows follow the spill (one layer of the spilled
blocks, up to `buffer_bytes`) and never cost memory the spill does not save. A request's rows are one contiguous
run (pinned, with a copy stream, on CUDA), and each device has its own rows, so blocks land on the device of the
layer reading them. Correctness never depends on the thread: the consumer redoes a failed read-ahead and raises.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.disk_tier import DiskTier
from hf_kvgov.tiers.kv_segments import byte_view

_POLL_S = 1.0  # how often a waiting consumer checks that the reader thread is still alive

DeviceOf = Callable[[int], torch.device]  # layer -> the device its reader wants the blocks on
_RowsKey = tuple[torch.device, tuple[int, ...]]  # (device, a segment's part bytes)


@dataclass(eq=False)
class _Rows:
    """The read-ahead rows of one device: host rows (pinned for CUDA) and, on CUDA, their device copies."""

    device: torch.device
    limit: int  # the most rows: this device's share of the budget
    part_bytes: tuple[int, ...]
    capacity: int = 0  # rows allocated
    host: list[torch.Tensor] | None = None  # per part: [capacity, part bytes]
    staged: list[torch.Tensor] | None = None  # CUDA: device copies of the host rows
    stream: Any = None
    last_h2d: Any = None  # CUDA: the latest host-to-device copy (host rows reusable after it)
    last_take: Any = None  # CUDA: the consumer's latest copy out of device rows
    head: int = 0  # rows are handed out from head; back to 0 whenever all are free
    in_use: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def fit(self, wanted: int, afford: Callable[[int], bool]) -> None:
        """Grow to `wanted` rows (at most `limit`) if none is in use (nothing refers to the old rows then) and
        `afford` takes the bytes they add."""
        rows = min(wanted, self.limit)
        if rows <= self.capacity or self.in_use or not afford((rows - self.capacity) * sum(self.part_bytes)):
            return
        if self.last_h2d is not None:  # the old host rows may still be on their way to the device
            self.last_h2d.synchronize()
            self.last_h2d = None
        self.capacity = rows
        shapes = [(rows, size) for size in self.part_bytes]
        self.host = [torch.empty(shape, dtype=torch.uint8, pin_memory=self.cuda) for shape in shapes]
        # The consumer may still be copying out of the old device rows: their memory is reused in its stream's
        # order, and the reader waits for `last_take` before it writes the new ones.
        if self.cuda:
            self.staged = [torch.empty(shape, dtype=torch.uint8, device=self.device) for shape in shapes]
            if self.stream is None:
                self.stream = torch.cuda.Stream(self.device)

    @property
    def source(self) -> list[torch.Tensor] | None:
        """The rows a consumer copies from: on the device."""
        return self.staged if self.cuda else self.host

    def claim(self) -> int:
        self.head += 1
        self.in_use += 1
        return self.head - 1

    def release(self) -> None:
        self.in_use -= 1
        if self.in_use == 0:
            self.head = 0


@dataclass(eq=False)
class _Entry:
    row: int
    rows: _Rows
    state: str = "pending"  # -> "ready" | "failed"
    cancelled: bool = False  # nobody will take it: the reader releases the row when done
    event: Any = None  # CUDA: the host-to-device copy of its run


Job = tuple[int, _Rows, list[tuple[int, _Entry]]]  # (layer, its device's rows, [(handle, entry)] on consecutive rows)


class LayerPrefetcher:
    """Reads (handle, layer) segments of a `DiskTier` ahead into `buffer_bytes` of resident rows.

    Args:
        tier: where the blocks are.
        buffer_bytes: the most memory for read-ahead rows (rounded down to whole segments, split evenly
            between the devices the layers are on); 0 disables it. Rows are allocated as blocks are read
            back, one per spilled block of a layer, up to this.
        device: where `take` writes: one device (the pool's), or a function from layer to its device,
            asked when the rows are first needed.
        pool: the pool of the blocks read back: the rows are charged to it (`BlockPool.charge`), so its cap
            counts them, and rows its cap has no room for are not allocated (those blocks are read on demand).
    """

    def __init__(
        self, tier: DiskTier, buffer_bytes: int, device: torch.device | str | DeviceOf, pool: BlockPool | None = None
    ) -> None:
        if buffer_bytes < 0:
            raise ValueError(f"buffer_bytes must be >= 0; got {buffer_bytes}.")
        self.tier = tier
        self.pool = pool
        self.capacity = buffer_bytes // tier.layout.segment_bytes  # the most rows (of the largest segment)
        self._budget = buffer_bytes
        self._device_of: DeviceOf = device if callable(device) else _always(torch.device(device))
        self._rows: dict[_RowsKey, _Rows] | None = None  # per device and segment shape, set on first use
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._cond = threading.Condition()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.prefetched = self.on_demand = 0
        self.wait_s = 0.0  # time `take` spent on I/O the read-ahead did not hide (waits and reads now)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of read-ahead rows allocated on the layers' devices (0 until a spilled block is requested)."""
        sources = [rows.source for rows in (self._rows or {}).values()]
        return sum(part.numel() for source in sources if source is not None for part in source)

    @property
    def _host(self) -> list[torch.Tensor] | None:
        """Every device's host rows (None before the first request)."""
        if self._rows is None:
            return None
        return [part for rows in self._rows.values() for part in rows.host or []]

    def _afford(self, extra: int) -> bool:
        """Whether the pool takes `extra` more bytes of rows (charged before they are allocated); always without one."""
        if self.pool is None:
            return True
        try:
            self.pool.charge(self, self.buffer_bytes + extra)
        except PoolExhausted:
            return False
        return True

    def _key(self, layer: int) -> _RowsKey:
        return torch.device(self._device_of(layer)), self.tier.layout.parts(layer)

    def _rows_of(self, layer: int) -> _Rows | None:
        """Layer `layer`'s rows (its device's, its segment shape's); every key's share is set on first use."""
        if self._rows is None:
            keys = list(dict.fromkeys(self._key(layer) for layer in range(self.tier.layout.layers)))
            budget = self._budget // len(keys)
            self._rows = {key: _Rows(key[0], budget // sum(key[1]), key[1]) for key in keys}
        return self._rows.get(self._key(layer))

    # ------------------------------------------------------------------ the consumer's side

    def request(self, layer: int, handles: list[int]) -> None:
        """Start reading layer `layer` of `handles` into free rows (as many as fit, in order)."""
        if self.capacity == 0 or not handles:
            return
        todo: list[tuple[int, _Entry]] = []
        with self._cond:
            rows = self._rows_of(layer)  # None: the layer moved to a device that has no rows
            if rows is not None:
                rows.fit(len(handles), self._afford)
            for handle in handles:
                if rows is None or rows.head == rows.capacity:
                    break
                if (handle, layer) not in self._entries:
                    entry = _Entry(rows.claim(), rows)
                    self._entries[(handle, layer)] = entry
                    todo.append((handle, entry))
        if todo and rows is not None:
            self._start_thread()
            self._jobs.put((layer, rows, todo))

    def take(self, layer: int, handles: list[int], outs: list[torch.Tensor]) -> None:
        """Write layer `layer` of block `handles[i]` into row i of `outs`, verified.

        `outs` are contiguous tensors on the device, one per part (for raw K/V: `[keys, values]`), with
        `len(handles)` rows of that part's size.
        """
        if not handles:
            return
        if not all(out.is_contiguous() for out in outs):
            raise ValueError("take writes into its output tensors in place; give contiguous ones.")
        began = time.perf_counter()
        parts = [out.reshape(len(handles), -1).view(torch.uint8) for out in outs]
        wanted = self.tier.layout.parts(layer)
        if tuple(part.shape[1] for part in parts) != wanted:
            raise ValueError(f"take needs one tensor per part, with rows of {list(wanted)} bytes.")
        with self._cond:
            found = [self._entries.pop((handle, layer), None) for handle in handles]
            for entry in found:
                if entry is not None:
                    self._wait(entry)
            self._copy_ready(found, parts)
            for entry in found:
                if entry is not None:
                    entry.rows.release()
            self._cancel([key for key in self._entries if key[1] == layer])  # read ahead for blocks gone since
        missing = [i for i, entry in enumerate(found) if entry is None or entry.state != "ready"]
        if missing:
            self._read_now(layer, [handles[i] for i in missing], parts, missing)
        self.prefetched += len(handles) - len(missing)
        self.on_demand += len(missing)
        self.wait_s += time.perf_counter() - began

    def _wait(self, entry: _Entry) -> None:
        while entry.state == "pending":
            if not self._cond.wait(timeout=_POLL_S) and not (self._thread and self._thread.is_alive()):
                entry.state = "failed"

    def _copy_ready(self, found: list[_Entry | None], parts: list[torch.Tensor]) -> None:
        """Copy runs of ready entries on consecutive rows with one copy per part."""
        i = 0
        while i < len(found):
            entry = found[i]
            if entry is None or entry.state != "ready" or entry.rows.source is None:
                i += 1
                continue
            stop = i + 1
            while stop < len(found) and _continues(found[stop], entry, stop - i):
                stop += 1
            self._copy_run(entry.rows, found[i:stop], [part[i:stop] for part in parts])
            i = stop

    def _copy_run(self, rows: _Rows, run: list[_Entry | None], parts: list[torch.Tensor]) -> None:
        first = run[0]
        assert first is not None and rows.source is not None
        stream = torch.cuda.current_stream(rows.device) if rows.cuda else None
        if stream is not None:
            for event in {id(e.event): e.event for e in run if e is not None}.values():
                stream.wait_event(event)
        for part, source in zip(parts, rows.source, strict=True):
            part.copy_(source[first.row : first.row + len(run)], non_blocking=True)
        if stream is not None:
            rows.last_take = torch.cuda.Event()
            rows.last_take.record(stream)

    def _read_now(self, layer: int, handles: list[int], parts: list[torch.Tensor], rows: list[int]) -> None:
        """Read handles[j] into row rows[j] of every part: one tier read per run of consecutive rows."""
        start = 0
        for j in range(1, len(rows) + 1):
            if j == len(rows) or rows[j] != rows[j - 1] + 1:
                first, stop = rows[start], rows[start] + j - start
                self._read_into(layer, handles[start:j], [part[first:stop] for part in parts])
                start = j

    def _read_into(self, layer: int, handles: list[int], parts: list[torch.Tensor]) -> None:
        if parts[0].device.type == "cpu":
            self.tier.read(layer, handles, [byte_view(part) for part in parts])
            return
        pinned = parts[0].device.type == "cuda"
        host = [torch.empty(part.shape, dtype=torch.uint8, pin_memory=pinned) for part in parts]
        self.tier.read(layer, handles, [byte_view(part) for part in host])
        for part, staged in zip(parts, host, strict=True):
            part.copy_(staged)

    def _cancel(self, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            entry = self._entries.pop(key)
            if entry.state == "pending":
                entry.cancelled = True
            else:
                entry.rows.release()

    def clear(self) -> None:
        """Forget everything read ahead (after a reset, a crop, a reorder)."""
        with self._cond:
            self._cancel(list(self._entries))

    def close(self) -> None:
        """Stop the reader thread and free the rows (the prefetcher restarts on the next request)."""
        self.clear()
        if self._thread is not None:
            self._jobs.put(None)
            if self._thread is not threading.current_thread():  # garbage collection may run on the reader
                self._thread.join()
            self._thread = None
        with self._cond:
            self._rows = None  # devices are asked again on the next request
            if self.pool is not None:
                self.pool.charge(self, 0)

    # ------------------------------------------------------------------ the reader thread

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvgov-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            layer, rows, todo = job
            loaded = self._load(layer, rows, todo)
            with self._cond:
                for _, entry in todo:
                    if entry.cancelled:
                        rows.release()
                    else:
                        entry.state = "ready" if loaded else "failed"
                self._cond.notify_all()

    def _load(self, layer: int, rows: _Rows, todo: list[tuple[int, _Entry]]) -> bool:
        host = rows.host
        assert host is not None
        try:
            if rows.last_h2d is not None:  # host rows may still be on their way to the device
                rows.last_h2d.synchronize()
            first, stop = todo[0][1].row, todo[-1][1].row + 1  # a job's rows are consecutive
            self.tier.read(layer, [handle for handle, _ in todo], [byte_view(part[first:stop]) for part in host])
            if rows.cuda:
                self._stage(rows, todo)
            return True
        except Exception:  # redone by the consumer, which raises the real error on its own thread
            return False

    def _stage(self, rows: _Rows, todo: list[tuple[int, _Entry]]) -> None:
        assert rows.host is not None and rows.staged is not None
        first, stop = todo[0][1].row, todo[-1][1].row + 1  # a job's rows are consecutive
        with torch.cuda.device(rows.device), torch.cuda.stream(rows.stream):
            if rows.last_take is not None:  # the consumer may still be copying out of these rows
                rows.stream.wait_event(rows.last_take)
            for staged, host in zip(rows.staged, rows.host, strict=True):
                staged[first:stop].copy_(host[first:stop], non_blocking=True)
            event = torch.cuda.Event()
            event.record(rows.stream)
        rows.last_h2d = event
        for _, entry in todo:
            entry.event = event


def _continues(entry: _Entry | None, first: _Entry, offset: int) -> bool:
    """`entry` is ready on the row `offset` rows after `first`'s, in the same device's rows."""
    return entry is not None and entry.state == "ready" and entry.rows is first.rows and entry.row == first.row + offset


def _always(device: torch.device) -> DeviceOf:
    return lambda layer: device
