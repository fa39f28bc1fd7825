"""What a cache that spills to the disk tier keeps in memory and may write: a validated, frozen record.

The cache (``hf_kvgov.hf.disk_cache``) applies it; nothing here decides anything at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_kvgov.tiers.disk_tier import DEFAULT_EXTENT_SLOTS

ON_FULL: tuple[str, ...] = ("raise", "keep_resident")
DEFAULT_HOT_TOKENS = 512
DEFAULT_READ_BUFFER_BYTES = 16 * 2**20


@dataclass(frozen=True)
class DiskCacheConfig:
    """What `DiskOffloadCache` keeps in memory and may write (its docstring describes each field)."""

    path: str | None = None
    hot_tokens: int = DEFAULT_HOT_TOKENS
    max_resident_bytes: int | None = None
    max_write_bytes: int | None = None
    read_buffer_bytes: int | None = None
    prefetch: bool = True
    on_full: str = "raise"
    extent_blocks: int = DEFAULT_EXTENT_SLOTS

    def __post_init__(self) -> None:
        if self.path is not None and Path(self.path).exists() and not Path(self.path).is_dir():
            raise ValueError(f"path must be a directory for the spill file; {self.path!r} is not one.")
        _check_int("hot_tokens", self.hot_tokens, minimum=0)
        _check_int("extent_blocks", self.extent_blocks, minimum=1)
        for name in ("max_resident_bytes", "max_write_bytes", "read_buffer_bytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1 if name != "read_buffer_bytes" else 0)
        if self.on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}; got {self.on_full!r}.")
        if self.max_resident_bytes is not None and self.buffer_bytes >= self.max_resident_bytes:
            raise ValueError(
                f"read_buffer_bytes={self.buffer_bytes} leaves nothing of max_resident_bytes="
                f"{self.max_resident_bytes} for the pool; give the buffers a smaller share."
            )

    @property
    def buffer_bytes(self) -> int:
        """The most read-ahead memory: as given, else a quarter of `max_resident_bytes`, else 16 MiB.

        A cap: the rows are allocated as spilled blocks are read back (one layer of them, `tiers.prefetch`),
        so a request that spills nothing holds none. `max_resident_bytes` still reserves all of it.
        """
        if not self.prefetch:
            return 0
        if self.read_buffer_bytes is not None:
            return self.read_buffer_bytes
        if self.max_resident_bytes is not None:
            return self.max_resident_bytes // 4
        return DEFAULT_READ_BUFFER_BYTES

    @property
    def pool_bytes(self) -> int | None:
        return None if self.max_resident_bytes is None else self.max_resident_bytes - self.buffer_bytes


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}.")
