"""How the engine stores its blocks: in full precision (`FullPrecisionBlocks`), or sealed into a codec's codes once
they leave a request's residual window (`SealedBlockCodec`: int8, int4, int2, fp8, per-layer formats).

Sealing is per request, after each step once its prompt is computed, on the blocks that became full past
`QuantConfig.residual` (the first `sink_blocks` stay in full precision, as `QuantizedCache` keeps them), so each
request's tokens are those of a `QuantizedCache` running it alone (codes without room wait: `Scheduler`); codes and
full-precision blocks share one `QuantizedBlockPool` and its one byte cap. The prefix tree is offered only sealed
blocks (and the sinks), so a block the tree holds is never sealed again into a second copy.
"""

from __future__ import annotations

from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.kernels.ragged import RaggedStep, SealedRaggedStep
from hf_kvgov.serving.request import Request
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed


class FullPrecisionBlocks:
    """Blocks as the model computed them."""

    step_class: type[RaggedStep] = RaggedStep

    def new_pool(
        self,
        geometry: KVGeometry,
        block_size: int,
        max_bytes: int | None,
        groups: tuple[LayerGroup, ...],
        preallocate: bool = False,
    ) -> BlockPool:
        """The engine's pool, a block holding one layer group's layers (`hf_kvgov.storage.layer_groups`)."""
        return BlockPool(geometry, block_size, max_bytes=max_bytes, groups=groups, preallocate=preallocate)

    def seal_ready(self, request: Request, pool: BlockPool) -> bool:
        """Nothing to seal."""
        return True

    def publishable(self, request: Request, block_size: int) -> int:
        """Tokens of the request the prefix tree may take (whole blocks of them)."""
        return request.computed

    def growth_blocks(self, blocks: int, pool: BlockPool) -> int:
        """Free full-precision blocks that `blocks` blocks of decode growth take for good."""
        return blocks

    def reclaimed_blocks(self, tree_blocks: int, pool: BlockPool) -> int:
        """Full-precision blocks that evicting `tree_blocks` of the prefix tree's blocks gives back."""
        return tree_blocks

    def bytes_used(self, pool: BlockPool) -> int:
        """Bytes of the blocks in use (the prefix tree's included)."""
        return pool.num_used * pool.bytes_per_block

    def describe(self) -> str:
        return "full precision"


class SealedBlockCodec(FullPrecisionBlocks):
    """Full blocks sealed into `quant`'s codes, per request, once past its residual window."""

    step_class = SealedRaggedStep

    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant

    def new_pool(
        self,
        geometry: KVGeometry,
        block_size: int,
        max_bytes: int | None,
        groups: tuple[LayerGroup, ...],
        preallocate: bool = False,
    ) -> BlockPool:
        if preallocate:
            raise ValueError(
                "preallocate=True needs full-precision blocks: leave codec=None (a pool of sealed codes shares its cap "
                "between blocks and codes, so it cannot reserve it up front)."
            )
        self.quant.check_model(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, block_size)
        formats = self.quant.formats(geometry.num_layers, geometry.dtype)
        groups = self.quant.layer_groups(groups)
        return QuantizedBlockPool(geometry, formats, block_size, max_bytes=max_bytes, groups=groups)

    def seal_ready(self, request: Request, pool: BlockPool) -> bool:
        """Seal the request's full blocks that left its residual window since the last call; False when the codes
        found no room (the blocks stay as they are: the scheduler makes room before the request's next step, which
        must read them as codes). Not before its prompt is all computed: every chunk of a prefill attends to the
        prompt in full precision, as one prefill alone does, and the blocks it would free were reserved for the whole
        prompt at admission anyway."""
        assert isinstance(pool, QuantizedBlockPool) and request.tables is not None
        if request.computed < len(request.prompt):
            return True
        tables = request.tables
        stored = tables.indices(request.computed, request.evicted_tokens)
        for g, (table, end) in enumerate(zip(tables.tables, stored, strict=True)):
            ready = max(0, end - self.quant.residual) // pool.block_size
            first = max(tables.sealed[g], self.quant.sink_blocks, table.freed)  # a sliding group freed its first
            if ready <= first:
                continue
            ids = table.block_ids
            columns = [c for c in range(first, ready) if not is_sealed(ids[c])]  # a prefix hit may be codes already
            try:
                sealed = pool.seal([ids[c] for c in columns])
            except PoolExhausted:
                return False
            for column, block in zip(columns, sealed, strict=True):
                ids[column] = block
            tables.sealed[g] = ready
        return True

    def growth_blocks(self, blocks: int, pool: BlockPool) -> int:
        """A block a request fills is sealed at once: what growth keeps is codes, a fraction of a block each."""
        assert isinstance(pool, QuantizedBlockPool)
        return -(-blocks * pool.sealed.bytes_per_block // pool.bytes_per_block)

    def reclaimed_blocks(self, tree_blocks: int, pool: BlockPool) -> int:
        """The tree holds codes (`publishable`): evicting them gives back their bytes, not whole blocks."""
        assert isinstance(pool, QuantizedBlockPool)
        return tree_blocks * pool.sealed.bytes_per_block // pool.bytes_per_block

    def bytes_used(self, pool: BlockPool) -> int:
        assert isinstance(pool, QuantizedBlockPool)
        return super().bytes_used(pool) + pool.sealed_stats().bytes_used

    def publishable(self, request: Request, block_size: int) -> int:
        assert request.tables is not None
        return min(request.tables.sealed) * block_size  # past the sinks once anything is sealed, 0 before

    def describe(self) -> str:
        return self.quant.describe()
