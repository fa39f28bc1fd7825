"""Eviction policies: pure functions from per-slot facts and positions to the slots worth keeping.

A policy's ``select(facts, positions, valid, budget)`` returns slot indices per KV head; the cache then
moves its tensors with :func:`gather_kept`. ``facts`` is a `SlotFacts` holding what the policy's ``needs``
asks for (attention mass, the last queries' attention, key norms). Build one by name with
:func:`make_policy` (``"h2o"``, ``"sink"``, ``"snapkv"``, ``"tova"``, ``"key_norm"``, ``"mean_mass"``,
``"expected_attention"``). The attention-mass, query-forecast and RoPE helpers feed the policies and the
caches that apply them; `Pyramid` splits a cache's budget over its layers, `HeadAdaptive` a layer's
over its KV heads.
"""

from hf_kvgov.policies.attention_mass import accumulate_attention, attention_mass_chunked
from hf_kvgov.policies.base import EvictionPolicy, FactNeeds, RankingPolicy, SlotFacts
from hf_kvgov.policies.expected_attention import ExpectedAttention
from hf_kvgov.policies.given_scores import GivenScores
from hf_kvgov.policies.head_adaptive import HeadAdaptive
from hf_kvgov.policies.heavy_hitter import H2O
from hf_kvgov.policies.key_norm import KeyNorm
from hf_kvgov.policies.mean_mass import MeanMass
from hf_kvgov.policies.pyramid import Pyramid
from hf_kvgov.policies.query_forecast import QueryForecast, expected_attention
from hf_kvgov.policies.registry import available_policies, make_policy, register_policy
from hf_kvgov.policies.rope import LayerRope, apply_rope, rerotate, rotate_half
from hf_kvgov.policies.selection import (
    gather_kept,
    newest_valid,
    oldest_valid,
    order_by_position,
    select_by_priority,
    select_with_window,
)
from hf_kvgov.policies.sink_window import SinkWindow
from hf_kvgov.policies.snapkv import SnapKV
from hf_kvgov.policies.tova import TOVA
from hf_kvgov.policies.with_sinks import WithSinks

__all__ = [
    "H2O",
    "TOVA",
    "EvictionPolicy",
    "ExpectedAttention",
    "FactNeeds",
    "GivenScores",
    "HeadAdaptive",
    "KeyNorm",
    "LayerRope",
    "MeanMass",
    "Pyramid",
    "QueryForecast",
    "RankingPolicy",
    "SinkWindow",
    "SlotFacts",
    "SnapKV",
    "WithSinks",
    "accumulate_attention",
    "apply_rope",
    "attention_mass_chunked",
    "available_policies",
    "expected_attention",
    "gather_kept",
    "make_policy",
    "newest_valid",
    "oldest_valid",
    "order_by_position",
    "register_policy",
    "rerotate",
    "rotate_half",
    "select_by_priority",
    "select_with_window",
]


def __getattr__(name: str) -> type:
    # The policy was `HeavyHitter`, the name the chain's part (`hf_kvgov.HeavyHitter`) has; the old name still
    # resolves, with a warning, for code written before the rename.
    if name == "HeavyHitter":
        import warnings

        warnings.warn(
            "hf_kvgov.policies.HeavyHitter is now hf_kvgov.policies.H2O (hf_kvgov.HeavyHitter is the chain's "
            "part); the old name will be removed.",
            DeprecationWarning,
            stacklevel=2,
        )
        return H2O
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
