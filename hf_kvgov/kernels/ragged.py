"""Ragged paged attention: one step of many sequences, each with its own length and block table, none padded.

A continuous-batching step packs every scheduled sequence's new tokens into one row of the model's input: first one
token per decoding sequence, then each prefill chunk. Per layer, `RaggedStep.attend` writes the step's K/V into the
pool at the sequences' slots, then serves the decode rows with one batched call whose mask hides each row's keys
past its own length, and each prefill chunk with a call of its own (causal, its queries the last of its keys). Every
call goes through `kernels.dispatch`, so the backend is the one a `PagedCache` would get: the torch reference, sdpa
over gathered blocks on the CPU, Triton or flash-attn on CUDA. The index tensors are built once per step and layer
group (`GroupIndex`: with a hybrid model's groups, a sliding group's rows start at the first block it kept). Over a
`QuantizedBlockPool` (`SealedRaggedStep`) the tables also name sealed blocks, read by the quantized path.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hf_kvgov.kernels import dispatch
from hf_kvgov.kernels.block_mass import BlockMasses, attention_mass
from hf_kvgov.kernels.gathered_sdpa import gather_blocks
from hf_kvgov.kernels.quantized_reference import gather_quantized
from hf_kvgov.kernels.sealed_blocks import SealedBlocks
from hf_kvgov.storage.layer_groups import full_group
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a packed step, per layer group of the pool: `query_length` new tokens after
    `kv_lengths[g] - query_length` stored in its table `block_ids[g]` (fewer in a full-attention group than a
    sliding one's positions once an eviction policy dropped blocks)."""

    query_length: int
    kv_lengths: Sequence[int]  # per group, tokens its keys span after this step's write, the new ones included
    block_ids: Sequence[Sequence[int]]  # per group, its block table covering `kv_lengths[g]` tokens


@dataclass(frozen=True)
class GroupIndex:
    """One layer group's index tensors for a step. A sliding group's rows start at the block holding the first key
    their first query sees (blocks before it are freed), so its lengths count from there."""

    slots: torch.Tensor  # long [tokens]: where each packed token's K/V goes
    decode_tables: torch.Tensor  # long [decoding, blocks]; short rows padded with a block id they never read
    decode_lengths: torch.Tensor  # long [decoding]
    decode_max: int
    chunks: tuple[tuple[int, int, int, torch.Tensor], ...]  # (first packed token, queries, kv length, table [1, n])

    @classmethod
    def build(
        cls, sequences: Sequence[SequenceSlice], group: int, window: int | None, size: int, device: torch.device
    ) -> GroupIndex:
        slots: list[int] = []
        rows: list[tuple[list[int], int]] = []  # per sequence, the table it reads and the keys' length in it
        for s in sequences:
            ids, length = s.block_ids[group], s.kv_lengths[group]
            start = length - s.query_length
            for index in range(start, length):
                slots.append(ids[index // size] * size + index % size)
            first = 0 if window is None else max(0, start - window + 1) // size
            rows.append((list(ids[first : -(-length // size)]), length - first * size))
        decoding = next((i for i, s in enumerate(sequences) if s.query_length != 1), len(sequences))
        decode = rows[:decoding]
        width = max((len(table) for table, _ in decode), default=0)
        padded = [table + [table[0]] * (width - len(table)) for table, _ in decode]
        chunks = []
        start = decoding
        for s, (table, length) in zip(sequences[decoding:], rows[decoding:], strict=True):
            chunks.append((start, s.query_length, length, torch.tensor([table], dtype=torch.long, device=device)))
            start += s.query_length
        return cls(
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            decode_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(decode), width),
            decode_lengths=torch.tensor([length for _, length in decode], dtype=torch.long, device=device),
            decode_max=max((length for _, length in decode), default=0),
            chunks=tuple(chunks),
        )


@dataclass
class RaggedStep:
    """The index tensors of one packed step, built once per layer group and read by every layer."""

    pool: BlockPool
    groups: tuple[GroupIndex, ...]  # per layer group of the pool
    # Masks by (first packed token of a chunk, or -1 for the decode rows; window): built by the first layer only.
    # Groups of one window count their rows' lengths from the same block, so they share masks.
    _masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)
    # Set by `observe_masses`: each block's attention, summed over the layers (heavy-hitter eviction's score).
    masses: BlockMasses | None = None
    attended: set[int] = field(default_factory=set)  # the layers whose attention went through this step
    # KV sharing (Gemma-3n): a layer past the pool's that attends over an earlier layer's K/V -> that layer, which
    # wrote them earlier in this step.
    kv_sources: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        pool: BlockPool,
        sequences: Sequence[SequenceSlice],
        device: torch.device,
        kv_sources: Mapping[int, int] | None = None,
    ) -> RaggedStep:
        """`sequences` in packing order: the leading slices of one query are the decode rows, the rest chunks."""
        size = pool.block_size
        indexes = [GroupIndex.build(sequences, g, group.window, size, device) for g, group in enumerate(pool.groups)]
        return cls(pool=pool, groups=tuple(indexes), kv_sources=dict(kv_sources or {}))

    @property
    def num_decoding(self) -> int:
        return int(self.groups[0].decode_lengths.shape[0])

    def observe_masses(self) -> BlockMasses:
        """Have every full-attention layer's `attend` add the attention its blocks receive to the returned
        `BlockMasses`, per column of each sequence's full-attention tables (sliding layers take no part)."""
        full = full_group(self.pool.groups)
        assert full is not None, "block masses need a full-attention layer group"
        index = self.groups[full]
        chunk_blocks = [int(table.shape[1]) for *_, table in index.chunks]
        width = int(index.decode_tables.shape[1])
        self.masses = BlockMasses(self.num_decoding, width, chunk_blocks, index.slots.device)
        return self.masses

    def gather_keys(self, layer: int, table: torch.Tensor, length: int) -> torch.Tensor:
        """`[rows, kv_heads, length, dim]` float32 keys of `table`'s first `length` tokens in `layer`."""
        return gather_blocks(self.pool.keys[layer], table, length).float()

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        softcap: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store `key`/`value` `[1, kv_heads, tokens, dim]` and attend `query` `[1, q_heads, tokens, dim]` (with the
        model's learned sink logit per query head, `sinks` `[q_heads]`, when it has them).

        A layer that shares an earlier layer's K/V (`kv_sources`) attends over that layer's blocks and stores nothing:
        its `key`/`value` are the ones that layer wrote.

        Returns `[1, tokens, q_heads, dim]`, the layout transformers' attention functions return.
        """
        self.attended.add(layer)
        source = self.kv_sources.get(layer)
        if source is not None:
            layer = source
        group = self.pool.group_of(layer)
        index = self.groups[group]
        masses = self.masses if self.pool.groups[group].window is None else None
        if source is None:
            self.pool.write(layer, index.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
        out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
        decoding = self.num_decoding
        if decoding:
            rows = query[0, :, :decoding].transpose(0, 1).unsqueeze(2)  # [decoding, q_heads, 1, dim]
            mask = self._decode_mask(index, window)
            table, longest, lengths = index.decode_tables, index.decode_max, index.decode_lengths
            result = self.paged(layer, rows, table, longest, scale, mask, softcap, lengths, window, sinks)
            out[0, :decoding] = result[:, 0]
            if masses is not None:
                keys = self.gather_keys(layer, index.decode_tables, index.decode_max)
                mass = attention_mass(rows, keys, scale, mask, softcap, self.pool.block_size, sinks)
                masses.decode[:, : mass.shape[1]] += mass
        for number, (start, length, kv_length, table) in enumerate(index.chunks):
            chunk = query[:, :, start : start + length]
            mask = self._chunk_mask(start, length, kv_length, window, query.device)
            result = self.paged(layer, chunk, table, kv_length, scale, mask, softcap, None, window, sinks)
            out[0, start : start + length] = result[0]
            if masses is not None:
                keys = self.gather_keys(layer, table, kv_length)
                block_size = self.pool.block_size
                masses.chunks[number] += attention_mass(chunk, keys, scale, mask, softcap, block_size, sinks)[0]
        return out

    def paged(
        self,
        layer: int,
        query: torch.Tensor,
        table: torch.Tensor,
        kv_length: int,
        scale: float,
        mask: torch.Tensor | None,
        softcap: float | None,
        lengths: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One call of paged attention over `layer`'s blocks: `[batch, q_len, q_heads, dim]`. `mask` is each row's
        keys before its `lengths` (all `kv_length` when None), causal, within `window`: a backend may read those."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        return dispatch.paged_attention(
            query, keys, values, table, kv_length, scale, mask=mask, softcap=softcap, seq_lens=lengths, window=window,
            sinks=sinks,
        )  # fmt: skip

    def _decode_mask(self, index: GroupIndex, window: int | None) -> torch.Tensor | None:
        """`[decoding, 1, 1, longest]` bool: each row's own keys (within its window); None when nothing is hidden."""
        if (-1, window) not in self._masks:
            keys = torch.arange(index.decode_max, device=index.decode_lengths.device)
            lengths = index.decode_lengths[:, None]
            keep = keys[None, :] < lengths
            if window is not None:
                keep &= keys[None, :] >= lengths - window
            self._masks[-1, window] = None if bool(keep.all()) else keep[:, None, None, :]
        return self._masks[-1, window]

    def _chunk_mask(
        self, start: int, length: int, kv_length: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """Causal with the queries last, within a sliding window when there is one (None: plain causal)."""
        if window is None or kv_length <= window:
            return None
        if (start, window) not in self._masks:
            queries = torch.arange(kv_length - length, kv_length, device=device)[:, None]
            keys = torch.arange(kv_length, device=device)[None, :]
            self._masks[start, window] = ((keys <= queries) & (keys > queries - window))[None, None]
        return self._masks[start, window]


@dataclass
class SealedRaggedStep(RaggedStep):
    """A packed step over a `QuantizedBlockPool`: tables mix full-precision blocks and sealed codes (negative ids),
    which the quantized path of `kernels.dispatch` decodes (or a kernel reads in place)."""

    pool: QuantizedBlockPool

    def gather_keys(self, layer: int, table: torch.Tensor, length: int) -> torch.Tensor:
        """Keys of either kind of block, sealed ones decoded."""
        read = functools.partial(self.pool.read_sealed, layer)
        keys, _ = gather_quantized(self.pool.keys[layer], self.pool.values[layer], table, length, read, torch.float32)
        return keys

    def paged(
        self,
        layer: int,
        query: torch.Tensor,
        table: torch.Tensor,
        kv_length: int,
        scale: float,
        mask: torch.Tensor | None,
        softcap: float | None,
        lengths: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `RaggedStep.paged`; the quantized backends read the mask (`lengths` and `window` are not used)."""
        store = self.pool.sealed
        return dispatch.quantized_paged_attention(
            query,
            self.pool.keys[layer],
            self.pool.values[layer],
            table,
            kv_length,
            scale,
            functools.partial(self.pool.read_sealed, layer),
            SealedBlocks(store.formats[layer].name, store.pieces[layer]),
            mask=mask,
            softcap=softcap,
            sinks=sinks,
        )
