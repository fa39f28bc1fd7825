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


def test_quantized_disk_cache_needs_its_full_precision_blocks_and_the_hot_windows_codes(tmp_path: Path) -> None:
    # sink + 8-token residual (2 blocks) + tail + one step = 5 full-precision blocks, and the 64-token hot window's
    # 16 sealed blocks (int8: 2 layers x 2 heads x (2 x 4 x 16 codes + 16 key scales and zeros x 2 bytes + 4 value
    # scales and zeros x 2 bytes) = 832 bytes each): the cap counts every byte in memory.
    sealed = 2 * 2 * (2 * 4 * 16 + 2 * 16 * 2 + 2 * 4 * 2)
    needed = 5 * BLOCK_BYTES + 16 * sealed
    kwargs = {"hot_tokens": 64, "block_size": 4, "residual": 8, "read_buffer_bytes": 0}
    with pytest.raises(ValueError, match=f"need 5 blocks and 16 sealed blocks = {needed} bytes .* lower residual"):
        QuantizedDiskCache(MODEL, tmp_path, max_resident_bytes=needed - 1, **kwargs)  # type: ignore[arg-type]
    cache = QuantizedDiskCache(MODEL, tmp_path, max_resident_bytes=needed, **kwargs)  # type: ignore[arg-type]
    assert cache.pool is not None and cache.pool.max_bytes == needed  # one cap for blocks and codes
    cache.release()
