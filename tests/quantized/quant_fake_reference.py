"""An independent model of what QuantizedCache must compute: a DynamicCache that fake-quantizes.

At the end of every forward step (after the last layer stored its K/V) each full block that is past the
sink and older than the residual window, and not yet quantized, is replaced in place by
decode(encode(block)) with the codec, per row. Nothing of hf_kvgov's storage, pool or kernels is used:
only transformers' DynamicCache and the codec. The tensors returned to attention in that step are the
full-precision ones (DynamicCache returns a fresh tensor per update; quantizing swaps in a new one).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov.codecs import get_codec


class FakeQuantCache(DynamicCache):
    def __init__(
        self,
        config: Any,
        codec: str,
        block_size: int,
        residual: int = 0,
        sink_blocks: int = 1,
        full_precision_layers: tuple[int, ...] = (),
        layer_codecs: dict[int, str] | None = None,
        scale_dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__(config=config)
        self.codec = get_codec(codec, scale_dtype=scale_dtype)
        self.layer_codecs = {
            layer: get_codec(name, scale_dtype=scale_dtype) for layer, name in (layer_codecs or {}).items()
        }
        self.block_size = block_size
        self.residual = residual
        self.sink_blocks = sink_blocks
        self.full_precision_layers = full_precision_layers
        self.num_layers = config.num_hidden_layers
        self.quantized_blocks = sink_blocks  # blocks [sink_blocks, quantized_blocks) hold decoded values

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.num_layers - 1:
            self._quantize_ready_blocks()
        return keys, values

    def _quantize_ready_blocks(self) -> None:
        bs = self.block_size
        ready = max(0, self.get_seq_length() - self.residual) // bs
        if ready <= self.quantized_blocks:
            return
        span = slice(self.quantized_blocks * bs, ready * bs)
        for index, layer in enumerate(self.layers):
            if index in self.full_precision_layers:
                continue
            codec = self.layer_codecs.get(index, self.codec)
            layer.keys = self._roundtrip(layer.keys, span, codec, codec.encode_keys)
            layer.values = self._roundtrip(layer.values, span, codec, codec.encode_values)
        self.quantized_blocks = ready

    def _roundtrip(self, x: torch.Tensor, span: slice, codec: Any, encode: Any) -> torch.Tensor:
        """x `[batch, heads, tokens, dim]`; blocks in `span` become decode(encode(block)), per row and block."""
        batch, heads, _, dim = x.shape
        part = x[:, :, span].transpose(1, 2)  # [batch, tokens, heads, dim]
        blocks = part.reshape(batch, -1, self.block_size, heads, dim)  # [batch, n, bs, heads, dim]
        decoded = codec.decode(encode(blocks), x.dtype).reshape(part.shape).transpose(1, 2)
        out = x.clone()
        out[:, :, span] = decoded
        return out

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        whole = self.get_seq_length() // self.block_size
        self.quantized_blocks = max(self.sink_blocks, min(self.quantized_blocks, whole))
