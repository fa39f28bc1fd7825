"""Eviction caches: H2O (`HeavyHitterCache`), StreamingLLM (`SinkCache`) and any policy (`PolicyCache`:
SnapKV, TOVA, key-norm, or one policy at prefill and another during decode) on a fixed KV budget.

They keep different tokens in each KV head, so they need the hf_kvgov attention::

    with eviction_attention(model):
        out = model.generate(**inputs, cache=HeavyHitterCache(model, budget=0.2), max_new_tokens=64)

``codec="int8"`` (or "int4", "fp8", "fp8_e5m2", a `QuantConfig`) stores the kept slots as codes + per-slot
scales; ``layer_budgets={0: 1.0}`` gives single layers their own budget.
"""

from hf_kvgov.engine.attention_view import ATTENTION_NAME
from hf_kvgov.engine.slots.slot_codecs import SLOT_CODECS
from hf_kvgov.engine.slots.stats import EvictionStats
from hf_kvgov.hf.attention import eviction_attention, use_eviction_attention
from hf_kvgov.hf.eviction.cache import EvictionCache
from hf_kvgov.hf.eviction.heavy_hitter import HeavyHitterCache
from hf_kvgov.hf.eviction.layer import EvictionLayer
from hf_kvgov.hf.eviction.policy_cache import PolicyCache
from hf_kvgov.hf.eviction.sink import SinkCache

__all__ = [
    "ATTENTION_NAME",
    "SLOT_CODECS",
    "EvictionCache",
    "EvictionLayer",
    "EvictionStats",
    "HeavyHitterCache",
    "PolicyCache",
    "SinkCache",
    "eviction_attention",
    "use_eviction_attention",
]
