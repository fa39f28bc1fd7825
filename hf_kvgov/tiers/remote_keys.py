"""Keys of the remote prefix tier: what makes two blocks' K/V the same, hashed so that nothing else collides.

A chained SHA-256 as vLLM's block hash, but deterministic across processes and machines (not the salted `hash()`)::

    salt      = sha256(FORMAT_VERSION, model identity, pool layout, tenant)
    key[0]    = sha256(salt,   tree namespace, token ids of block 0)
    key[i]    = sha256(key[i-1],               token ids of block i)

The model identity is its config plus a fingerprint of its weights (`model_identity`); the pool layout is all that
changes a block's bytes (dtype, block size, KV heads, head dim, layers, layer groups, sealed pieces). Two models,
dtypes, codecs or tenants therefore never share a key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

import torch

from hf_kvgov.storage.pool import BlockPool

# Bump when the value layout (`remote_values`) or this key scheme changes: old entries then simply miss.
FORMAT_VERSION = 1

# Elements of each weight tensor hashed into a model's fingerprint (strided over the whole tensor).
_SAMPLES_PER_TENSOR = 4096


def model_identity(model: torch.nn.Module) -> str:
    """A hex digest of a model's config and a sample of its weights: equal for the same checkpoint loaded in
    any process, different for other weights (another fine-tune, another seed) or another config.

    The weights are sampled (a stride over each tensor, with every tensor's name, shape and dtype) rather than
    hashed whole, so fingerprinting a large model takes milliseconds, not seconds.
    """
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::step][:_SAMPLES_PER_TENSOR].cpu().contiguous()
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()


def pool_layout(pool: BlockPool) -> dict[str, object]:
    """Everything about a pool that changes the bytes of a block (see the module docstring), as plain data."""
    g = pool.geometry
    layout: dict[str, object] = {
        "dtype": str(g.dtype),
        "block_size": pool.block_size,
        "layers": g.num_layers,
        "kv_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "groups": [[list(group.layers), group.window] for group in pool.groups],
    }
    sealed = getattr(pool, "sealed", None)
    if sealed is not None:  # a QuantizedBlockPool: each layer's pieces
        layout["sealed"] = [
            {name: [list(shape), str(dtype)] for name, (shape, dtype) in sealed.layout(layer).items()}
            for layer in range(g.num_layers)
        ]
    return layout


def tier_salt(model_id: str, pool: BlockPool, tenant: str) -> bytes:
    """The root of every chain of one (model, pool layout, tenant)."""
    described = json.dumps(
        {"version": FORMAT_VERSION, "model": model_id, "pool": pool_layout(pool), "tenant": tenant}, sort_keys=True
    )
    return hashlib.sha256(described.encode()).digest()


def chain_keys(salt: bytes, namespace: str, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The key of every full block of `token_ids` (32-byte digests, block order); a partial tail has none."""
    parent = hashlib.sha256(salt + b"\x00ns:" + namespace.encode()).digest()
    keys = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}q", *block)).digest()
        keys.append(parent)
    return keys
