"""Expected Attention: keep the slots the queries still to come are expected to attend to."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.query_forecast import QueryForecast
from hf_kvgov.policies.selection import newest_valid, oldest_valid, select_within_budget


@dataclass(frozen=True)
class ExpectedAttention:
    """Expected Attention (Devoto et al., 2025), applied per KV head.

    Each slot is scored by the attention future queries are expected to pay it (`QueryForecast`: the
    statistics of the step's queries, rotated to the positions to come; see
    :mod:`hf_kvgov.policies.query_forecast`), and the best-scored slots are kept. Unlike SnapKV and TOVA,
    which rank by the attention the last queries *paid*, the estimate looks ahead, so a slot that a later
    question would need can win over one the prompt's end happened to look at.

    Args:
        sinks: the oldest valid slots, always kept (attention sinks collect weight whatever the query;
            kvpress keeps 4).
        recent: the newest valid slots, always kept. kvpress keeps none, because it compresses a context
            before the question is appended; with the question inside the prompt, and during decode, the
            window keeps the question and the tokens just written (without it, Gemma-3's passkey at 4k and
            20% fell to 0/10, its answers a repeated digit: a forecast from one decode query evicts them).
        forecast: how the future queries are estimated.

    Ties go to the more recent position, then to the lower slot index.
    """

    sinks: int = 4
    recent: int = 32
    forecast: QueryForecast = field(default_factory=QueryForecast)

    def __post_init__(self) -> None:
        check_count("ExpectedAttention", "sinks", self.sinks)
        check_count("ExpectedAttention", "recent", self.recent)
        if not isinstance(self.forecast, QueryForecast):
            raise TypeError(f"ExpectedAttention.forecast must be a QueryForecast; got {self.forecast!r}.")

    @property
    def needs(self) -> FactNeeds:
        return FactNeeds(forecast=self.forecast)

    @property
    def min_budget(self) -> int:
        return max(self.sinks + self.recent, 1)

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        Reads ``facts.expected_attention``, float ``[batch, kv_heads, slots]``; ``positions``/``valid`` as in
        :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: the expected attention, +inf on sinks and window (`RankingPolicy`)."""
        expected = facts.require("expected_attention", "ExpectedAttention")
        check_slot_tensors(facts, positions, valid)
        fixed = self.sinks + self.recent
        check_budget_fits(self, budget, fixed, f"{self.sinks} sinks and {self.recent} recent slots")
        always = oldest_valid(positions, valid, self.sinks) | newest_valid(positions, valid, self.recent)
        return expected.masked_fill(always, float("inf"))


# The streaming setting measured best on SmolLM2 (`eval/RESULTS.md`, running statistics): a 128-slot window.
RUNNING_RECENT = 128


def running_expected_attention(sinks: int = 4, recent: int = RUNNING_RECENT, horizon: int = 512) -> ExpectedAttention:
    """Expected Attention forecasting from every query seen so far (``QueryForecast(running=True)``) with a
    wider recent window: the registry's ``expected_attention_running``, for streams and long decodes."""
    return ExpectedAttention(sinks, recent, QueryForecast(horizon=horizon, running=True))
