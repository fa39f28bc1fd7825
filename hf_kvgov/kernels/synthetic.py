"""Random paged K/V for checking and timing attention kernels: `make_case` builds one batch.

Rows of ragged lengths are written into blocks whose ids are a random permutation (a kernel that reads blocks in id
order, or ignores the table, fails). With `sealed_format`, every block wholly inside its row except the first
`sink_blocks` is sealed as a `QuantizedCache` seals it, at a random sealed id, its entry replaced by `-1 - id`::

    row b:  [ sink (fp) | sealed | sealed | ... | sealed | tail (fp, partly filled) ]

Every slot a kernel must not read holds NaN (tokens past a row, spare blocks, a sealed block's full-precision
copy, spare sealed ids' statistics). The case's dense `keys` / `values` are what the cache really holds (sealed
tokens decoded), so dense float64 attention over them is an independent expected result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_kvgov.codecs.registry import get_codec
from hf_kvgov.kernels.quantized_reference import quantized_paged_attention_reference
from hf_kvgov.kernels.reference import paged_attention_reference
from hf_kvgov.kernels.sealed_blocks import RAW_FORMAT, SealedBlocks
from hf_kvgov.storage.sealed_formats import CodecFormat, RawFormat, SealedFormat

SPARE_BLOCKS = 3


@dataclass(frozen=True)
class PagedCase:
    """One batch of paged K/V and its queries (the query of row b sits at its last positions)."""

    query: Tensor  # [batch, q_heads, q_len, head_dim]
    keys: Tensor  # [batch, kv_heads, kv_length, head_dim] fp32, as stored; NaN past each row's length
    values: Tensor
    key_cache: Tensor  # [num_blocks, block_size, kv_heads, head_dim], the full-precision blocks
    value_cache: Tensor
    block_table: Tensor  # long [batch, blocks]; entries < 0 are sealed
    seq_lens: Tensor  # long [batch]
    sealed: SealedBlocks | None = None
    sealed_format: SealedFormat | None = None

    @property
    def kv_length(self) -> int:
        return int(self.keys.shape[2])

    def attention_mask(self) -> Tensor:
        """bool `[batch, 1, q_len, kv_length]`: key j is attended by query i of row b when j < len_b and
        j <= len_b - q_len + i (causal, queries at the end of their row)."""
        q_len = self.query.shape[2]
        key = torch.arange(self.kv_length, device=self.query.device)
        last = self.seq_lens[:, None] - q_len + torch.arange(q_len, device=self.query.device)[None, :]
        allowed = (key[None, None, :] <= last[:, :, None]) & (key[None, None, :] < self.seq_lens[:, None, None])
        return allowed[:, None]

    def read_sealed(self, block_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Decoded keys, values `[n, block_size, H, D]` of sealed table entries long `[n]` (the reference's
        `SealedReader`)."""
        assert self.sealed is not None and self.sealed_format is not None, "only a sealed case has sealed blocks"
        rows = -1 - block_ids
        return self.sealed_format.decode({name: t[rows] for name, t in self.sealed.pieces.items()}, dtype)

    def reference(self, scale: float, softcap: float | None = None) -> Tensor:
        """The torch reference (the spec) for this case: `[batch, q_len, q_heads, head_dim]`."""
        mask = self.attention_mask()
        # The reference multiplies masked weights (0) by the values it reads: NaN there would leak.
        key_cache, value_cache = self.key_cache.nan_to_num(), self.value_cache.nan_to_num()
        args = (self.query, key_cache, value_cache, self.block_table, self.kv_length, scale)
        if self.sealed is None:
            return paged_attention_reference(*args, mask=mask, softcap=softcap)
        return quantized_paged_attention_reference(*args, self.read_sealed, mask=mask, softcap=softcap)

    def dense_attention(self, scale: float, softcap: float | None = None) -> Tensor:
        """`softmax(Q Kᵀ · scale) V` in float64 over the attended keys, K/V repeated per query head:
        `[batch, q_len, q_heads, head_dim]`; 0 for a query with no attended key."""
        allowed = self.attention_mask()  # [batch, 1, q_len, kv_length]
        group = self.query.shape[1] // self.keys.shape[1]
        keys = self.keys.double().nan_to_num().repeat_interleave(group, dim=1)
        values = self.values.double().nan_to_num().repeat_interleave(group, dim=1)
        scores = self.query.double() @ keys.transpose(-1, -2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num()
        return (weights @ values).transpose(1, 2)


def make_case(
    lengths: Sequence[int],
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    q_len: int = 1,
    sealed_format: str | None = None,
    codec_options: Mapping[str, Any] | None = None,
    sink_blocks: int = 1,
    seed: int = 0,
) -> PagedCase:
    """A batch whose row b holds `lengths[b]` tokens (kv_length = max(lengths)); see the module docstring.

    `sealed_format`: None (every block in full precision), "full" (sealed but unquantized) or a codec name
    ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"), built with `codec_options` (group_size, scale_dtype).
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must name at least one row, each of at least 1 token; got {list(lengths)}.")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}).")
    device = torch.device(device)
    # Values are drawn on the device (a GPU-size case is slow to build on the host); the block order on
    # the CPU, so it is the same everywhere for one seed.
    values_rng = torch.Generator(device=device).manual_seed(seed)
    order_rng = torch.Generator().manual_seed(seed)
    batch, kv_length = len(lengths), max(lengths)
    seq_lens = torch.tensor(list(lengths), device=device)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=values_rng, device=device).to(dtype)

    query = randn(batch, q_heads, q_len, head_dim)
    keys, values = randn(batch, kv_heads, kv_length, head_dim), randn(batch, kv_heads, kv_length, head_dim)
    outside = (torch.arange(kv_length, device=device)[None, :] >= seq_lens[:, None])[:, None, :, None]
    keys, values = keys.masked_fill(outside, float("nan")), values.masked_fill(outside, float("nan"))
    blocks = -(-kv_length // block_size)
    num_blocks = batch * blocks + SPARE_BLOCKS
    table = torch.randperm(num_blocks, generator=order_rng)[: batch * blocks].reshape(batch, blocks).to(device)
    key_cache = _scatter(keys, table, num_blocks, block_size)
    value_cache = _scatter(values, table, num_blocks, block_size)
    case = PagedCase(query, keys.float(), values.float(), key_cache, value_cache, table, seq_lens)
    if sealed_format is None:
        return case
    fmt = _sealed_format(sealed_format, dtype, dict(codec_options or {}))
    return _seal(case, fmt, sink_blocks, order_rng)


def _sealed_format(name: str, dtype: torch.dtype, options: dict[str, Any]) -> SealedFormat:
    return RawFormat(dtype) if name == RAW_FORMAT else CodecFormat(get_codec(name, **options))


def _scatter(dense: Tensor, table: Tensor, num_blocks: int, block_size: int) -> Tensor:
    """Dense `[batch, H, length, D]` -> blocks `[num_blocks, block_size, H, D]` as `table` places them."""
    batch, heads, length, dim = dense.shape
    blocks = table.shape[1]
    padded = dense.new_full((batch, blocks * block_size, heads, dim), float("nan"))
    padded[:, :length] = dense.transpose(1, 2)
    cache = dense.new_full((num_blocks, block_size, heads, dim), float("nan"))
    cache[table.reshape(-1)] = padded.view(batch * blocks, block_size, heads, dim)
    return cache


def _seal(case: PagedCase, fmt: SealedFormat, sink_blocks: int, generator: torch.Generator) -> PagedCase:
    """Seal every whole block past the sink (see the module docstring); returns the sealed case."""
    table = case.block_table.clone()
    blocks = table.shape[1]
    block_size = case.key_cache.shape[1]
    columns = torch.arange(blocks, device=table.device)[None, :]
    sealable = (columns >= sink_blocks) & ((columns + 1) * block_size <= case.seq_lens[:, None])
    full_ids = table[sealable]
    pieces = fmt.encode(case.key_cache[full_ids], case.value_cache[full_ids])
    capacity = len(full_ids) + SPARE_BLOCKS
    sealed_ids = torch.randperm(capacity, generator=generator)[: len(full_ids)].to(table.device)
    stored = {name: _with_spare_rows(piece, sealed_ids, capacity) for name, piece in pieces.items()}
    table[sealable] = -1 - sealed_ids
    key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
    key_cache[full_ids] = float("nan")  # the full-precision copy of a sealed block is gone
    value_cache[full_ids] = float("nan")
    decoded_keys, decoded_values = fmt.decode(pieces, torch.float32)
    keys = _replace_blocks(case.keys, sealable, decoded_keys)
    values = _replace_blocks(case.values, sealable, decoded_values)
    sealed = SealedBlocks(fmt.name, stored)
    return PagedCase(case.query, keys, values, key_cache, value_cache, table, case.seq_lens, sealed, fmt)


def _with_spare_rows(piece: Tensor, sealed_ids: Tensor, capacity: int) -> Tensor:
    """`piece` `[n, ...]` placed at rows `sealed_ids` of a `[capacity, ...]` tensor; spare rows hold NaN
    statistics or raw values (zero codes), so a kernel reading the wrong sealed id returns NaN."""
    shape = (capacity, *piece.shape[1:])
    if piece.element_size() == 1:  # codes: handled as bytes, whatever their dtype (float8 included)
        out = torch.zeros(shape, dtype=torch.uint8, device=piece.device)
        out[sealed_ids] = piece.view(torch.uint8)
        return out.view(piece.dtype)
    out = piece.new_full(shape, float("nan"))
    out[sealed_ids] = piece
    return out


def _replace_blocks(dense: Tensor, sealable: Tensor, decoded: Tensor) -> Tensor:
    """Dense fp32 `[batch, H, length, D]` with the tokens of the sealed blocks replaced by `decoded`
    `[n, block_size, H, D]` (in the order of `sealable`'s True entries, row-major)."""
    batch, heads, length, dim = dense.shape
    blocks, block_size = sealable.shape[1], decoded.shape[1]
    padded = dense.new_full((batch, blocks * block_size, heads, dim), float("nan"))
    padded[:, :length] = dense.transpose(1, 2)
    by_block = padded.view(batch, blocks, block_size, heads, dim)
    by_block[sealable] = decoded
    return by_block.view(batch, blocks * block_size, heads, dim)[:, :length].transpose(1, 2).contiguous()
