"""`SinkCache`: StreamingLLM (Xiao et al., 2023): attention sinks plus a recent window, past any context length.

transformers caches keys after RoPE, each at its own absolute position, and RoPE scores depend only on the
query-key distance. StreamingLLM numbers positions inside the cache, the sinks right before the window, so no
distance exceeds the cache size. Re-rotating every key is wrong here (and wasteful): window keys are contiguous and
end at the query, so their true distances already are the in-cache ones; only sink ``j`` (of ``n``) must be read
as if at ``w0 - n + j``, ``w0`` the oldest window position. So keys are stored as the model rotated them and the
``n`` sinks are re-rotated at read time, straight to the target (`policies.sink_window.SinkKeys`, float64 angles):
nothing is rotated twice, so no rounding error accumulates over a long stream, and a step re-rotates ``n`` keys per
head. Queries keep transformers' absolute positions; their float32 angles lose precision at positions in the millions.
"""

from __future__ import annotations

from typing import Any

from hf_kvgov.engine.parts import ChainParts, Sink, allocation_of, budget_overrides
from hf_kvgov.engine.slots.layer_budgets import LayerBudgetSpec
from hf_kvgov.engine.slots.slot_attention import DEFAULT_QUERY_CHUNK
from hf_kvgov.engine.slots.slot_codecs import CodecSpec
from hf_kvgov.hf.eviction.cache import EvictionCache
from hf_kvgov.hf.eviction.model_inputs import checked_decoder_config, layer_windows
from hf_kvgov.hf.eviction.rotary import LayerFrequencies
from hf_kvgov.policies import SinkWindow
from hf_kvgov.policies.budget import BudgetSpec, check_budget_spec
from hf_kvgov.policies.sink_window import SinkKeys
from hf_kvgov.storage.pool import BlockPool

_NAME = "SinkCache"


class SinkCache(EvictionCache):
    """Keep the first ``n_sink`` real tokens and the most recent ones, in every KV head.

    Use it under ``with hf_kvgov.eviction_attention(model):`` (it refuses to run otherwise)::

        cache = SinkCache(model, n_sink=4, window=1020)
        with eviction_attention(model):
            model.generate(**inputs, cache=cache, max_new_tokens=100_000)

    Args:
        model: the model to serve: a RoPE (``rotate_half``) attention-only decoder. Sliding-window layers
            (Gemma-3) keep only their window, read without moving any key.
        n_sink: sink tokens kept at the start (StreamingLLM uses 4). Left padding is never a sink.
        window: most recent tokens always kept.
        budget: slots per (sequence, KV head); defaults to ``n_sink + window``. A larger int widens the window;
            a float is a fraction of the prompt (or of ``budget_of``), raised to ``n_sink + window`` if below.
        query_chunk: queries attended at a time (memory O(query_chunk x slots)).
        codec: None (slots in the model's precision), "int8", "int4", "fp8" (e4m3), "fp8_e5m2" or a
            `QuantConfig`: kept slots are stored as codes + per-slot scales (see `EvictionCache`). Sink keys
            are re-rotated from their decoded values, as attention reads them.
        layer_budgets: budgets of individual layers, ``{layer: int or fraction}``, each at least
            ``n_sink + window`` as an int; the others use ``budget``. Or ``Pyramid()``: the budget split over
            the evicting layers, more below, the same total, every layer keeping its sinks and window.
        budget_of: the number of tokens a fractional budget is a fraction of (a stream's whole length);
            None: generate's prompt (a fraction is refused on any other first forward).
        compress: "always" (every step evicts down to the budget) or "prefill" (only the first chunk is
            evicted; later tokens are appended, as after a one-time compression of the prompt).
        pool: a `BlockPool` from `hf_kvgov.eviction_pool(model, codec=...)` shared with other eviction caches:
            the kept slots live in its blocks (a full pool raises `PoolExhausted`); None: the cache's own tensors.
    """

    def __init__(
        self,
        model: Any,
        n_sink: int = 4,
        window: int = 1020,
        budget: BudgetSpec | None = None,
        *,
        query_chunk: int = DEFAULT_QUERY_CHUNK,
        codec: CodecSpec = None,
        layer_budgets: LayerBudgetSpec = None,
        budget_of: int | None = None,
        compress: str = "always",
        pool: BlockPool | None = None,
    ) -> None:
        policy = SinkWindow(n_sink=n_sink, window=window)
        budget = policy.min_budget if budget is None else budget
        check_budget_spec(_NAME, "budget", budget)
        if isinstance(budget, int) and budget < n_sink + window:
            raise ValueError(
                f"{_NAME}(n_sink={n_sink}, window={window}) always keeps {n_sink} sink + {window} window = "
                f"{n_sink + window} slots, so the budget must be at least {n_sink + window}; got a budget of {budget}."
            )
        self.n_sink = n_sink
        self.window = window
        layer_windows(checked_decoder_config(model, _NAME))  # a model it cannot serve is refused before it runs
        rotary = LayerFrequencies(model, _NAME, "re-rotates sink keys")
        rotary.check_keys(model)
        self.sink_keys = SinkKeys(n_sink, rotary.ropes())
        super().__init__(
            model,
            budget,
            lambda _budget: policy,
            min_budget=policy.min_budget,
            read_keys=self.sink_keys,
            query_chunk=query_chunk,
            codec=codec,
            layer_budgets=layer_budgets,
            budget_of=budget_of,
            compress=compress,
            pool=pool,
        )
        # A name of its own: the policy factory above closes over `policy`, the SinkWindow.
        own_budget = None if budget == n_sink + window else budget
        part = Sink(n_sink, window, own_budget, query_chunk, allocation=allocation_of(layer_budgets))
        self.parts = ChainParts.of(policy=part, pool=pool, codec=self.quant, layers=budget_overrides(layer_budgets))
