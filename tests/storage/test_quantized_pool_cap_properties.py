"""Random operations on a QuantizedBlockPool under a random `max_bytes`, with and without layer groups.

A model holds the references the test owns (a multiset of block-table entries: full-precision ids >= 0,
sealed entries < 0) and the K/V each live block must read back. Before each operation that may need memory
the model predicts whether it fits: the blocks it needs beyond the free ones of their part cost at most the
budget left (max_bytes minus the bytes of the pool's tensors, measured) plus the bytes of the other part's
free blocks at the end of its tensors, counting the blocks the operation itself frees. After every
operation:

- the pool's tensors, measured (numel x element size of each distinct tensor, no view of a larger
  storage), never exceed max_bytes, and equal `bytes_held()` and `stats().bytes_held`;
- `PoolExhausted` was raised exactly when the prediction said the request does not fit, and then free
  lists, reference counts, capacities and every block's data are as they were;
- each block's reference count is the model's, and the free lists hold exactly the blocks without one;
- every live block reads back the model's K/V (a sealed block: its format's round trip of what was sealed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hf_kvgov.codecs import Int4Codec, Int8Codec
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed, sealed_id_of
from hf_kvgov.storage.sealed_formats import CodecFormat, RawFormat, SealedFormat

BLOCK, HEADS, DIM = 2, 1, 4
FORMATS: dict[str, SealedFormat] = {
    "int8": CodecFormat(Int8Codec()),
    "int4": CodecFormat(Int4Codec()),
    "raw": RawFormat(torch.float32),
}
KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # per position's layer: keys, values [BLOCK, HEADS, DIM]


def measured_bytes(pool: QuantizedBlockPool) -> int:
    tensors = [*pool.keys, *pool.values, *(t for layer in pool.sealed.pieces for t in layer.values())]
    distinct = {id(t): t for t in tensors}.values()
    for t in distinct:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return sum(t.numel() * t.element_size() for t in distinct)


class Model:
    def __init__(self, pool: QuantizedBlockPool, max_bytes: int, seed: int) -> None:
        self.pool = pool
        self.max_bytes = max_bytes
        self.refs: list[int] = []  # every reference the test holds, as block-table entries
        self.kv: dict[int, KV] = {}  # entry -> what it reads back
        self.generator = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------ prediction

    def counts(self) -> Counter[int]:
        return Counter(self.refs)

    def free_tail(self, sealed: bool, dropping: Counter[int]) -> int:
        """Free blocks at the end of one part's tensors once `dropping` (entries) are dropped, by the model."""
        counts = self.counts() - dropping
        capacity = self.pool.sealed.capacity if sealed else self.pool.capacity
        tail = 0
        for index in range(capacity - 1, -1, -1):
            if counts[-1 - index if sealed else index]:
                break
            tail += 1
        return tail

    def fits(self, sealed: bool, n: int, dropping: list[int]) -> bool:
        pool, counts = self.pool, self.counts()
        if sealed:
            free = sum(1 for s in range(pool.sealed.capacity) if not counts[-1 - s])
            part, other = pool.sealed.bytes_per_block, pool.bytes_per_block
        else:
            free = sum(1 for b in range(pool.capacity) if not counts[b])
            part, other = pool.bytes_per_block, pool.sealed.bytes_per_block
        short = n - free
        spare = self.max_bytes - measured_bytes(pool) + self.free_tail(not sealed, Counter(dropping)) * other
        return short <= 0 or short * part <= spare

    # ------------------------------------------------------------ state

    def snapshot(self) -> tuple[object, ...]:
        pool = self.pool
        return (
            pool.capacity,
            pool.sealed.capacity,
            pool.free_ids(),
            pool.sealed.free_ids(),
            tuple(pool.ref_count(b) for b in range(pool.capacity)),
            tuple(pool.sealed.ref_count(s) for s in range(pool.sealed.capacity)),
        )

    def attempt(self, what: str, predicted: bool, operation: Callable[[], Any]) -> Any:
        """Run `operation`; it must raise PoolExhausted exactly when `predicted` is False, then change nothing."""
        before = self.snapshot()
        try:
            result = operation()
        except PoolExhausted:
            assert not predicted, f"{what} was refused though it fits"
            assert self.snapshot() == before
            self.check()
            event(f"{what}: refused")
            return None
        assert predicted, f"{what} fit though the prediction says it does not"
        shrank = self.pool.capacity < before[0] or self.pool.sealed.capacity < before[1]  # type: ignore[operator]
        event(f"{what}: done" + (", the other part gave back blocks" if shrank else ""))
        return result

    def check(self) -> None:
        pool = self.pool
        measured = measured_bytes(pool)
        assert measured <= self.max_bytes
        assert pool.bytes_held() == pool.stats().bytes_held == measured
        counts = self.counts()
        assert all(0 <= b < pool.capacity for b in counts if b >= 0)
        assert all(0 <= sealed_id_of(e) < pool.sealed.capacity for e in counts if e < 0)
        full = [pool.ref_count(b) for b in range(pool.capacity)]
        coded = [pool.sealed.ref_count(s) for s in range(pool.sealed.capacity)]
        assert full == [counts[b] for b in range(pool.capacity)]
        assert coded == [counts[-1 - s] for s in range(pool.sealed.capacity)]
        for free, refs in ((pool.free_ids(), full), (pool.sealed.free_ids(), coded)):
            assert len(free) == len(set(free))
            assert set(free) == {i for i, count in enumerate(refs) if count == 0}
        for entry in counts:
            for layer, (keys, values) in self.kv[entry].items():
                got = self.read(entry, layer)
                assert torch.equal(got[0], keys) and torch.equal(got[1], values), (entry, layer)

    def read(self, entry: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if is_sealed(entry):
            keys, values = self.pool.read_sealed(layer, torch.tensor([entry]), torch.float32)
            return keys[0], values[0]
        return self.pool.keys[layer][entry], self.pool.values[layer][entry]

    # ------------------------------------------------------------ operations

    def write(self, block: int) -> None:
        """Fresh K/V into every position of full-precision `block`, through `pool.write`."""
        slots = torch.arange(block * BLOCK, (block + 1) * BLOCK)
        kv: KV = {}
        for layer in self.pool.layout.heads:
            keys = torch.randn(BLOCK, HEADS, DIM, generator=self.generator)
            values = torch.randn(BLOCK, HEADS, DIM, generator=self.generator)
            self.pool.write(layer, slots, keys, values)
            kv[layer] = (keys, values)
        self.kv[block] = kv

    def allocate(self, n: int) -> None:
        ids = self.attempt("allocate", self.fits(False, n, []), lambda: self.pool.allocate(n))
        if ids is None:
            return
        assert len(ids) == len(set(ids)) == n and not any(self.counts()[b] for b in ids)
        self.refs.extend(ids)
        for block in ids:
            self.write(block)

    def seal(self, positions: list[int]) -> None:
        ids = [self.refs[p] for p in positions]
        unique = list(dict.fromkeys(ids))
        fits = self.fits(True, len(unique), ids)
        entries = self.attempt("seal", fits, lambda: self.pool.seal(ids))
        if entries is None:
            return
        sealed_of = dict(zip(ids, entries, strict=True))
        assert len(set(sealed_of.values())) == len(unique) and all(is_sealed(e) for e in entries)
        for block, entry in sealed_of.items():
            expected: KV = {}
            for layer, (keys, values) in self.kv[block].items():
                fmt = self.pool.sealed.formats[layer]
                decoded = fmt.decode(fmt.encode(keys[None], values[None]), torch.float32)
                expected[layer] = (decoded[0][0], decoded[1][0])
            self.kv[entry] = expected
        for p, entry in zip(positions, entries, strict=True):
            self.refs[p] = entry

    def copy_on_write(self, position: int) -> None:
        entry = self.refs[position]
        count = self.counts()[entry]
        # Unsealing counts the sealed block it drops; an unshared full-precision block is written in place.
        fits = self.fits(False, 1, [entry]) if is_sealed(entry) else count == 1 or self.fits(False, 1, [])
        fresh = self.attempt("copy_on_write", fits, lambda: self.pool.copy_on_write(entry))
        if fresh is None:
            return
        assert fresh >= 0 and (fresh == entry) == (not is_sealed(entry) and count == 1)
        self.refs[position] = fresh
        self.kv[fresh] = self.kv[entry]

    def drop(self, positions: list[int]) -> None:
        ids = [self.refs[p] for p in positions]
        self.pool.decref(ids)
        for p in sorted(positions, reverse=True):
            del self.refs[p]


def positions(data: st.DataObject, model: Model, full_only: bool, most: int) -> list[int]:
    candidates = [p for p, e in enumerate(model.refs) if not (full_only and is_sealed(e))]
    if not candidates:
        return []
    return data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=most, unique=True))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_operations_stay_within_max_bytes(data: st.DataObject) -> None:
    grouped = data.draw(st.booleans(), label="layer groups")
    names = data.draw(st.lists(st.sampled_from(sorted(FORMATS)), min_size=2, max_size=2), label="formats")
    if grouped:  # positions 0 and 1 of two groups: layers 0, 2 and 1, 3 share tensors, hence formats
        geometry = KVGeometry(num_layers=4, num_kv_heads=HEADS, head_dim=DIM)
        groups: tuple[LayerGroup, ...] | None = (LayerGroup((0, 1)), LayerGroup((2, 3), window=4))
        formats = [FORMATS[names[0]], FORMATS[names[1]]] * 2
    else:
        geometry = KVGeometry(num_layers=2, num_kv_heads=HEADS, head_dim=DIM)
        groups, formats = None, [FORMATS[name] for name in names]
    probe = QuantizedBlockPool(geometry, formats, block_size=BLOCK, groups=groups)
    smallest = max(probe.bytes_per_block, probe.sealed.bytes_per_block)
    max_bytes = data.draw(st.integers(smallest, 10 * probe.bytes_per_block), label="max_bytes")
    pool = QuantizedBlockPool(
        geometry,
        formats,
        block_size=BLOCK,
        max_bytes=max_bytes,
        growth_blocks=data.draw(st.integers(1, 4), label="growth_blocks"),
        sealed_growth_blocks=data.draw(st.integers(1, 4), label="sealed_growth_blocks"),
        groups=groups,
    )
    model = Model(pool, max_bytes, seed=data.draw(st.integers(0, 2**16), label="seed"))
    operations = ["allocate", "write", "seal", "incref", "decref", "copy_on_write", "free"]
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        operation = data.draw(st.sampled_from(operations))
        if operation == "allocate":
            model.allocate(data.draw(st.integers(0, 4), label="n"))
        elif operation == "write":  # a block the test alone holds, as a sequence writes its own tail
            owned = [b for b, count in model.counts().items() if b >= 0 and count == 1]
            if owned:
                model.write(data.draw(st.sampled_from(sorted(owned))))
        elif operation == "seal":
            chosen = positions(data, model, full_only=True, most=4)
            if chosen:
                model.seal(chosen)
        elif operation == "incref":
            chosen = positions(data, model, full_only=False, most=1)
            if chosen:
                pool.incref([model.refs[chosen[0]]])
                model.refs.append(model.refs[chosen[0]])
        elif operation == "copy_on_write":
            chosen = positions(data, model, full_only=False, most=1)
            if chosen:
                model.copy_on_write(chosen[0])
        else:  # decref one reference, or free several at once (a row released)
            chosen = positions(data, model, full_only=False, most=1 if operation == "decref" else 5)
            if chosen:
                model.drop(chosen)
        model.check()
    model.drop(list(range(len(model.refs))))
    model.check()
    assert pool.num_used == 0 and pool.sealed.num_used == 0
