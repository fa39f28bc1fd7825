"""Between the pool's blocks and the remote tier's values: snapshot, encode with a checksum, verify, load.

One value per block, every layer, as the pool stores it (sealed blocks as codes and scales, never decoded); `framed`
gives the byte layout. The checksum covers the key, so a value under another key (or a truncated, bit-flipped one) is
a miss. Byte order is the machine's (every x86 and ARM host is little-endian).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed, sealed_id_of
from hf_kvgov.tiers.remote_keys import FORMAT_VERSION

MAGIC = b"KVGR"
RAW, SEALED, GROUPED = 0, 1, 2
ABSENT = 255  # a group slot of a GROUPED value without a block
_HEADER = 6
_PAYLOAD = _HEADER + 32

# (shape of one block's part, dtype), in payload order.
PartSpec = list[tuple[tuple[int, ...], torch.dtype]]


def part_specs(pool: BlockPool, kind: int) -> PartSpec:
    """The parts of one block of `kind` in `pool`, in payload order."""
    if kind == SEALED:
        assert isinstance(pool, QuantizedBlockPool)
        return [spec for layer in pool.layout.heads for spec in pool.sealed.layout(layer).values()]
    g = pool.geometry
    raw = ((pool.block_size, g.num_kv_heads, g.head_dim), g.dtype)
    return [raw, raw] * len(pool.layout.heads)


def _nbytes(spec: PartSpec) -> int:
    return sum(int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in spec)


def has_layer_groups(pool: BlockPool) -> bool:
    """True when the prefix tree over `pool` caches entries (one block per layer group), not blocks."""
    return len(pool.groups) > 1 or pool.groups[0].window is not None


def block_bytes(pool: BlockPool, kind: int) -> int:
    """Bytes of one block of `kind` (RAW or SEALED) in `pool`'s payload format; -1 for a kind it cannot hold."""
    if kind not in (RAW, SEALED) or (kind == SEALED and not isinstance(pool, QuantizedBlockPool)):
        return -1
    return _nbytes(part_specs(pool, kind))


@dataclass(frozen=True)
class BlockSnapshot:
    """Copies of `n` blocks of one kind taken at publish time (the pool may reuse the blocks right after).

    `parts[j]` is `[n, *shape]` for part j in payload order, on the pool's device: the copy is queued there,
    and the writer thread moves it to the host, off the decode path.
    """

    kind: int
    parts: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return self.parts[0].shape[0] if self.parts else 0

    def head(self, n: int) -> BlockSnapshot:
        return BlockSnapshot(self.kind, [part[:n] for part in self.parts])

    def encode(self, keys: Sequence[bytes]) -> list[bytes]:
        return encode(self, keys)


def framed(key: bytes, kind: int, payload: bytes) -> bytes:
    """A value: the header, the checksum of key, header and payload, the payload.

    One value per block, every layer, as the pool stores it::

        offset 0   b"KVGR"                     magic
               4   u8  FORMAT_VERSION
               5   u8  kind                    0: raw K/V, 1: sealed pieces, 2: a grouped entry (`remote_entries`)
               6   32 bytes  sha256(key, bytes 0..5, payload)
              38   payload: per position of a block (`pool.layout.heads`), per part, the part's bytes:
                     raw:    keys[l][b], values[l][b]               block_size x kv_heads x head_dim, pool dtype
                     sealed: each piece of layer l's SealedFormat   in the store's piece order
    """
    header = MAGIC + bytes((FORMAT_VERSION, kind))
    return header + hashlib.sha256(key + header + payload).digest() + payload


def host_bytes(host: list[torch.Tensor], row: int) -> bytes:
    """Block `row` of host copies of a snapshot's parts, as one payload."""
    return b"".join(part[row].reshape(-1).view(torch.uint8).numpy().tobytes() for part in host)


def snapshot(pool: BlockPool, block_ids: Sequence[int]) -> list[tuple[list[int], BlockSnapshot]]:
    """Snapshots of `block_ids` (pool entries, sealed ones < 0 included), one per kind, with the positions in
    `block_ids` each holds."""
    out = []
    for kind in (RAW, SEALED):
        where = [i for i, b in enumerate(block_ids) if is_sealed(b) == (kind == SEALED)]
        if where:
            out.append((where, _snapshot_kind(pool, [block_ids[i] for i in where], kind)))
    return out


def _snapshot_kind(pool: BlockPool, block_ids: list[int], kind: int) -> BlockSnapshot:
    parts: list[torch.Tensor] = []
    for layer in pool.layout.heads:
        device = pool.geometry.layer_device(layer)
        if kind == SEALED:
            assert isinstance(pool, QuantizedBlockPool)
            index = torch.tensor([sealed_id_of(b) for b in block_ids], dtype=torch.long, device=device)
            parts.extend(piece.index_select(0, index) for piece in pool.sealed.pieces[layer].values())
        else:
            index = torch.tensor(block_ids, dtype=torch.long, device=device)
            parts.extend((pool.keys[layer].index_select(0, index), pool.values[layer].index_select(0, index)))
    return BlockSnapshot(kind, parts)


def encode(snap: BlockSnapshot, keys: Sequence[bytes]) -> list[bytes]:
    """The value of each block of `snap` (host copies are made here: call it off the decode path)."""
    host = [part.cpu().contiguous() for part in snap.parts]
    return [framed(key, snap.kind, host_bytes(host, i)) for i, key in enumerate(keys)]


def verify(pool: BlockPool, key: bytes, value: bytes) -> tuple[int, memoryview] | None:
    """(kind, payload) of a value read under `key`, or None when it is damaged or not of this pool's layout."""
    if len(value) < _PAYLOAD or value[:4] != MAGIC or value[4] != FORMAT_VERSION:
        return None
    kind, view = value[5], memoryview(value)
    payload = view[_PAYLOAD:]
    if hashlib.sha256(key + view[:_HEADER] + payload).digest() != view[_HEADER:_PAYLOAD]:
        return None
    return (kind, payload) if _expected_bytes(pool, kind, payload) == len(payload) else None


def _expected_bytes(pool: BlockPool, kind: int, payload: memoryview) -> int:
    """The payload length a value of `kind` must have in `pool` (-1: the pool holds no such value)."""
    if (kind == GROUPED) != has_layer_groups(pool):
        return -1
    if kind != GROUPED:
        return block_bytes(pool, kind)
    slots = bytes(payload[: len(pool.groups)])
    sizes = [0 if slot == ABSENT else block_bytes(pool, slot) for slot in slots]
    return -1 if len(slots) < len(pool.groups) or min(sizes) < 0 else len(slots) + sum(sizes)


def load(pool: BlockPool, blocks: Sequence[tuple[int, memoryview]]) -> list[int]:
    """Write verified blocks (kind, payload) into fresh pool entries; returns them in order, one reference each.

    Raises `PoolExhausted` (nothing allocated then) when the pool has no room for them.
    """
    ids: list[int] = [0] * len(blocks)
    taken: list[int] = []
    try:
        for kind in (RAW, SEALED):
            where = [i for i, (k, _) in enumerate(blocks) if k == kind]
            if not where:
                continue
            fresh = _allocate(pool, kind, len(where))
            taken.extend(fresh)
            _write(pool, kind, fresh, [blocks[i][1] for i in where])
            for i, block in zip(where, fresh, strict=True):
                ids[i] = block
    except BaseException:
        pool.decref(taken)
        raise
    return ids


def _allocate(pool: BlockPool, kind: int, n: int) -> list[int]:
    if kind == SEALED:
        assert isinstance(pool, QuantizedBlockPool)
        return pool.allocate_sealed(n)
    return pool.allocate(n)


def _write(pool: BlockPool, kind: int, entries: list[int], payloads: list[memoryview]) -> None:
    specs = part_specs(pool, kind)
    offset, parts = 0, []
    for shape, dtype in specs:
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        joined = bytearray(b"".join(payload[offset : offset + size] for payload in payloads))
        parts.append(torch.frombuffer(joined, dtype=torch.uint8).view(dtype).view(len(payloads), *shape))
        offset += size
    per_head = len(specs) // len(pool.layout.heads)
    for position, layer in enumerate(pool.layout.heads):
        mine = parts[position * per_head : (position + 1) * per_head]
        if kind == SEALED:
            assert isinstance(pool, QuantizedBlockPool)
            names = list(pool.sealed.layout(layer))
            pool.write_sealed_pieces(layer, entries, dict(zip(names, mine, strict=True)))
        else:
            pool.write_blocks(layer, torch.tensor(entries, dtype=torch.long), mine[0], mine[1])
