"""Stateless K/V block codecs: int8, int4 (two per byte), int2 (four per byte) and fp8 (e4m3, e5m2).

Keys are grouped per channel over a block's tokens, values per token along head_dim (KIVI). Each
codec file documents its packed layout and the exact dequantization formula a kernel must mirror.

    from hf_kvgov.codecs import get_codec

    codec = get_codec("int8")
    enc = codec.encode_keys(k_block)                  # k_block: [n, block_size, H, D]
    k_again = codec.decode(enc, torch.bfloat16)       # [n, block_size, H, D]
"""

from hf_kvgov.codecs.affine import AffineCodec
from hf_kvgov.codecs.base import Encoded, KVCodec
from hf_kvgov.codecs.fp8 import Float8Codec, Fp8E4M3Codec, Fp8E5M2Codec
from hf_kvgov.codecs.grouping import GroupAxis, ScaleGroups
from hf_kvgov.codecs.int2 import Int2Codec, pack_int2, unpack_int2
from hf_kvgov.codecs.int4 import Int4Codec, pack_int4, unpack_int4
from hf_kvgov.codecs.int8 import Int8Codec
from hf_kvgov.codecs.registry import CodecFactory, available_codecs, get_codec, register_codec

__all__ = [
    "AffineCodec",
    "CodecFactory",
    "Encoded",
    "Float8Codec",
    "Fp8E4M3Codec",
    "Fp8E5M2Codec",
    "GroupAxis",
    "Int2Codec",
    "Int4Codec",
    "Int8Codec",
    "KVCodec",
    "ScaleGroups",
    "available_codecs",
    "get_codec",
    "pack_int2",
    "pack_int4",
    "register_codec",
    "unpack_int2",
    "unpack_int4",
]
