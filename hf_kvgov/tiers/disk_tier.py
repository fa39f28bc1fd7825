"""The disk tier: ref-counted spilled blocks in one `SlotFile`, a checksum per (block, layer), a write budget.

Bytes in, bytes out: the tier never interprets a segment (raw K/V, or codes and scales); it only needs every block
to have `layers` segments, layer l's of the same parts in every block (`TierLayout.parts(l)`). A block is written
once, when it spills: blocks shared by beams are one handle with a reference count, its slot freed at zero.
``zlib.crc32`` of each segment is verified on every read; that can cost more than the read itself when the page
cache serves it (``hashlib.blake2b`` is slower still), so reads run on the read-ahead thread, where zlib releases
the GIL and the cost overlaps compute. CRC-32 catches every burst up to 32 bits and random damage with probability
1 - 2^-32; it guards against damage, not tampering (the file is private scratch). Writes are all-or-nothing: when
the disk fills or the budget would be exceeded, nothing of the batch is readable and the caller still holds it.
"""

from __future__ import annotations

import errno
import heapq
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_kvgov.errors import SpillCorrupted, SpillError, SpillFileLost, SpillSpaceExhausted
from hf_kvgov.tiers.accounting import LatencyRecorder, TierStats
from hf_kvgov.tiers.slot_file import SlotFile, check_writable

DEFAULT_EXTENT_SLOTS = 64
_SPACE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

# segments(layer)[i][p] = part p of block i's segment for that layer.
SegmentSource = Callable[[int], Sequence[Sequence[memoryview]]]


@dataclass(frozen=True)
class TierLayout:
    """Every block has `layers` segments, each the parts of `part_bytes` (raw K/V: keys, values): one per layer
    of the pool's block (every layer of the model, or one layer group's layers when the pool groups them).

    `layer_parts`, when given, overrides `part_bytes` per layer (one tuple per layer): blocks whose layers
    are stored differently, such as sealed blocks with some layers kept in full precision.
    """

    layers: int
    part_bytes: tuple[int, ...]
    extent_slots: int = DEFAULT_EXTENT_SLOTS  # blocks reserved on disk per file growth step
    layer_parts: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "extent_slots"):
            _check_positive(f"TierLayout.{name}", getattr(self, name))
        _check_parts("TierLayout.part_bytes", self.part_bytes)
        if self.layer_parts is not None:
            if not isinstance(self.layer_parts, tuple) or len(self.layer_parts) != self.layers:
                raise ValueError(
                    f"TierLayout.layer_parts must be a tuple of one parts tuple per layer ({self.layers}); "
                    f"got {self.layer_parts!r}."
                )
            for layer, parts in enumerate(self.layer_parts):
                _check_parts(f"TierLayout.layer_parts[{layer}]", parts)

    def parts(self, layer: int) -> tuple[int, ...]:
        """Bytes of each part of a layer-`layer` segment."""
        return self.part_bytes if self.layer_parts is None else self.layer_parts[layer]

    @property
    def segment_bytes(self) -> int:
        """Bytes of the largest segment (every segment, unless `layer_parts` differ)."""
        return max(sum(self.parts(layer)) for layer in range(self.layers))

    @property
    def slot_bytes(self) -> int:
        return sum(sum(self.parts(layer)) for layer in range(self.layers))


def _check_parts(name: str, parts: object) -> None:
    if not isinstance(parts, tuple) or not parts:
        raise ValueError(f"{name} must be a non-empty tuple of ints; got {parts!r}.")
    for size in parts:
        _check_positive(f"Every {name} entry", size)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}.")


class StaleRead(LookupError):
    """A read named a block that is no longer spilled (it was freed, possibly while being read)."""


@dataclass
class _Spilled:
    slot: int
    refs: int
    checksums: list[int]  # one per layer


def segment_checksum(parts: Sequence[memoryview]) -> int:
    """CRC-32 of a segment's parts, back to back."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


class DiskTier:
    """Spilled blocks by handle (an int never reused), stored in a private file under `directory`.

    Args:
        layout: segments per block and their size.
        directory: where the spill file is created (created if missing); None: a private temporary
            directory, deleted with the file.
        max_write_bytes: cap on the bytes this tier ever writes (SSD wear budget); None: no cap.
    """

    def __init__(self, layout: TierLayout, directory: str | Path | None = None, max_write_bytes: int | None = None):
        if directory is not None and Path(directory).exists() and not Path(directory).is_dir():
            raise ValueError(f"The spill path must be a directory; {str(directory)!r} exists and is not one.")
        if max_write_bytes is not None and (isinstance(max_write_bytes, bool) or max_write_bytes <= 0):
            raise ValueError(f"max_write_bytes must be a positive number of bytes or None; got {max_write_bytes!r}.")
        self.layout = layout
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            check_writable(self.directory)
        self.max_write_bytes = max_write_bytes
        self.latency = LatencyRecorder()
        self._lock = threading.Lock()
        self._file: SlotFile | None = None
        self._blocks: dict[int, _Spilled] = {}
        self._free_slots: list[int] = []  # a heap: the lowest slot first keeps new blocks adjacent
        self._next_handle = 0
        self._closed_written = self._closed_read = 0  # bytes counted by files already closed
        self.blocks_written = self.payload_bytes_written = self.failed_writes = 0
        self.fetches = self.blocks_fetched = 0

    # ------------------------------------------------------------------ the file

    @property
    def path(self) -> str | None:
        return self._file.path if self._file is not None else None

    def _where(self) -> str:
        return self.path or str(self.directory or "a private temporary directory")

    def _open_file(self) -> SlotFile:
        if self._file is None:
            if self.directory is None:
                self._file = self._new_file(Path(tempfile.mkdtemp(prefix="kvgov-spill-")), True)
            else:
                try:
                    self.directory.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    raise SpillFileLost(str(self.directory), f"cannot create the directory: {err.strerror}") from err
                self._file = self._new_file(self.directory, False)
        self._file.check()
        return self._file

    def _new_file(self, directory: Path, private: bool) -> SlotFile:
        layout = self.layout
        parts = [layout.parts(layer) for layer in range(layout.layers)]
        return SlotFile(directory, layout.layers, parts, layout.extent_slots, private)

    def close(self) -> None:
        """Delete the spill file (the tier stays usable: the next `put` creates a new one)."""
        with self._lock:
            if self._file is not None:
                self._closed_written += self._file.bytes_written
                self._closed_read += self._file.bytes_read
                self._file.close()
            self._file = None
            self._blocks.clear()
            self._free_slots = []

    def drop_page_cache(self) -> None:
        """Make the next reads come from the device rather than the OS page cache (for benchmarks)."""
        if self._file is not None:
            self._file.drop_page_cache()

    # ------------------------------------------------------------------ writes

    @property
    def bytes_written(self) -> int:
        return self._closed_written + (self._file.bytes_written if self._file is not None else 0)

    def blocks_within_budget(self, count: int) -> int:
        """How many of `count` more blocks the write budget allows."""
        if self.max_write_bytes is None:
            return count
        return max(0, min(count, (self.max_write_bytes - self.bytes_written) // self.layout.slot_bytes))

    def put(self, count: int, refs: Sequence[int], segments: SegmentSource) -> list[int]:
        """Store `count` blocks, block i with `refs[i]` references; returns their handles.

        `segments(layer)` is called once per layer, in order, so a caller copying from a device holds one
        layer at a time. Raises `SpillSpaceExhausted` (nothing stored) when the disk or the budget is full.
        """
        if len(refs) != count or any(r <= 0 for r in refs):
            raise ValueError(f"put needs one positive reference count per block; got {list(refs)} for {count}.")
        if count == 0:
            return []
        if self.blocks_within_budget(count) < count:
            detail = f"{self.bytes_written} of max_write_bytes={self.max_write_bytes} written, {count} block(s) "
            raise SpillSpaceExhausted("write budget", self._where(), detail + f"of {self.layout.slot_bytes} more")
        file = self._open_file()
        slots = self._take_slots(file, count)
        try:
            checksums = self._write_layers(file, slots, segments)
        except BaseException as err:
            with self._lock:
                for slot in slots:
                    heapq.heappush(self._free_slots, slot)
                self.failed_writes += 1
            if isinstance(err, OSError):
                raise _translate(err, file.path) from err
            raise
        with self._lock:
            handles = list(range(self._next_handle, self._next_handle + count))
            self._next_handle += count
            for handle, slot, ref, sums in zip(handles, slots, refs, checksums, strict=True):
                self._blocks[handle] = _Spilled(slot, ref, sums)
            self.blocks_written += count
            self.payload_bytes_written += count * self.layout.slot_bytes
        return handles

    def _take_slots(self, file: SlotFile, count: int) -> list[int]:
        with self._lock:
            while len(self._free_slots) < count:
                first = file.capacity
                try:
                    file.add_extent()
                except OSError as err:
                    raise _translate(err, file.path) from err
                for slot in range(first, file.capacity):
                    heapq.heappush(self._free_slots, slot)
            return [heapq.heappop(self._free_slots) for _ in range(count)]

    def _write_layers(self, file: SlotFile, slots: list[int], segments: SegmentSource) -> list[list[int]]:
        checksums: list[list[int]] = [[] for _ in slots]
        for layer in range(self.layout.layers):
            blocks = segments(layer)
            if len(blocks) != len(slots):
                raise ValueError(f"segments({layer}) gave {len(blocks)} blocks; {len(slots)} were being stored.")
            for sums, parts in zip(checksums, blocks, strict=True):
                self._check_parts([part.nbytes for part in parts], layer)
                sums.append(segment_checksum(parts))
            for start, stop in _runs(slots, self.layout.extent_slots):
                for p in range(len(self.layout.parts(layer))):
                    file.write_at(file.offset(slots[start], layer, p), [parts[p] for parts in blocks[start:stop]])
        return checksums

    def _check_parts(self, sizes: list[int], layer: int) -> None:
        if tuple(sizes) != self.layout.parts(layer):
            raise ValueError(
                f"A layer {layer} segment has parts of {sizes} bytes; this tier stores parts of "
                f"{list(self.layout.parts(layer))} for that layer."
            )

    # ------------------------------------------------------------------ references

    def refs(self, handle: int) -> int:
        with self._lock:
            block = self._blocks.get(handle)
            return block.refs if block is not None else 0

    def is_live(self, handle: int) -> bool:
        return self.refs(handle) > 0

    def incref(self, handles: Sequence[int]) -> None:
        with self._lock:
            for handle in self._checked(handles, 0):
                self._blocks[handle].refs += 1

    def decref(self, handles: Sequence[int]) -> None:
        """Drop one reference per handle; a block left with none frees its slot."""
        with self._lock:
            for handle in self._checked(handles, 1):
                block = self._blocks[handle]
                block.refs -= 1
                if block.refs == 0:
                    del self._blocks[handle]
                    heapq.heappush(self._free_slots, block.slot)

    def _checked(self, handles: Sequence[int], drop: int) -> list[int]:
        """Validate every handle before changing anything (so a bad one leaves all counts as they were)."""
        remaining: dict[int, int] = {}
        for handle in handles:
            block = self._blocks.get(handle)
            remaining[handle] = remaining.get(handle, block.refs if block else 0) - drop
            if block is None or remaining[handle] < 0:
                raise ValueError(f"Spilled block {handle} is not held (freed twice, or never spilled).")
        return list(handles)

    # ------------------------------------------------------------------ reads

    def read(self, layer: int, handles: Sequence[int], parts: Sequence[memoryview]) -> None:
        """Read layer `layer` of blocks `handles`, verified, into one buffer per part.

        `parts[p]` holds `len(handles) * part_bytes[p]` bytes: block `handles[i]` goes to its i-th slice.
        Blocks in adjacent slots (in the order given) are one read per part. Raises `SpillCorrupted` on a
        checksum mismatch, `SpillFileLost` if the file is gone, `StaleRead` if a handle is not spilled.
        """
        if not handles:
            return
        with self._lock:
            found = [self._blocks.get(handle) for handle in handles]
            file = self._file
        blocks = [block for block in found if block is not None]
        if len(blocks) != len(handles) or file is None:
            raise StaleRead(f"Blocks {list(handles)} are not all spilled.")
        sizes = self.layout.parts(layer)
        views = [part.cast("B") for part in parts]
        self._check_parts([view.nbytes // len(handles) for view in views], layer)
        file.check()
        for start, stop in _runs([block.slot for block in blocks], self.layout.extent_slots):
            began = time.perf_counter()
            try:
                for p, (view, size) in enumerate(zip(views, sizes, strict=True)):
                    file.read_at(file.offset(blocks[start].slot, layer, p), view[start * size : stop * size])
            except OSError as err:
                raise SpillFileLost(file.path, err.strerror or "read failed") from err
            for i in range(start, stop):
                got = segment_checksum(
                    [view[i * size : (i + 1) * size] for view, size in zip(views, sizes, strict=True)]
                )
                if got != blocks[i].checksums[layer]:
                    self._corrupted(handles[i], blocks[i], layer, file)
            self.latency.add(time.perf_counter() - began)
            with self._lock:
                self.fetches += 1
                self.blocks_fetched += stop - start

    def _corrupted(self, handle: int, block: _Spilled, layer: int, file: SlotFile) -> None:
        with self._lock:
            still_there = self._blocks.get(handle) is block
        if not still_there:  # freed and its slot reused while we read: not damage
            raise StaleRead(f"Spilled block {handle} was freed while being read.")
        raise SpillCorrupted(handle, layer, file.path, file.offset(block.slot, layer))

    def location(self, handle: int, layer: int) -> tuple[str, int]:
        """(file path, byte offset) of one layer of a spilled block."""
        with self._lock:
            block = self._blocks.get(handle)
        if block is None or self._file is None:
            raise StaleRead(f"Block {handle} is not spilled.")
        return self._file.path, self._file.offset(block.slot, layer)

    # ------------------------------------------------------------------ accounting

    def stats(self) -> TierStats:
        file = self._file
        with self._lock:
            in_use = len(self._blocks)
        extents = file.capacity // self.layout.extent_slots if file is not None else 0
        return TierStats(
            path=self.path,
            slot_bytes=self.layout.slot_bytes,
            slots_in_use=in_use,
            file_bytes=extents * self.layout.extent_slots * self.layout.slot_bytes,
            blocks_written=self.blocks_written,
            bytes_written=self.bytes_written,
            payload_bytes_written=self.payload_bytes_written,
            bytes_read=self._closed_read + (file.bytes_read if file is not None else 0),
            fetches=self.fetches,
            blocks_fetched=self.blocks_fetched,
            fetch_latency_mean_s=self.latency.mean_s,
            fetch_latency_p99_s=self.latency.percentile_s(99),
            failed_writes=self.failed_writes,
        )


def _translate(err: OSError, path: str) -> SpillError:
    if err.errno in _SPACE_ERRORS:
        return SpillSpaceExhausted("disk full", path, err.strerror or f"errno {err.errno}")
    return SpillFileLost(path, err.strerror or f"errno {err.errno}")


def _runs(slots: Sequence[int], extent_slots: int) -> Iterator[tuple[int, int]]:
    """[start, stop) index ranges over which `slots` go up by one without leaving an extent."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or slots[i] % extent_slots == 0:
            yield start, i
            start = i
