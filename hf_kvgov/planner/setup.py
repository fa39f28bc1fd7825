"""CacheSetup: every knob of how a cache stores a sequence, at one step of the governance chain."""

from __future__ import annotations

from dataclasses import dataclass

from hf_kvgov.planner.layout import (
    CODEC_FORMATS,
    SLOT_CODECS,
    BlockFormat,
    DenseSlotFormat,
    FullPrecision,
    SlotLayout,
    check_scale_bytes,
    codec_format,
)
from hf_kvgov.planner.units import KV_DTYPE_BYTES, normalize_dtype

DEFAULT_BLOCK_SIZE = 16
DEFAULT_H2O_RECENT = 64
DEFAULT_SPILL_HOT_TOKENS = 512
# Key rows each written recall page leaves resident, by summary (`hf_kvgov.tiers.recall_pages.SUMMARY_ROWS`;
# a test keeps them equal, the planner imports no torch).
RECALL_SUMMARY_ROWS = {"bounds": 2, "centroid": 1}
DEFAULT_RECALL_SUMMARY = "centroid"
# Where recalled pages are held (`hf_kvgov.tiers.recall_pages.BUFFERS`): each layer's own buffer, or one shared.
RECALL_BUFFERS = ("layer", "shared")
DEFAULT_RECALL_BUFFER = "shared"


@dataclass(frozen=True)
class CacheSetup:
    """How one sequence's KV is stored.

    Args:
        paged: blocks of ``block_size`` tokens allocated on demand (True) or one buffer of ``max_len``
            tokens pre-allocated per sequence (False, "static").
        max_len: tokens a static buffer holds (required when ``paged`` is False).
        block_size: tokens per block; a sequence of L tokens holds ceil(L / block_size) blocks.
        kv_dtype: full-precision element type ('fp32', 'fp16', 'bf16').
        codec: quantization of sealed blocks ('int8', 'int4', 'int2', 'fp8') or None.
        layer_codecs: per-layer overrides of ``codec``, sorted ``(layer, codec or None)`` pairs (None: that
            layer's blocks stay in full precision), as a `QuantConfig`'s ``layer_formats`` and
            ``full_precision_layers`` give them.
        scale_bytes / group_size: size of a quantization scale and of an integer codec's zero point (fp16: 2,
            fp32: 4, one byte: 1) and the value group along head_dim (None: one group per head).
        sink_blocks: leading blocks a quantized cache keeps in full precision.
        residual: a quantized cache's newest tokens kept in full precision (`QuantConfig.residual`): a block is
            sealed once it is full and all its tokens are older than that.
        shared_fraction: part of each sequence's tokens that is a prefix shared with other sequences
            (rounded down to whole blocks; 0 turns sharing off).
        share_group: sequences that share one stored prefix (None: all concurrent sequences).
        h2o_budget: fraction of each layer's tokens H2O keeps (recent window included), or None.
        h2o_recent: most recent tokens H2O always keeps (the budget never goes below it).
        h2o_score_bytes: bytes of accumulated attention mass H2O keeps per slot and KV head (fp32: 4).
        h2o_metadata_bytes: further bookkeeping bytes per kept slot and KV head (hf_kvgov's eviction caches:
            the RoPE position, int64, and a validity flag, bool: 9).
        eviction_slots: H2O keeps dense per-head slots rather than blocks (hf_kvgov's eviction caches): each
            kept token of each KV head costs `slot_format`'s bytes, a codec encoding every slot on its own.
            With ``block_size`` > 1 the slots live in an eviction pool's blocks of slot rows (whole blocks).
            It spills no blocks; with ``shared_fraction`` its shared prefix is stored once in full-precision
            blocks (a tree an eviction cache reads as computed) and the budget applies to its own tokens.
        recall_pages: with eviction slots, what the policy evicts goes to disk pages of
            ``recall_page_tokens`` tokens and ``recall_pages`` of them are recalled per step (None: evicted
            tokens are dropped). Resident per layer and KV head besides the kept slots: one pending page,
            the recalled pages, and one summary per written page with its table entry
            (`hf_kvgov.engine.slots.recall`); on disk: every evicted token in a full page.
        recall_summary: what each written page leaves resident: "centroid" (its mean key) or "bounds" (its
            keys' per-channel min and max), as `Recall.summary`.
        recall_buffer: where recalled pages are held, as `Recall.buffer`: "layer" (every layer and KV head
            holds up to ``recall_pages`` pages) or "shared" (one buffer holds one layer's pages, for all).
        query_statistics_bytes: with eviction slots, bytes of running query statistics every layer keeps per
            sequence (Expected Attention's running forecast: float64 count, sums and outer products per query
            head; 0: none).
        spill_hot_tokens: most recent tokens per layer kept on the accelerator when cold blocks spill
            to disk (0: every full block spills), or None for no spill. With ``shared_fraction`` (a prefix tree)
            a sliding-window layer spills nothing: its prompt's blocks are the tree's, which stay resident.
        spill_pinned_blocks: leading blocks that never spill (an attention-sink block read by every query).
        spill_buffer_bytes: the most read-ahead memory a spilling sequence holds besides its blocks: it
            holds one layer of its spilled blocks (as the disk caches' rows do), up to this.
        step_tokens: tokens the newest sequence writes in one step (a prefill chunk; 0: count the steady state
            only). They are written in full precision and stay so until the step seals them (a codec) or the
            next spills them (a disk tier): the budget keeps room for one such step, for the sequence being
            admitted.
        window_frees: sliding-window layers free what falls out of their window (True), or keep every
            token like a full layer (False: hf_kvgov's block-storing caches, whose one block id spans all
            layers). Eviction setups always keep at most ``window - 1`` slots in a sliding layer.
    """

    paged: bool = True
    max_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_dtype: str = "fp16"
    codec: str | None = None
    layer_codecs: tuple[tuple[int, str | None], ...] = ()
    scale_bytes: int = 2
    group_size: int | None = None
    sink_blocks: int = 1
    residual: int = 0
    shared_fraction: float = 0.0
    share_group: int | None = None
    h2o_budget: float | None = None
    h2o_recent: int = DEFAULT_H2O_RECENT
    h2o_score_bytes: int = 4
    h2o_metadata_bytes: int = 0
    eviction_slots: bool = False
    recall_pages: int | None = None
    recall_page_tokens: int = 16
    recall_summary: str = DEFAULT_RECALL_SUMMARY
    recall_buffer: str = DEFAULT_RECALL_BUFFER
    query_statistics_bytes: int = 0
    spill_hot_tokens: int | None = None
    spill_pinned_blocks: int = 0
    spill_buffer_bytes: int = 0
    step_tokens: int = 0
    window_frees: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype, KV_DTYPE_BYTES, "KV cache dtype"))
        self._check_ints()
        if self.codec is not None and self.codec not in CODEC_FORMATS:
            raise ValueError(f"Unknown KV codec {self.codec!r}; accepted: {', '.join(CODEC_FORMATS)}, or None.")
        self._check_layer_codecs()
        if not 0.0 <= self.shared_fraction < 1.0:
            raise ValueError(
                "shared_fraction is the part of each sequence that is a shared prefix and must lie in "
                f"[0, 1) (at least one token of a request is its own); got {self.shared_fraction}."
            )
        if self.h2o_budget is not None and not 0.0 < self.h2o_budget <= 1.0:
            raise ValueError(f"h2o_budget is the fraction of tokens H2O keeps, in (0, 1]; got {self.h2o_budget}.")
        if not self.paged and self.max_len is None:
            raise ValueError("A static (pre-allocated) cache needs max_len, the tokens each buffer holds.")
        spills = self.spill_hot_tokens is not None
        if not self.paged and (self.codec or self.shared_fraction or self.h2o_budget or spills):
            raise ValueError(
                "hf_kvgov applies quantization, prefix sharing, H2O and spill to paged blocks; a static "
                "(pre-allocated) setup takes none of them. Set paged=True first."
            )

    def _check_layer_codecs(self) -> None:
        pairs = self.layer_codecs
        shape_ok = isinstance(pairs, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
        if not shape_ok:
            raise TypeError(f"CacheSetup.layer_codecs must be a tuple of (layer, codec) pairs; got {pairs!r}.")
        layers = [layer for layer, _ in pairs]
        bad = any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in layers)
        if bad or len(set(layers)) < len(layers):
            raise ValueError(f"CacheSetup.layer_codecs must name distinct layer indices >= 0; got {pairs!r}.")
        unknown = [codec for _, codec in pairs if codec is not None and codec not in CODEC_FORMATS]
        if unknown:
            accepted = ", ".join(CODEC_FORMATS)
            raise ValueError(f"layer_codecs names unknown codecs {unknown}; accepted: {accepted}, or None.")
        if pairs and not self.paged:
            raise ValueError("layer_codecs quantize paged blocks; a static (pre-allocated) setup takes none.")

    def _check_ints(self) -> None:
        positive = {"block_size": self.block_size, "max_len": self.max_len, "share_group": self.share_group}
        positive.update(group_size=self.group_size)
        non_negative = {"sink_blocks": self.sink_blocks, "residual": self.residual, "h2o_recent": self.h2o_recent}
        non_negative.update(h2o_score_bytes=self.h2o_score_bytes, h2o_metadata_bytes=self.h2o_metadata_bytes)
        non_negative.update(spill_pinned_blocks=self.spill_pinned_blocks, spill_buffer_bytes=self.spill_buffer_bytes)
        non_negative.update(query_statistics_bytes=self.query_statistics_bytes)
        non_negative.update(step_tokens=self.step_tokens)
        for name, value in positive.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"CacheSetup.{name} must be a positive int or None; got {value!r}.")
        for name, value in non_negative.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CacheSetup.{name} must be an int >= 0; got {value!r}.")
        hot = self.spill_hot_tokens  # 0 is a cache that spills every full block but the pinned ones
        if hot is not None and (isinstance(hot, bool) or not isinstance(hot, int) or hot < 0):
            raise ValueError(f"CacheSetup.spill_hot_tokens must be an int >= 0 or None (no spill); got {hot!r}.")
        for name in ("window_frees", "eviction_slots"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CacheSetup.{name} must be a bool; got {getattr(self, name)!r}.")
        spills = self.spill_hot_tokens is not None
        if self.eviction_slots and (self.h2o_budget is None or spills):
            raise ValueError(
                "eviction_slots describes an eviction cache's per-head slots: it needs h2o_budget, and such a cache "
                "spills no blocks (spill_hot_tokens None; what it evicts is recalled: recall_pages)."
            )
        if self.recall_pages is not None:
            pages, size = self.recall_pages, self.recall_page_tokens
            if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
                raise ValueError(f"CacheSetup.recall_pages must be an int >= 0 or None; got {pages!r}.")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"CacheSetup.recall_page_tokens must be a positive int; got {size!r}.")
            if self.recall_summary not in RECALL_SUMMARY_ROWS:
                raise ValueError(
                    f"CacheSetup.recall_summary must be one of {', '.join(RECALL_SUMMARY_ROWS)}; got "
                    f"{self.recall_summary!r}."
                )
            if self.recall_buffer not in RECALL_BUFFERS:
                raise ValueError(
                    f"CacheSetup.recall_buffer must be one of {', '.join(RECALL_BUFFERS)}; got {self.recall_buffer!r}."
                )
            if not self.eviction_slots:
                raise ValueError("recall_pages recalls what an eviction cache evicts: it needs eviction_slots=True.")
        check_scale_bytes(self.scale_bytes)
        if self.scale_bytes == 1 and self.eviction_slots and self.codec is not None:
            raise ValueError(
                "An eviction cache's quantized slots keep fp16 statistics (scale_bytes=2); one-byte statistics "
                "(scale_bytes=1) are for sealed blocks."
            )

    @property
    def full_format(self) -> BlockFormat:
        """Format of full-precision blocks (all of them without a codec; sink and tail with one)."""
        return FullPrecision(self.kv_dtype, KV_DTYPE_BYTES[self.kv_dtype])

    @property
    def sealed_format(self) -> BlockFormat:
        """Format of sealed (full, non-sink) blocks."""
        if self.codec is None:
            return self.full_format
        return codec_format(self.codec, self.scale_bytes, self.group_size)

    @property
    def slot_format(self) -> SlotLayout:
        """Format of an eviction cache's kept slots (see `eviction_slots`)."""
        if self.codec is None:
            return DenseSlotFormat(self.kv_dtype, KV_DTYPE_BYTES[self.kv_dtype])
        return SLOT_CODECS[self.codec](self.scale_bytes, self.group_size)
