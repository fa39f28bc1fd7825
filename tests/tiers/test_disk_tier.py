"""The disk tier without a model: file layout, references, checksums, budgets, failures, read-ahead.

Layout used throughout: 2 layers, segments of two 4-byte parts, 4 slots per extent, so a slot is 16
bytes, an extent 4 x 2 x 8 = 64 bytes, a layer's region in it 32 and a part's 16. Offsets are worked out
by hand from the formula in `slot_file`: (slot s, layer l, part p) -> (s // 4) * 64 + l * 32 + p * 16 +
(s % 4) * 4.
"""

from __future__ import annotations

import errno
import gc
import os
from pathlib import Path

import pytest
import torch

from hf_kvgov.errors import SpillCorrupted, SpillFileLost, SpillSpaceExhausted
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.tiers import DiskTier, LatencyRecorder, LayerPrefetcher, StaleRead, TieredBlockTables, TierLayout
from hf_kvgov.tiers.kv_segments import spilled_id
from tests.spill_damage import flip_byte

LAYOUT = TierLayout(layers=2, part_bytes=(4, 4), extent_slots=4)


def payload(block: int, layer: int) -> bytes:
    """Eight distinct bytes per (block, layer): 16 * block + layer, then +100, +1, ..."""
    return bytes((16 * block + layer + 100 * (i % 2) + i) % 256 for i in range(8))


def put_blocks(tier: DiskTier, names: list[int], refs: list[int] | None = None) -> list[int]:
    """Store blocks whose bytes are `payload(name, layer)`, each segment given as two 4-byte parts."""

    def segments(layer: int) -> list[list[memoryview]]:
        return [[memoryview(payload(n, layer)[:4]), memoryview(payload(n, layer)[4:])] for n in names]

    return tier.put(len(names), refs or [1] * len(names), segments)


def read_back(tier: DiskTier, layer: int, handles: list[int]) -> list[bytes]:
    """Segments as bytes, read into one buffer per part."""
    first, second = bytearray(4 * len(handles)), bytearray(4 * len(handles))
    tier.read(layer, handles, [memoryview(first), memoryview(second)])
    return [bytes(first[4 * i : 4 * i + 4] + second[4 * i : 4 * i + 4]) for i in range(len(handles))]


def test_layout_offsets_are_layer_major_within_extents(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [10, 11, 12, 13, 14])  # slots 0..4: a second extent for slot 4
    assert handles == [0, 1, 2, 3, 4]
    expected = {(0, 0): 0, (1, 0): 4, (0, 1): 32, (3, 1): 44, (4, 0): 64, (4, 1): 96}  # part 0
    for (handle, layer), offset in expected.items():
        assert tier.location(handle, layer)[1] == offset
    raw = Path(tier.path or "").read_bytes()
    assert len(raw) == 128  # two extents, reserved whole
    assert raw[32:36] + raw[48:52] == payload(10, 1) and raw[96:100] + raw[112:116] == payload(14, 1)
    assert raw[0:16] == b"".join(payload(n, 0)[:4] for n in (10, 11, 12, 13))  # part 0 of four slots, adjacent
    assert tier.stats().file_bytes == 128 and tier.stats().slots_in_use == 5


def test_round_trip_coalesces_adjacent_slots_into_one_fetch(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [20, 21, 22, 23, 24])
    assert read_back(tier, 1, handles[:3]) == [payload(n, 1) for n in (20, 21, 22)]
    assert (tier.fetches, tier.blocks_fetched) == (1, 3)  # slots 0, 1, 2: one read per part
    assert read_back(tier, 0, [handles[2], handles[0]]) == [payload(22, 0), payload(20, 0)]
    assert (tier.fetches, tier.blocks_fetched) == (3, 5)  # slots 0 and 2 are not adjacent
    assert read_back(tier, 0, handles) == [payload(n, 0) for n in range(20, 25)]
    assert (tier.fetches, tier.blocks_fetched) == (5, 10)  # slots 0..3, then slot 4 in the next extent
    stats = tier.stats()
    assert stats.bytes_read == 10 * 8
    assert stats.bytes_written == stats.payload_bytes_written == 5 * 16
    assert stats.write_amplification == 1.0
    assert stats.fetch_latency_p99_s > 0 and stats.fetch_latency_mean_s > 0


def test_references_free_slots_at_zero_and_the_lowest_slot_is_reused(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    first, second, third = put_blocks(tier, [1, 2, 3], refs=[2, 1, 1])
    tier.decref([first])
    assert tier.refs(first) == 1 and tier.stats().slots_in_use == 3
    tier.decref([first, second])  # slots 0 and 1 free
    assert not tier.is_live(first) and tier.stats().slots_in_use == 1
    (fourth,) = put_blocks(tier, [4])
    assert tier.location(fourth, 0)[1] == 0  # slot 0 again
    tier.incref([third, third])
    assert tier.refs(third) == 3
    with pytest.raises(ValueError, match="not held"):
        tier.decref([second])
    with pytest.raises(ValueError, match="not held"):
        tier.decref([fourth, fourth])  # one reference, two drops: nothing changes
    assert tier.refs(fourth) == 1
    with pytest.raises(StaleRead):
        read_back(tier, 0, [second])


def test_write_budget_refuses_whole_batches_before_writing(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path, max_write_bytes=40)  # two 16-byte blocks fit, not three
    assert tier.blocks_within_budget(5) == 2
    with pytest.raises(SpillSpaceExhausted, match="write budget") as info:
        put_blocks(tier, [1, 2, 3])
    assert info.value.reason == "write budget"
    assert tier.bytes_written == 0 and tier.stats().slots_in_use == 0
    put_blocks(tier, [1, 2])
    assert tier.bytes_written == 32 and tier.blocks_within_budget(1) == 0
    with pytest.raises(SpillSpaceExhausted):
        put_blocks(tier, [3])


def test_disk_full_halfway_frees_the_slots_and_counts_the_bytes(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tier = DiskTier(LAYOUT, tmp_path)
    real = os.pwritev
    calls = []

    def half_then_full(fd: int, buffers: list[memoryview], offset: int) -> int:
        """What a filling disk does: a short write of what fits, then ENOSPC on the next call."""
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, [buffers[0][: len(buffers[0]) // 2]], offset)

    monkeypatch.setattr(os, "pwritev", half_then_full)
    with pytest.raises(SpillSpaceExhausted, match="disk full") as info:
        put_blocks(tier, [7, 8])
    assert info.value.reason == "disk full" and calls == [0, 2]  # the retry resumed after the 2 bytes written
    monkeypatch.setattr(os, "pwritev", real)
    stats = tier.stats()
    assert (stats.slots_in_use, stats.failed_writes, stats.bytes_written) == (0, 1, 2)  # half of a 4-byte part
    handles = put_blocks(tier, [9, 10])  # the same slots, fully rewritten
    assert read_back(tier, 0, handles) == [payload(9, 0), payload(10, 0)]
    assert tier.stats().write_amplification == pytest.approx((2 + 32) / 32)


def test_no_room_for_a_new_extent_is_disk_full(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tier = DiskTier(LAYOUT, tmp_path)

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SpillSpaceExhausted, match="disk full"):
        put_blocks(tier, [1])
    assert tier.stats().file_bytes == 0 and tier.bytes_written == 0


@pytest.mark.parametrize("layer", [0, 1])
def test_a_flipped_byte_names_the_block_and_layer(tmp_path: Path, layer: int) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [1, 2, 3])
    path, offset = tier.location(handles[1], layer)
    flip_byte(path, offset + 1, mask=0x01)
    with pytest.raises(SpillCorrupted, match=f"block 1, layer {layer}") as info:
        read_back(tier, layer, handles)
    assert (info.value.block, info.value.layer, info.value.offset) == (1, layer, offset)
    assert read_back(tier, 1 - layer, handles) == [payload(n, 1 - layer) for n in (1, 2, 3)]


def test_a_deleted_file_is_reported_not_read(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [1])
    os.unlink(tier.path or "")
    with pytest.raises(SpillFileLost, match="deleted"):
        read_back(tier, 0, handles)
    with pytest.raises(SpillFileLost):
        put_blocks(tier, [2])


def test_files_are_private_and_removed(tmp_path: Path) -> None:
    one, two = DiskTier(LAYOUT, tmp_path), DiskTier(LAYOUT, tmp_path)
    put_blocks(one, [1])
    put_blocks(two, [1])
    assert one.path != two.path and Path(one.path or "").exists() and Path(two.path or "").exists()
    assert oct(os.stat(one.path or "").st_mode & 0o777) == "0o600"
    first, second = Path(one.path or ""), Path(two.path or "")
    one.close()
    assert not first.exists() and second.exists() and one.path is None
    private = DiskTier(LAYOUT)
    put_blocks(private, [1])
    directory = Path(private.path or "").parent
    assert directory.exists() and directory != tmp_path
    del private
    gc.collect()
    assert not directory.exists()  # garbage collection deletes the file and the private directory


def test_bad_arguments_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="part_bytes"):
        TierLayout(layers=2, part_bytes=(4, 0))
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="directory"):
        DiskTier(LAYOUT, file)
    with pytest.raises(ValueError, match="max_write_bytes"):
        DiskTier(LAYOUT, tmp_path, max_write_bytes=0)
    tier = DiskTier(LAYOUT, tmp_path)
    with pytest.raises(ValueError, match=r"parts of \[9\] bytes; this tier stores parts of \[4, 4\]"):
        tier.put(1, [1], lambda layer: [[memoryview(bytes(9))]])
    assert tier.stats().slots_in_use == 0 and tier.failed_writes == 1


def test_latency_percentiles_by_nearest_rank() -> None:
    recorder = LatencyRecorder(window=200)
    for ms in range(1, 101):
        recorder.add(ms / 1000)
    assert recorder.count == 100 and recorder.mean_s == pytest.approx(0.0505)
    assert recorder.percentile_s(99) == 0.099 and recorder.percentile_s(50) == 0.050
    small = LatencyRecorder(window=2)
    for seconds in (5.0, 1.0, 2.0):
        small.add(seconds)
    assert small.percentile_s(100) == 2.0 and small.mean_s == pytest.approx(8 / 3)  # p99 over the window only


# ---------------------------------------------------------------- read-ahead


def take(reader: LayerPrefetcher, layer: int, handles: list[int]) -> list[bytes]:
    """Segments as bytes, taken into two 4-byte parts per block (as K and V are)."""
    first, second = (
        torch.zeros((len(handles), 4), dtype=torch.uint8),
        torch.zeros((len(handles), 2, 2), dtype=torch.uint8),
    )
    reader.take(layer, handles, [first, second])
    return [bytes(a.numpy()) + bytes(b.numpy()) for a, b in zip(first, second, strict=True)]


def test_read_ahead_fills_its_rows_and_the_rest_is_read_on_demand(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [1, 2, 3])
    reader = LayerPrefetcher(tier, buffer_bytes=2 * 8 + 7, device=torch.device("cpu"))  # two whole rows
    assert reader.capacity == 2
    reader.request(1, handles)
    assert take(reader, 1, handles) == [payload(n, 1) for n in (1, 2, 3)]
    assert (reader.prefetched, reader.on_demand, reader.buffer_bytes) == (2, 1, 16)
    reader.request(0, handles[::-1])  # rows are free again: blocks 3 and 2 are read ahead
    assert take(reader, 0, handles) == [payload(n, 0) for n in (1, 2, 3)]
    assert (reader.prefetched, reader.on_demand) == (4, 2)
    assert take(reader, 0, handles[:1]) == [payload(1, 0)] and reader.on_demand == 3
    reader.close()
    assert reader.buffer_bytes == 0


def test_read_ahead_rows_follow_the_blocks_requested_up_to_the_cap(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [1, 2, 3, 4])
    reader = LayerPrefetcher(tier, buffer_bytes=3 * 8, device=torch.device("cpu"))  # a cap of three rows
    reader.request(0, [])
    assert (reader.capacity, reader.buffer_bytes) == (3, 0)  # nothing spilled was asked for: no rows
    sizes = []
    for layer, wanted in ((0, 1), (1, 2), (0, 4), (1, 1)):
        reader.request(layer, handles[:wanted])
        sizes.append(reader.buffer_bytes)
        assert take(reader, layer, handles[:wanted]) == [payload(n, layer) for n in (1, 2, 3, 4)[:wanted]]
    # One 8-byte row per block asked for, at most three; rows do not shrink until `close`.
    assert sizes == [8, 16, 24, 24]
    assert (reader.prefetched, reader.on_demand) == (1 + 2 + 3 + 1, 1)
    reader.close()
    assert reader.buffer_bytes == 0
    tier.close()


def test_read_ahead_rows_grow_only_when_none_is_in_use(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [1, 2, 3])
    reader = LayerPrefetcher(tier, buffer_bytes=3 * 8, device=torch.device("cpu"))
    reader.request(0, handles[:1])  # one row, held until layer 0 is taken
    reader.request(1, handles)  # cannot grow now: layer 1's blocks will be read on demand
    assert reader.buffer_bytes == 8
    assert take(reader, 0, handles[:1]) == [payload(1, 0)]
    assert take(reader, 1, handles) == [payload(n, 1) for n in (1, 2, 3)]
    assert (reader.prefetched, reader.on_demand) == (1, 3)
    reader.request(0, handles)  # every row free again: they grow to the three blocks
    assert reader.buffer_bytes == 24
    assert take(reader, 0, handles) == [payload(n, 0) for n in (1, 2, 3)] and reader.prefetched == 4
    reader.close()
    tier.close()


def test_read_ahead_rows_are_charged_to_the_pool_and_only_what_its_cap_leaves_is_allocated(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [1, 2, 3])
    # A pool block of 1 layer x 1 head x 1 float32 x 4 tokens is 2 x 16 = 32 bytes; the cap is 55 bytes.
    pool = BlockPool(KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1), block_size=4, max_bytes=55)
    reader = LayerPrefetcher(tier, buffer_bytes=3 * 8, device=torch.device("cpu"), pool=pool)
    reader.request(0, handles[:2])  # two 8-byte rows fit beside the empty pool
    assert reader.buffer_bytes == pool.bytes_charged == 16
    assert take(reader, 0, handles[:2]) == [payload(1, 0), payload(2, 0)] and reader.prefetched == 2
    pool.allocate(1)  # 32 bytes of blocks + 16 of rows: 7 left, not the 8 a third row takes
    reader.request(1, handles)  # the rows stay at two; the third block is read on demand
    assert reader.buffer_bytes == pool.bytes_charged == 16
    assert take(reader, 1, handles) == [payload(n, 1) for n in (1, 2, 3)]
    assert (reader.prefetched, reader.on_demand) == (4, 1)
    reader.close()
    assert pool.bytes_charged == 0 and pool.bytes_held() == 32  # closed: the rows hold nothing any more
    tier.close()


def test_stale_read_ahead_is_dropped_and_damage_surfaces_in_the_caller(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path)
    handles = put_blocks(tier, [1, 2, 3])
    reader = LayerPrefetcher(tier, buffer_bytes=3 * 8, device=torch.device("cpu"))
    reader.request(0, handles)
    tier.decref([handles[0]])  # freed while (maybe) being read ahead
    assert take(reader, 0, handles[1:]) == [payload(2, 0), payload(3, 0)]
    path, offset = tier.location(handles[2], 1)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff")
    reader.request(1, handles[1:])
    with pytest.raises(SpillCorrupted, match="layer 1"):
        take(reader, 1, handles[1:])
    before = reader.prefetched
    reader.request(0, handles[1:])  # every row came back, so both are read ahead again
    assert take(reader, 0, handles[1:]) == [payload(2, 0), payload(3, 0)] and reader.prefetched == before + 2
    reader.close()


# ---------------------------------------------------------------- block tables across tiers


def test_tiered_tables_share_spilled_blocks_between_forks(tmp_path: Path) -> None:
    pool = BlockPool(KVGeometry(num_layers=2, num_kv_heads=1, head_dim=1), block_size=4)
    tier = DiskTier(TierLayout(layers=2, part_bytes=(16, 16)), tmp_path)  # K, V: 4 tokens x 1 x 1 x 4 bytes
    tables = TieredBlockTables(pool, tier)
    tables.slots_for(1, 0, 10)  # blocks 0, 1, 2
    zeros = [[memoryview(bytes(16)), memoryview(bytes(16))]]
    (handle,) = tier.put(1, [1], lambda layer: zeros)
    tables.replace({1: spilled_id(handle)})
    pool.decref([1])
    assert tables.rows[0].block_ids == [0, -1, 2] and tables.references(0, 3, spilled=True) == {-1: 1}
    tables.reorder([0, 0, 0])  # three beams share the spilled block: one handle, three references
    assert tier.refs(handle) == 3 and tier.stats().blocks_written == 1
    assert tables.references(1, 2, spilled=True) == {-1: 3}
    tables.truncate(3)  # drops the spilled block from every row: its slot is free
    assert not tier.is_live(handle) and tier.stats().slots_in_use == 0
    tables.release()
    assert pool.num_used == 0
