"""An eviction pool for a model (`eviction_pool`) and the homes its layers' slots take in it (`pooled_homes`).

The records and their blocks are the engine's (`hf_kvgov.engine.slots.pooled_slots`); this module reads the model's
geometry, dtype and devices to lay the pool out.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from hf_kvgov.engine.slots.pooled_slots import PooledSlotHome, SlotRecords, check_eviction_pool, per_layer_groups
from hf_kvgov.engine.slots.slot_store import SlotFormat
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool, KVGeometry


def eviction_pool(
    model: Any,
    codec: Any = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
    preallocate: bool = False,
) -> BlockPool:
    """A pool laid out for the eviction caches of ``model`` whose slots ``codec`` stores (None: dense).

    Pass it as ``pool=`` to as many `HeavyHitterCache` / `PolicyCache` instances as share the memory;
    ``max_tokens`` counts slot rows (one kept token of every KV head of one layer), ``max_bytes`` bytes. A pooled
    cache reads its slots from the blocks and writes them back every step: on a CPU its decode step measured
    1.2-1.4x one that keeps its own tensors (eval/RESULTS.md), the price of one cap over every request's slots.
    """
    from hf_kvgov.engine.slots.slot_codecs import slot_formats
    from hf_kvgov.hf.compat import decoder_config, kv_heads_and_head_dim
    from hf_kvgov.hf.eviction.model_inputs import layer_windows

    config = decoder_config(model)
    heads, head_dim = kv_heads_and_head_dim(config)
    windows = layer_windows(config)
    dtype = _model_dtype(model)
    formats, _ = slot_formats(codec, len(windows), heads, head_dim, "eviction_pool")
    element = torch.empty((), dtype=dtype).element_size()
    width = max(SlotRecords(fmt, head_dim, dtype).width for fmt in formats)
    devices = _layer_devices(model, len(windows))
    geometry = KVGeometry(len(windows), heads, math.ceil(width / element), dtype, devices[0], devices)
    return BlockPool(
        geometry, block_size, max_tokens=max_tokens, max_bytes=max_bytes, preallocate=preallocate,
        groups=per_layer_groups(windows),
    )  # fmt: skip


def pooled_homes(
    pool: BlockPool,
    model: Any,
    windows: Sequence[int | None],
    formats: Sequence[SlotFormat],
    heads: int,
    head_dim: int,
    owner: str,
) -> list[PooledSlotHome]:
    """One home per layer in ``pool``, after checking the pool is laid out for these slots."""
    if not isinstance(pool, BlockPool):
        raise TypeError(f"{owner}: pool must be a BlockPool from hf_kvgov.eviction_pool(model); got {pool!r}.")
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{owner}: a pool needs the model itself (its dtype sizes the slots), not its config.")
    records = [SlotRecords(fmt, head_dim, dtype) for fmt in formats]
    check_eviction_pool(pool, windows, heads, [r.width for r in records], dtype, owner)
    return [PooledSlotHome(pool, layer, layer_records) for layer, layer_records in enumerate(records)]


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError("eviction_pool needs the model itself (its dtype and devices place the pool), not a config.")
    return dtype


def _layer_devices(model: Any, layers: int) -> tuple[torch.device, ...]:
    """Every layer's slot records on the device of the model's first parameter: one tensor holds them all (one
    layer group per layer). A model whose layers run on several devices is warned that its slots cross devices."""
    from hf_kvgov.hf.compat import model_layer_devices

    device = next(model.parameters()).device
    elsewhere = sorted({str(d) for d in model_layer_devices(model, layers) if d is not None and d != device})
    if elsewhere:
        warnings.warn(
            f"eviction_pool: the model's layers run on {', '.join(elsewhere)} too, and the pool keeps every layer's "
            f"slots on {device} (one tensor for all layers), so each step copies those layers' slots there and "
            "back: tokens are right, steps slower. Give each such cache its own tensors (no pool), or serve the model "
            "on one device.",
            stacklevel=3,
        )
    return (device,) * layers
