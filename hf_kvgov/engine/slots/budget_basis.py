"""What a fractional budget is a fraction of: a declared length, or generate's prompt.

    budget=0.2, budget_of=2048   20% of 2,048 tokens = 409 slots, fixed on construction (streams, chunked text)
    budget=0.2                   20% of the prompt, under ``generate`` only; refused anywhere else

Not "a fraction of the first forward", because a text fed in 32-token chunks would keep 20% of 32 tokens for the
whole text. ``generate`` marks a cache passed to it (``cache._is_user_defined = True``, in
``GenerationMixin._prepare_cache_for_generation``) before its prefill, recorded by `BudgetBasis.mark_generate`.
Refused, with the fix named: a first forward with no mark (a direct ``model(...)`` call may be streaming chunks), a
second multi-token forward in one ``generate`` (``prefill_chunk_size``: the budget was resolved against the first
chunk). So, should transformers stop marking caches, this fails loudly, never against the wrong length.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hf_kvgov.policies.budget import BudgetSpec


def fraction_label(budget: BudgetSpec, layer_budgets: Mapping[int, BudgetSpec]) -> str:
    """How the caller gave the fractional budget, for messages: ``"budget=0.2"`` or ``"layer_budgets[0]=1.0"``."""
    if isinstance(budget, float):
        return f"budget={budget!r}"
    layer = next((layer for layer, spec in layer_budgets.items() if isinstance(spec, float)), None)
    return f"budget={budget!r}" if layer is None else f"layer_budgets[{layer}]={layer_budgets[layer]!r}"


def check_budget_of(owner: str, budget_of: object, specs: Iterable[BudgetSpec]) -> int | None:
    """``budget_of`` after checking it: None, or a positive int length that some fractional budget uses."""
    if budget_of is None:
        return None
    if isinstance(budget_of, bool) or not isinstance(budget_of, int) or budget_of < 1:
        raise ValueError(
            f"{owner}: budget_of is the number of tokens a fractional budget is a fraction of (e.g. the whole "
            f"text's length, budget_of=2048); it must be a positive int, got {budget_of!r}."
        )
    if not any(isinstance(spec, float) for spec in specs):
        raise ValueError(
            f"{owner}: budget_of={budget_of} says what a fractional budget is a fraction of, but every budget "
            "is an int number of slots; drop budget_of, or give the budget as a fraction (budget=0.2)."
        )
    return budget_of


class BudgetBasis:
    """The length fractional budgets resolve against, and the checks that it is the right one.

    Args:
        owner: the cache's class name, for messages.
        fraction: the fractional budget as the caller gave it, for messages (``"budget=0.2"``).
        declared: ``budget_of`` (None: the fraction is of generate's prompt).
    """

    def __init__(self, owner: str, fraction: str, declared: int | None) -> None:
        self.owner = owner
        self.fraction = fraction
        self.declared = declared
        self._generate_marked = False  # generate marked the cache; its next forward starts that call
        self._prompt_chunk: int | None = None  # tokens of generate's prompt forward, until a decode step follows

    def mark_generate(self) -> None:
        self._generate_marked = True

    def length(self, q_len: int) -> int:
        """The basis for a fresh cache's first forward of ``q_len`` tokens; raises where it is unknown."""
        if self.declared is not None:
            return self.declared
        if not self._generate_marked:
            raise ValueError(
                f"{self.owner}: {self.fraction} is a fraction, but of what? This first forward ({q_len} "
                "tokens) is not generate's prompt and no length was declared, so the cache cannot tell whether "
                "more chunks follow (a fraction of a 32-token first chunk would be 20% of 32 tokens for the "
                "whole text). Pass budget_of=<tokens> (the length the fraction is of, e.g. the whole text's), "
                "or an int budget in slots."
            )
        self._generate_marked = False
        self._prompt_chunk = q_len
        return q_len

    def check_step(self, q_len: int) -> None:
        """After resolution: refuse generate's chunked prefill, which resolved against its first chunk only."""
        if self._generate_marked:  # a new generate call on a cache that holds tokens: a new turn
            self._generate_marked, self._prompt_chunk = False, None
            return
        if self._prompt_chunk is None:
            return
        if q_len > 1:
            raise ValueError(
                f"{self.owner}: generate fed the prompt in chunks (prefill_chunk_size), so {self.fraction} "
                f"was resolved against its first chunk of {self._prompt_chunk} tokens, not the prompt. Pass "
                "budget_of=<prompt tokens>, an int budget, or generate with prefill_chunk_size=None."
            )
        self._prompt_chunk = None

    def reset(self) -> None:
        self._generate_marked, self._prompt_chunk = False, None
