"""A spill path is checked when the cache is built: one this process cannot write is refused there, with the
path and the reason, instead of failing at the first spill in the middle of a generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_kvgov import DiskOffloadCache, QuantizedDiskCache
from tests.conftest import tiny_llama


@pytest.mark.parametrize("cache_type", [DiskOffloadCache, QuantizedDiskCache])
def test_a_path_below_a_file_is_refused_at_construction(cache_type: type, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"spill path .*a-file/kv.* cannot be written"):
        cache_type(tiny_llama(), path=blocker / "kv")


def test_a_missing_directory_is_created_at_construction_and_kept_after_release(tmp_path: Path) -> None:
    target = tmp_path / "nested" / "spill"
    model = tiny_llama()
    cache = DiskOffloadCache(model, path=target, hot_tokens=16, block_size=8)
    assert target.is_dir() and list(target.iterdir()) == []  # the write probe left nothing behind
    ids = torch.randint(3, 96, (1, 64))
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.stats().spilled_blocks > 0 and len(list(target.iterdir())) == 1
    cache.release()
    assert target.is_dir() and list(target.iterdir()) == []  # the file goes, the user's directory stays


def test_without_a_path_nothing_is_created_until_the_first_spill() -> None:
    cache = DiskOffloadCache(tiny_llama(), hot_tokens=16, block_size=8)
    assert cache.tier.path is None
