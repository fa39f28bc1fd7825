"""The pool of a `PagedCache`: created from the model's geometry (sealing blocks with a codec link, capped by a
disk link's budget), or adopted when given (a shared pool, a prefix tree's), and each layer's device checked.

Functions of the cache, as `paged_prefix` is for sharing: they set the cache's pool and block tables, which
the disk link then replaces by tiered ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_kvgov.engine.block_tier import SpillFormat, raw_spill_format
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.geometry import check_placement
from hf_kvgov.storage.pool import BlockPool, KVGeometry

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore


def create_pool(cache: BlockStore, dtype: torch.dtype, device: torch.device) -> None:
    """The pool `cache` creates when none was given: each layer's blocks on the device the model runs it on."""
    devices = tuple(device if known is None else known for known in cache.layer_devices)
    geometry = KVGeometry(cache.num_layers, cache.num_kv_heads, cache.head_dim, dtype, devices[0], devices)
    if cache.spill_link is not None:
        cache.spill_link.check_pool_budget(cache, geometry)
    adopt_pool(cache, _new_pool(cache, geometry))
    # Layers whose device the model did not tell go where their first K/V arrive.
    cache.placeable = frozenset(i for i, known in enumerate(cache.layer_devices) if known is None)


def _new_pool(cache: BlockStore, geometry: KVGeometry) -> BlockPool:
    """Sealing blocks with a codec link, else plain."""
    if cache.sealer is not None:  # its max_bytes counts the codes too (a disk tier's max_resident_bytes included)
        return cache.sealer.new_pool(geometry, cache.groups, **cache.pool_args)
    return BlockPool(geometry, groups=cache.groups, **cache.pool_args)  # type: ignore[arg-type]


def adopt_pool(cache: BlockStore, pool: BlockPool) -> None:
    """Draw `cache`'s blocks from `pool`, after refusing one that cannot hold this model's K/V as it stores them."""
    if cache.sealer is not None:
        cache.sealer.check_pool(pool, cache.num_layers)
    g = pool.geometry
    wanted = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    if (g.num_layers, g.num_kv_heads, g.head_dim) != wanted:
        raise ValueError(
            f"The pool's geometry (layers, kv heads, head dim) = {(g.num_layers, g.num_kv_heads, g.head_dim)} "
            f"does not match the model's {wanted}; create the pool from this model's geometry."
        )
    check_placement(cache.layer_devices, [pool.layer_device(i) for i in range(cache.num_layers)])
    cache.pool = pool
    cache.tables = BlockTables(pool, pool.groups[0])
    cache.other_tables = [BlockTables(pool, group) for group in pool.groups[1:]]
    cache.placeable = frozenset[int]()  # an adopted pool's placement is its owner's choice
    if cache.spill_link is not None:  # its tiered tables replace the plain ones
        cache.spill_link.attach(cache, pool, _spill_format(cache, pool))


def _spill_format(cache: BlockStore, pool: BlockPool) -> SpillFormat:
    extent = cache.disk.extent_blocks
    return raw_spill_format(pool, extent) if cache.sealer is None else cache.sealer.tier_format(pool, extent)


def check_layer_device(cache: BlockStore, layer: int, device: torch.device) -> None:
    """K/V of `layer` arrived on `device`, not where its blocks are: place an unknown layer, else refuse."""
    assert cache.pool is not None
    if layer in cache.placeable and not cache.pool.is_written(layer):
        cache.pool.place_layer(layer, device)
        return
    raise ValueError(
        f"Layer {layer} stored K/V on {device}, but this cache keeps layer {layer}'s blocks on "
        f"{cache.pool.layer_device(layer)} and never moves K/V between devices. Build the cache from the "
        "model after placing it (from_pretrained(device_map=...) or dispatch_model), so each layer's "
        "blocks follow model.hf_device_map, or pass a pool whose KVGeometry.layer_devices match it."
    )
