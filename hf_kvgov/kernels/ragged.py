"""Ragged paged attention: one step of many sequences, each with its own length and block table, none padded.

A continuous-batching step packs every scheduled sequence's new tokens into one row of the model's input: first one
token per decoding sequence, then each prefill chunk. Per layer, `RaggedStep.attend` writes the step's K/V into the
pool at the sequences' slots, then serves the decode rows with one batched call whose mask hides each row's keys
past its own length, and each prefill chunk with a call of its own (causal, its queries the last of its keys). Every
call goes through `kernels.dispatch`, so the backend is the one a `PagedCache` would get: the torch reference, sdpa
over gathered blocks on the CPU, Triton or flash-attn on CUDA. The index tensors are built once per step. Over a
`QuantizedBlockPool` (`SealedRaggedStep`) the tables also name sealed blocks, read by the quantized path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hf_kvgov.kernels import dispatch
from hf_kvgov.kernels.block_mass import BlockMasses, attention_mass
from hf_kvgov.kernels.gathered_sdpa import gather_blocks
from hf_kvgov.kernels.quantized_reference import gather_quantized
from hf_kvgov.kernels.sealed_blocks import SealedBlocks
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a packed step: `query_length` new tokens after `kv_length - query_length` stored."""

    query_length: int
    kv_length: int  # tokens its keys span after this step's write, the new ones included
    block_ids: Sequence[int]  # its block table, covering at least `kv_length` tokens


@dataclass
class RaggedStep:
    """The index tensors of one packed step, built once and read by every layer."""

    pool: BlockPool
    slots: torch.Tensor  # long [tokens]: where each packed token's K/V goes
    decode_tables: torch.Tensor  # long [decoding, blocks]; short rows padded with a block id they never read
    decode_lengths: torch.Tensor  # long [decoding]
    decode_max: int
    chunks: tuple[tuple[int, int, int, torch.Tensor], ...]  # (first packed token, queries, kv length, table [1, n])
    # Masks by (first packed token of a chunk, or -1 for the decode rows; window): built by the first layer only.
    _masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)
    # Set by `observe_masses`: each block's attention, summed over the layers (heavy-hitter eviction's score).
    masses: BlockMasses | None = None

    @classmethod
    def build(cls, pool: BlockPool, sequences: Sequence[SequenceSlice], device: torch.device) -> RaggedStep:
        """`sequences` in packing order: the leading slices of one query are the decode rows, the rest chunks."""
        size = pool.block_size
        slots: list[int] = []
        decoding = next((i for i, s in enumerate(sequences) if s.query_length != 1), len(sequences))
        decode = sequences[:decoding]
        for s in sequences:
            for position in range(s.kv_length - s.query_length, s.kv_length):
                slots.append(s.block_ids[position // size] * size + position % size)
        width = max((-(-s.kv_length // size) for s in decode), default=0)
        tables = [list(s.block_ids[: -(-s.kv_length // size)]) for s in decode]
        padded = [t + [t[0]] * (width - len(t)) for t in tables]
        chunks = []
        start = decoding
        for s in sequences[decoding:]:
            table = torch.tensor([list(s.block_ids[: -(-s.kv_length // size)])], dtype=torch.long, device=device)
            chunks.append((start, s.query_length, s.kv_length, table))
            start += s.query_length
        return cls(
            pool=pool,
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            decode_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(decode), width),
            decode_lengths=torch.tensor([s.kv_length for s in decode], dtype=torch.long, device=device),
            decode_max=max((s.kv_length for s in decode), default=0),
            chunks=tuple(chunks),
        )

    @property
    def num_decoding(self) -> int:
        return int(self.decode_lengths.shape[0])

    def observe_masses(self) -> BlockMasses:
        """Have every layer's `attend` add the attention its blocks receive to the returned `BlockMasses`."""
        chunk_blocks = [int(table.shape[1]) for *_, table in self.chunks]
        width = int(self.decode_tables.shape[1])
        self.masses = BlockMasses(self.num_decoding, width, chunk_blocks, self.slots.device)
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
    ) -> torch.Tensor:
        """Store `key`/`value` `[1, kv_heads, tokens, dim]` and attend `query` `[1, q_heads, tokens, dim]`.

        Returns `[1, tokens, q_heads, dim]`, the layout transformers' attention functions return.
        """
        self.pool.write(layer, self.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
        out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
        decoding = self.num_decoding
        if decoding:
            rows = query[0, :, :decoding].transpose(0, 1).unsqueeze(2)  # [decoding, q_heads, 1, dim]
            mask = self._decode_mask(window)
            result = self.paged(layer, rows, self.decode_tables, self.decode_max, scale, mask, softcap)
            out[0, :decoding] = result[:, 0]
            if self.masses is not None:
                keys = self.gather_keys(layer, self.decode_tables, self.decode_max)
                mass = attention_mass(rows, keys, scale, mask, softcap, self.pool.block_size)
                self.masses.decode[:, : mass.shape[1]] += mass
        for index, (start, length, kv_length, table) in enumerate(self.chunks):
            chunk = query[:, :, start : start + length]
            mask = self._chunk_mask(start, length, kv_length, window, query.device)
            out[0, start : start + length] = self.paged(layer, chunk, table, kv_length, scale, mask, softcap)[0]
            if self.masses is not None:
                keys = self.gather_keys(layer, table, kv_length)
                self.masses.chunks[index] += attention_mass(chunk, keys, scale, mask, softcap, self.pool.block_size)[0]
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
    ) -> torch.Tensor:
        """One call of paged attention over `layer`'s blocks: `[batch, q_len, q_heads, dim]`."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        return dispatch.paged_attention(query, keys, values, table, kv_length, scale, mask=mask, softcap=softcap)

    def _decode_mask(self, window: int | None) -> torch.Tensor | None:
        """`[decoding, 1, 1, longest]` bool: each row's own keys (within its window); None when nothing is hidden."""
        if (-1, window) not in self._masks:
            keys = torch.arange(self.decode_max, device=self.decode_lengths.device)
            lengths = self.decode_lengths[:, None]
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
    ) -> torch.Tensor:
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
        )
