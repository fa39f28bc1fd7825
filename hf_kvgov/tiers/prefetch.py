"""Read-ahead of spilled blocks into a fixed set of resident buffers, one layer ahead of the model.

    layer l calls take(l)   -> its rows are copied to the caller's tensors (waiting for any still
                               loading), blocks that were not read ahead are read now, straight into
                               those tensors; the rows are free again
    then request(l + 1)     -> a background thread reads layer l+1's blocks into free rows while
                               layer l's attention and MLP run

The buffers are `capacity` rows of one segment each (one layer of one block, one tensor per part),
allocated once, so the memory they take is fixed whatever the context length. A request takes one
contiguous run of rows, in the order of its handles: the reader fills it with one read per part and
`take` moves it with one copy per part. Blocks that do not fit
are read when their layer asks (counted as on demand). On CUDA the rows are pinned host memory and a
copy stream moves each run to device rows as soon as it is read; the consumer only orders its stream
after that copy's event.

Correctness never depends on the thread: a read ahead that failed for any reason (its block freed
meanwhile, damage, a lost file) is redone by the consumer, on its own thread, which then raises the
real error.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.tiers.disk_tier import DiskTier
from hf_kvgov.tiers.kv_segments import byte_view

_POLL_S = 1.0  # how often a waiting consumer checks that the reader thread is still alive


@dataclass(eq=False)
class _Entry:
    row: int
    state: str = "pending"  # -> "ready" | "failed"
    cancelled: bool = False  # nobody will take it: the reader releases the row when done
    event: Any = None  # CUDA: the host-to-device copy of its run


Job = tuple[int, list[tuple[int, _Entry]]]  # (layer, [(handle, entry)]) on consecutive rows


class LayerPrefetcher:
    """Reads (handle, layer) segments of a `DiskTier` ahead into `buffer_bytes` of resident rows.

    Args:
        tier: where the blocks are.
        buffer_bytes: memory for read-ahead rows (rounded down to whole segments); 0 disables it.
        device: where `take` writes (the pool's device).
    """

    def __init__(self, tier: DiskTier, buffer_bytes: int, device: torch.device) -> None:
        if buffer_bytes < 0:
            raise ValueError(f"buffer_bytes must be >= 0; got {buffer_bytes}.")
        self.tier = tier
        self.part_bytes = tier.layout.part_bytes
        self.capacity = buffer_bytes // tier.layout.segment_bytes
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._host: list[torch.Tensor] | None = None  # per part: [capacity, part bytes]
        self._staged: list[torch.Tensor] | None = None  # CUDA: device copies of the host rows
        self._stream: Any = None
        self._last_h2d: Any = None  # CUDA: the latest host-to-device copy (host rows reusable after it)
        self._last_take: Any = None  # CUDA: the consumer's latest copy out of device rows
        self._head = self._in_use = 0  # rows are handed out from _head; back to 0 whenever all are free
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._cond = threading.Condition()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.prefetched = self.on_demand = 0
        self.wait_s = 0.0  # time `take` spent on I/O the read-ahead did not hide (waits and reads now)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of read-ahead rows allocated on the pool's device (0 until the first request)."""
        rows = self._staged if self._cuda else self._host
        return 0 if rows is None else sum(part.numel() for part in rows)

    def _allocate(self) -> None:
        if self._host is not None:
            return
        shapes = [(self.capacity, size) for size in self.part_bytes]
        self._host = [torch.empty(shape, dtype=torch.uint8, pin_memory=self._cuda) for shape in shapes]
        if self._cuda:
            self._staged = [torch.empty(shape, dtype=torch.uint8, device=self.device) for shape in shapes]
            self._stream = torch.cuda.Stream(self.device)

    def _release_row(self) -> None:
        self._in_use -= 1
        if self._in_use == 0:
            self._head = 0

    # ------------------------------------------------------------------ the consumer's side

    def request(self, layer: int, handles: list[int]) -> None:
        """Start reading layer `layer` of `handles` into free rows (as many as fit, in order)."""
        if self.capacity == 0 or not handles:
            return
        todo: list[tuple[int, _Entry]] = []
        with self._cond:
            self._allocate()
            for handle in handles:
                if self._head == self.capacity:
                    break
                if (handle, layer) not in self._entries:
                    entry = _Entry(self._head)
                    self._head += 1
                    self._in_use += 1
                    self._entries[(handle, layer)] = entry
                    todo.append((handle, entry))
        if todo:
            self._start_thread()
            self._jobs.put((layer, todo))

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
        if tuple(part.shape[1] for part in parts) != self.part_bytes:
            raise ValueError(f"take needs one tensor per part, with rows of {list(self.part_bytes)} bytes.")
        with self._cond:
            found = [self._entries.pop((handle, layer), None) for handle in handles]
            for entry in found:
                if entry is not None:
                    self._wait(entry)
            self._copy_ready(found, parts)
            for entry in found:
                if entry is not None:
                    self._release_row()
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
        rows = self._staged if self._cuda else self._host
        if rows is None:
            return
        stream = torch.cuda.current_stream(self.device) if self._cuda else None
        i = 0
        while i < len(found):
            entry = found[i]
            if entry is None or entry.state != "ready":
                i += 1
                continue
            stop = i + 1
            while stop < len(found) and _continues(found[stop], entry.row + stop - i):
                stop += 1
            if stream is not None:
                for event in {id(e.event): e.event for e in found[i:stop] if e is not None}.values():
                    stream.wait_event(event)
            for part, source in zip(parts, rows, strict=True):
                part[i:stop].copy_(source[entry.row : entry.row + stop - i], non_blocking=True)
            i = stop
        if stream is not None:
            self._last_take = torch.cuda.Event()
            self._last_take.record(stream)

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
        host = [torch.empty(part.shape, dtype=torch.uint8, pin_memory=self._cuda) for part in parts]
        self.tier.read(layer, handles, [byte_view(part) for part in host])
        for part, staged in zip(parts, host, strict=True):
            part.copy_(staged)

    def _cancel(self, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            entry = self._entries.pop(key)
            if entry.state == "pending":
                entry.cancelled = True
            else:
                self._release_row()

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
            self._host = self._staged = self._stream = None
            self._head = self._in_use = 0

    # ------------------------------------------------------------------ the reader thread

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvgov-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            layer, todo = job
            loaded = self._load(layer, todo)
            with self._cond:
                for _, entry in todo:
                    if entry.cancelled:
                        self._release_row()
                    else:
                        entry.state = "ready" if loaded else "failed"
                self._cond.notify_all()

    def _load(self, layer: int, todo: list[tuple[int, _Entry]]) -> bool:
        host = self._host
        assert host is not None
        try:
            if self._last_h2d is not None:  # host rows may still be on their way to the device
                self._last_h2d.synchronize()
            first, stop = todo[0][1].row, todo[-1][1].row + 1  # a job's rows are consecutive
            self.tier.read(layer, [handle for handle, _ in todo], [byte_view(part[first:stop]) for part in host])
            if self._cuda:
                self._stage(todo)
            return True
        except Exception:  # redone by the consumer, which raises the real error on its own thread
            return False

    def _stage(self, todo: list[tuple[int, _Entry]]) -> None:
        assert self._host is not None and self._staged is not None
        first, stop = todo[0][1].row, todo[-1][1].row + 1  # a job's rows are consecutive
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if self._last_take is not None:  # the consumer may still be copying out of these rows
                self._stream.wait_event(self._last_take)
            for staged, host in zip(self._staged, self._host, strict=True):
                staged[first:stop].copy_(host[first:stop], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._last_h2d = event
        for _, entry in todo:
            entry.event = event


def _continues(entry: _Entry | None, row: int) -> bool:
    return entry is not None and entry.state == "ready" and entry.row == row
