"""A `max_resident_bytes` too small for what one sequence keeps in memory is refused at construction, by
both disk caches, with the figures; one block more is accepted.

Tiny llama: 2 layers x 2 KV heads x head dim 16 x (K + V) x float32 = 512 bytes per token, so a 4-token
block is 2,048 bytes. With no read-ahead (read_buffer_bytes=0) the whole cap is the pool's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_kvgov import DiskOffloadCache, QuantizedDiskCache
from tests.conftest import tiny_llama

MODEL = tiny_llama(num_kv_heads=2)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 4 * 4


def test_the_geometry_is_the_one_the_figures_assume() -> None:
    cache = DiskOffloadCache(MODEL, block_size=4)
    assert cache.pool is not None and cache.pool.bytes_per_block == BLOCK_BYTES
    cache.release()


def test_disk_offload_cache_needs_the_first_block_the_hot_window_and_one_step(tmp_path: Path) -> None:
    # first block + 8 hot tokens (2 blocks) + the tail + one step = 5 blocks
    with pytest.raises(ValueError, match=f"leaves {4 * BLOCK_BYTES} bytes .* need 5 blocks = {5 * BLOCK_BYTES} bytes"):
        DiskOffloadCache(MODEL, tmp_path, hot_tokens=8, max_resident_bytes=4 * BLOCK_BYTES, block_size=4,
                         read_buffer_bytes=0)  # fmt: skip
    with pytest.raises(ValueError, match="lower hot_tokens or read_buffer_bytes"):
        DiskOffloadCache(MODEL, tmp_path, hot_tokens=8, max_resident_bytes=4 * BLOCK_BYTES, block_size=4,
                         read_buffer_bytes=0)  # fmt: skip
    DiskOffloadCache(MODEL, tmp_path, hot_tokens=8, max_resident_bytes=5 * BLOCK_BYTES, block_size=4,
                     read_buffer_bytes=0).release()  # fmt: skip


def test_quantized_disk_cache_needs_its_full_precision_blocks_only(tmp_path: Path) -> None:
    # The hot window is sealed codes, outside the cap: sink + 8-token residual (2 blocks) + tail + one step = 5
    kwargs = {"hot_tokens": 64, "block_size": 4, "residual": 8, "read_buffer_bytes": 0}
    with pytest.raises(ValueError, match=f"need 5 blocks = {5 * BLOCK_BYTES} bytes .* lower residual"):
        QuantizedDiskCache(MODEL, tmp_path, max_resident_bytes=5 * BLOCK_BYTES - 1, **kwargs)  # type: ignore[arg-type]
    QuantizedDiskCache(MODEL, tmp_path, max_resident_bytes=5 * BLOCK_BYTES, **kwargs).release()  # type: ignore[arg-type]
