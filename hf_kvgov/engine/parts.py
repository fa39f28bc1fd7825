"""The parts a governed cache is built from, as frozen records validated on construction.

One part stands for each link of the brief's chain (`ChainParts` maps them), plus per-layer overrides (`Layer`).
Nothing here holds K/V; `hf_kvgov.hf.governed.GovernedCache` turns a `ChainParts` into a working cache and
`hf_kvgov.engine.rules` refuses the combinations that cannot work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hf_kvgov.engine.quant_config import CODEC_NAMES, QuantConfig
from hf_kvgov.policies.budget import BudgetSpec, check_budget_spec
from hf_kvgov.policies.head_adaptive import HeadAdaptive
from hf_kvgov.policies.pyramid import Pyramid
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool
from hf_kvgov.tiers.spill_config import Disk

ATTENTION_PATHS: tuple[str, ...] = ("contiguous", "paged")

# Codec names a chain accepts -> (fmt, bits) of QuantConfig.
CODEC_ALIASES: dict[str, tuple[str, int]] = {name: key for key, name in CODEC_NAMES.items()} | {"fp8": ("fp8", 8)}


@dataclass(frozen=True)
class Paging:
    """How a cache that stores blocks gets them, when it creates its own pool.

    Args:
        block_size: tokens per block (flash-attn 2's paged kernel needs a multiple of 256).
        max_tokens / max_bytes: cap of the pool (at most one); exceeding it raises `PoolExhausted`.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    max_tokens: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_tokens", "max_bytes"):
            value = getattr(self, name)
            if value is None and name != "block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Paging.{name} must be a positive int; got {value!r}.")
        if self.max_tokens is not None and self.max_bytes is not None:
            raise ValueError("Give Paging's cap as max_tokens or as max_bytes, not both.")

    @property
    def capped(self) -> bool:
        return self.max_tokens is not None or self.max_bytes is not None


@dataclass(frozen=True)
class HeavyHitter:
    """H2O: keep a recent window plus the tokens that collected the most attention, per KV head.

    Args:
        budget: slots per (sequence, KV head): an int, or a float fraction of the prompt (or of `budget_of`).
        recent / heavy: the recent window and the heavy-hitter share (ints or fractions of the budget;
            heavy None = the rest), as `HeavyHitterCache` takes them.
        query_chunk: queries attended at a time (memory O(query_chunk x slots)); None: the cache's default.
        budget_of: the tokens a fractional budget is a fraction of, when it is not generate's prompt (a text
            fed in chunks, or through the model directly); None: the prompt.
        allocation: `Pyramid()` to split the budget over the evicting layers, more below and the same
            total (PyramidKV); None: every layer keeps the budget (or its `Layer` override).
        heads: `HeadAdaptive()` to share each layer's total among its KV heads by their mass (AdaKV);
            None: every head keeps the layer's budget.
    """

    budget: BudgetSpec = 0.2
    recent: BudgetSpec = 0.5
    heavy: BudgetSpec | None = None
    query_chunk: int | None = None
    budget_of: int | None = None
    allocation: Pyramid | None = None
    heads: HeadAdaptive | None = None

    def __post_init__(self) -> None:
        check_budget_spec("HeavyHitter", "budget", self.budget)
        check_budget_spec("HeavyHitter", "recent", self.recent, allow_zero=True)
        if self.heavy is not None:
            check_budget_spec("HeavyHitter", "heavy", self.heavy, allow_zero=True)
        _check_type("HeavyHitter.allocation", self.allocation, (Pyramid,))
        _check_type("HeavyHitter.heads", self.heads, (HeadAdaptive,))

    def describe(self) -> str:
        share = f"{self.budget:.0%}" if isinstance(self.budget, float) else f"{self.budget} tokens"
        heads = "" if self.heads is None else f" (head-adaptive budgets, floor {self.heads.floor:g})"
        return f"H2O {share}" + _allocated(self.allocation) + heads


@dataclass(frozen=True)
class Sink:
    """StreamingLLM: the first ``n_sink`` tokens and a recent ``window``, per KV head.

    Args:
        n_sink / window: sink tokens and recent window, in tokens.
        budget: slots per (sequence, KV head); None = ``n_sink + window``.
        query_chunk: queries attended at a time; None: the cache's default.
        budget_of: the tokens a fractional budget is a fraction of, as for `HeavyHitter`.
        allocation: `Pyramid()` to split the budget over the evicting layers, as for `HeavyHitter`.
    """

    n_sink: int = 4
    window: int = 1020
    budget: BudgetSpec | None = None
    query_chunk: int | None = None
    budget_of: int | None = None
    allocation: Pyramid | None = None

    def __post_init__(self) -> None:
        for name, lowest in (("n_sink", 0), ("window", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"Sink.{name} must be an int >= {lowest}; got {value!r}.")
        if self.budget is not None:
            check_budget_spec("Sink", "budget", self.budget)
        _check_type("Sink.allocation", self.allocation, (Pyramid,))

    def describe(self) -> str:
        return f"sinks {self.n_sink} + window {self.window}" + _allocated(self.allocation)


COMPRESS_MODES = ("always", "prefill")


@dataclass(frozen=True)
class Evict:
    """Any eviction policy of `hf_kvgov.policies` (SnapKV, TOVA, Expected Attention...) as the chain's policy link.

    ``GovernedCache(model, codec="int8", policy=Evict(SnapKV(), 0.2))`` is `PolicyCache` with those arguments.

    Args:
        policy: a policy object, or a registered name ("snapkv", "tova", "expected_attention"...).
        budget: slots per (sequence, KV head): an int, or a float fraction of the prompt (or of `budget_of`).
        decode_policy: the policy for every step after the first chunk (None: ``policy`` throughout).
        compress: "always" (every step evicts) or "prefill" (the first chunk only, later tokens appended).
        query_chunk, budget_of, allocation, heads: as for `HeavyHitter`.
    """

    policy: Any
    budget: BudgetSpec = 0.2
    decode_policy: Any = None
    compress: str = "always"
    query_chunk: int | None = None
    budget_of: int | None = None
    allocation: Pyramid | None = None
    heads: HeadAdaptive | None = None

    def __post_init__(self) -> None:
        from hf_kvgov.policies import EvictionPolicy

        for name in ("policy", "decode_policy"):
            value = getattr(self, name)
            if not (isinstance(value, str | EvictionPolicy) or (name == "decode_policy" and value is None)):
                raise TypeError(
                    f"Evict.{name} must be a policy object (needs, min_budget, select) or a registered policy "
                    f"name; got {value!r}."
                )
        check_budget_spec("Evict", "budget", self.budget)
        if self.compress not in COMPRESS_MODES:
            raise ValueError(f"Evict.compress must be one of {COMPRESS_MODES}; got {self.compress!r}.")
        _check_type("Evict.allocation", self.allocation, (Pyramid,))
        _check_type("Evict.heads", self.heads, (HeadAdaptive,))

    def describe(self) -> str:
        share = f"{self.budget:.0%}" if isinstance(self.budget, float) else f"{self.budget} tokens"
        decode = "" if self.decode_policy is None else f", then {self.decode_policy!r} in decode"
        heads = "" if self.heads is None else f" (head-adaptive budgets, floor {self.heads.floor:g})"
        return f"evict by {self.policy!r} {share}{decode}" + _allocated(self.allocation) + heads


def _allocated(allocation: Pyramid | None) -> str:
    return "" if allocation is None else f" (pyramid budgets over layers, beta {allocation.beta:g})"


Policy = HeavyHitter | Sink | Evict


@dataclass(frozen=True)
class Layer:
    """What one layer does differently from the rest of the chain.

    Args:
        full_precision: store this layer's K/V unquantized (the codec skips it); needs a codec.
        budget: this layer's eviction budget (int slots or a fraction of the prompt); needs a policy.
    """

    full_precision: bool = False
    budget: BudgetSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.full_precision, bool):
            raise TypeError(f"Layer.full_precision must be a bool; got {self.full_precision!r}.")
        if self.budget is not None:
            check_budget_spec("Layer", "budget", self.budget)


@dataclass(frozen=True)
class ChainParts:
    """Every part of one governed cache; None for a link the chain leaves out.

    The brief's chain, and the part that stands for each link::

        request -> prefix hash -> paged blocks -> int8 -> heavy-hitter selection -> spill to SSD
                   prefix=       pool=           codec=  policy=                   spill=
                   PrefixCache   Paging/BlockPool str /  HeavyHitter / Sink /      Disk
                                                         Evict (any policy)
                                                 QuantConfig

    plus per-layer overrides (`Layer`, in `layers`).

    `attention` is how a block-storing cache hands K/V to attention: "contiguous" (any attention
    implementation) or "paged" (the hf_kvgov paged attention reads blocks in place, under
    ``hf_kvgov.paged_attention(model)``). Eviction caches always use the hf_kvgov attention.

    `codec` is normalised to a `QuantConfig` whose ``full_precision_layers`` are exactly the layers marked
    ``Layer(full_precision=True)``, so the two ways of saying it cannot disagree.
    """

    pool: Paging | BlockPool | None = None
    prefix: PrefixCache | None = None
    namespace: str = ""
    codec: QuantConfig | None = None
    policy: Policy | None = None
    spill: Disk | None = None
    layers: tuple[tuple[int, Layer], ...] = field(default=())
    attention: str = "contiguous"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}; got {self.attention!r}.")
        _check_type("pool", self.pool, (Paging, BlockPool))
        _check_type("prefix", self.prefix, (PrefixCache,))
        _check_type("policy", self.policy, (HeavyHitter, Sink, Evict))
        _check_type("spill", self.spill, (Disk,))
        if not isinstance(self.namespace, str):
            raise TypeError(f"namespace must be a str (a tenant salt); got {self.namespace!r}.")
        layers = dict(self.layers)
        if self.codec is not None:
            for index in self.codec.full_precision_layers:
                layers[index] = replace(layers.get(index, Layer()), full_precision=True)
            marked = tuple(i for i, layer in layers.items() if layer.full_precision)
            object.__setattr__(self, "codec", replace(self.codec, full_precision_layers=marked))
        object.__setattr__(self, "layers", tuple(sorted(layers.items())))

    @classmethod
    def of(
        cls,
        *,
        pool: Paging | BlockPool | None = None,
        prefix: PrefixCache | None = None,
        namespace: str = "",
        codec: str | QuantConfig | None = None,
        policy: Policy | None = None,
        spill: Disk | None = None,
        layers: Mapping[int, Layer] | None = None,
        attention: str = "contiguous",
    ) -> ChainParts:
        """Parts from the user's arguments: a codec by name, layer overrides as a mapping."""
        overrides = dict(layers or {})
        for index, layer in overrides.items():
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"layers must map non-negative layer indices to Layer(...); got key {index!r}.")
            _check_type(f"layers[{index}]", layer, (Layer,))
        return cls(pool, prefix, namespace, codec_config(codec), policy, spill, tuple(overrides.items()), attention)

    @property
    def present(self) -> frozenset[str]:
        """The links this chain has: a subset of pool, prefix, codec, policy, spill."""
        links = ("pool", "prefix", "codec", "policy", "spill")
        return frozenset(name for name in links if getattr(self, name) is not None)

    def overrides(self) -> dict[int, Layer]:
        return dict(self.layers)

    def layer_budgets(self) -> dict[int, BudgetSpec]:
        return {i: layer.budget for i, layer in self.layers if layer.budget is not None}

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this chain with ``GovernedCache(model, **kwargs)``."""
        return {
            "pool": self.pool,
            "prefix": self.prefix,
            "namespace": self.namespace,
            "codec": self.codec,
            "policy": self.policy,
            "spill": self.spill,
            "layers": self.overrides() or None,
            "attention": self.attention,
        }

    def describe(self) -> str:
        """One line in the chain's order, e.g. "paged (16-token blocks) -> prefix sharing -> int8"."""
        steps = []
        if isinstance(self.pool, BlockPool):
            steps.append(f"paged (a shared pool of {self.pool.block_size}-token blocks)")
        elif self.pool is not None:
            steps.append(f"paged ({self.pool.block_size}-token blocks)")
        if self.prefix is not None:
            steps.append("prefix sharing")
        if self.codec is not None:
            steps.append(self.codec.describe())
        if self.policy is not None:
            steps.append(self.policy.describe())
        if self.spill is not None and self.policy is not None:
            recall = self.spill.recall()
            steps.append(
                f"disk spill with recall ({recall.pages} pages of {recall.page_tokens} tokens per step, "
                f"{recall.buffer_words})"
            )
        elif self.spill is not None:
            steps.append(f"disk spill (hot {self.spill.hot_tokens} tokens)")
        budgets = self.layer_budgets()
        if budgets:
            steps.append("budgets " + ", ".join(f"layer {i}: {b}" for i, b in budgets.items()))
        if self.attention == "paged":
            steps.append("read in place by the paged attention")
        return " -> ".join(steps) or "paged (default blocks)"


def budget_overrides(layer_budgets: Mapping[int, BudgetSpec] | Pyramid | None) -> dict[int, Layer]:
    """``{layer: budget}`` as the chain's per-layer overrides (an allocator is the policy part's, not these)."""
    if layer_budgets is None or isinstance(layer_budgets, Pyramid):
        return {}
    return {index: Layer(budget=budget) for index, budget in layer_budgets.items()}


def allocation_of(layer_budgets: object) -> Pyramid | None:
    """The allocator a cache's ``layer_budgets`` names, for its policy part (None for explicit budgets)."""
    return layer_budgets if isinstance(layer_budgets, Pyramid) else None


def codec_config(codec: str | QuantConfig | None) -> QuantConfig | None:
    """A `QuantConfig` from a codec name ("int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2") or as given."""
    if codec is None or isinstance(codec, QuantConfig):
        return codec
    if not isinstance(codec, str) or codec not in CODEC_ALIASES:
        raise ValueError(f"Unknown codec {codec!r}; accepted: {', '.join(CODEC_ALIASES)}, or a QuantConfig.")
    fmt, bits = CODEC_ALIASES[codec]
    return QuantConfig(bits=bits, fmt=fmt)


def measured_codec(codec: str | QuantConfig | None, head_dim: int) -> QuantConfig | None:
    """`codec_config`, a codec name taking its format's measured settings at this head_dim (`QuantConfig.filled`:
    KIVI's residual window and value groups for int2), as `QuantizedCache(model, bits=...)` does."""
    quant = codec_config(codec)
    if not isinstance(codec, str) or quant is None:
        return quant
    return QuantConfig.filled(head_dim, None, "auto", None, bits=quant.bits, fmt=quant.fmt)


def _check_type(name: str, value: object, accepted: tuple[type, ...]) -> None:
    if value is not None and not isinstance(value, accepted):
        names = " or ".join(t.__name__ for t in accepted)
        raise TypeError(f"{name} must be a {names} (or None); got a {type(value).__name__}.")
