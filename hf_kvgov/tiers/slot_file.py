"""One preallocated file of fixed-size block slots: where spilled KV blocks live on disk.

A block is one segment per layer, so the layer about to run is read without the others; the file grows by extents
reserved with ``posix_fallocate``, so a full disk shows up when an extent is added, not halfway through a block
(`SlotFile` gives the layout). The file comes from ``mkstemp`` (mode 0600), so two caches never share one; `close()`
or garbage collection deletes it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

from hf_kvgov.errors import SpillFileLost

IOV_MAX = 1024  # POSIX minimum for preadv/pwritev; Linux's limit too
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _close_and_remove(fd: int, path: str, remove_dir: str | None) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)
    if remove_dir is not None:
        shutil.rmtree(remove_dir, ignore_errors=True)


class SlotFile:
    """Fixed-size slots of `layers` segments made of parts of `part_bytes`, in one growing file.

    The file is a sequence of extents reserved with ``posix_fallocate``::

        extent e    = layer 0 | layer 1 | ... | layer L-1                  (C slots each)
        layer l     = part 0 of slots eC .. eC+C-1 | part 1 of the same slots | ...
        (slot s, layer l, part p) -> (s // C) * C*(S_0 + .. + S_{L-1}) + C * (S_0 + .. + S_{l-1})
                                     + C * (P_l0 + .. + P_l(p-1)) + (s % C) * P_lp
        C = extent_slots, P_lp = bytes of part p of layer l, S_l = P_l0 + P_l1 + ... (one segment)

    This order because reads are per layer, over many blocks, into one buffer per part: part p of consecutive
    slots is one range, so a run of blocks is one ``preadv`` per part.

    Args:
        directory: where the file is created (must exist).
        part_bytes: the parts of every layer's segment, or one such tuple per layer.
        remove_directory: also delete `directory` when the file is closed (a private temporary one).
    """

    def __init__(
        self,
        directory: Path,
        layers: int,
        part_bytes: Sequence[int] | Sequence[Sequence[int]],
        extent_slots: int,
        remove_directory: bool = False,
    ) -> None:
        self.layers = layers
        self.layer_parts = _per_layer(part_bytes, layers)
        self.extent_slots = extent_slots
        sizes = [sum(parts) for parts in self.layer_parts]
        self._layer_starts = [extent_slots * sum(sizes[:layer]) for layer in range(layers)]
        self._part_starts = [[extent_slots * sum(parts[:p]) for p in range(len(parts))] for parts in self.layer_parts]
        self.extent_bytes = extent_slots * sum(sizes)
        try:
            self._fd, path = tempfile.mkstemp(prefix="kvgov-", suffix=".spill", dir=directory)
        except OSError as err:
            raise SpillFileLost(str(directory), f"cannot create a spill file there: {err.strerror}") from err
        self.path = path
        self.capacity = 0  # slots reserved on disk
        self.bytes_written = 0  # every byte handed to the OS, including those of a write that later failed
        self.bytes_read = 0
        owned = str(directory) if remove_directory else None
        self._finalizer = weakref.finalize(self, _close_and_remove, self._fd, path, owned)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def offset(self, slot: int, layer: int, part: int = 0) -> int:
        extent, index = divmod(slot, self.extent_slots)
        start = extent * self.extent_bytes + self._layer_starts[layer] + self._part_starts[layer][part]
        return start + index * self.layer_parts[layer][part]

    def add_extent(self) -> None:
        """Reserve `extent_slots` more slots on disk; raises OSError (e.g. ENOSPC) and changes nothing."""
        start = self.capacity // self.extent_slots * self.extent_bytes
        try:
            os.posix_fallocate(self._fd, start, self.extent_bytes)
        except OSError as err:
            if err.errno not in _NO_FALLOCATE:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)  # give back a partial reservation
                raise
            os.ftruncate(self._fd, start + self.extent_bytes)  # file systems without fallocate: sparse
        self.capacity += self.extent_slots

    def write_at(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Write `buffers` back to back from `offset` (short writes are resumed; errors raise OSError)."""
        views = [buffer.cast("B") for buffer in buffers]
        while views:
            written = os.pwritev(self._fd, views[:IOV_MAX], offset)
            self.bytes_written += written
            offset += written
            views = _advance(views, written)

    def read_at(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` from `offset`; a file shorter than that raises `SpillFileLost`."""
        view = buffer.cast("B")
        while view:
            got = os.preadv(self._fd, [view], offset)
            if got == 0:
                raise SpillFileLost(self.path, f"the file ends before offset {offset}; it was truncated")
            self.bytes_read += got
            offset += got
            view = view[got:]

    def check(self) -> None:
        """Raise `SpillFileLost` if the file was deleted (or its directory removed) underneath us."""
        if self.closed:
            raise SpillFileLost(self.path, "the spill file was already closed")
        try:
            links = os.fstat(self._fd).st_nlink
        except OSError as err:
            raise SpillFileLost(self.path, err.strerror or "fstat failed") from err
        if links == 0:
            raise SpillFileLost(self.path, "the file or its directory was deleted")

    def drop_page_cache(self) -> None:
        """Flush the file and ask the OS to forget its pages, so the next reads come from the device."""
        os.fsync(self._fd)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close and delete the file (and a private directory); idempotent."""
        self._finalizer()


def _per_layer(part_bytes: Sequence[int] | Sequence[Sequence[int]], layers: int) -> list[tuple[int, ...]]:
    """One parts tuple per layer, from one for all layers or one per layer."""
    flat = [size for size in part_bytes if isinstance(size, int)]
    if len(flat) == len(part_bytes):
        return [tuple(flat)] * layers
    nested = [tuple(parts) for parts in part_bytes if not isinstance(parts, int)]
    if len(nested) != layers:
        raise ValueError(f"part_bytes per layer needs one tuple per layer ({layers}); got {len(part_bytes)}.")
    return nested


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """The part of `views` not yet transferred after a (possibly short) transfer of `done` bytes."""
    index = 0
    while index < len(views) and done >= len(views[index]):
        done -= len(views[index])
        index += 1
    rest = views[index:]
    if rest and done:
        rest[0] = rest[0][done:]
    return rest


def check_writable(directory: Path) -> None:
    """Create `directory` if missing and create and remove a file in it, so that a spill path this process
    cannot write is refused when the cache is built, not at the first spill in the middle of a generate."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvgov-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"The spill path {str(directory)!r} cannot be written ({err.strerror or err}); give a directory this "
            "process can create files in, or path=None for a private temporary directory."
        ) from err
