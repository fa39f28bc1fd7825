"""Heavy-hitter eviction in the serving engine: each request keeps a budget of blocks, so more requests fit the pool.

`ServingEngine(policy=HeavyHitter(0.2))` applies H2O at the engine's granularity, the block: every layer and KV head
shares a request's block table, so what is evicted is a whole block, and its memory goes back to the pool at once.
Once a request's prompt is computed (its first token sampled with the whole prompt in view), it keeps at most
``budget`` of its prompt in blocks: the most recent share (``recent``) always, the rest the blocks whose tokens
collected the most attention so far (`kernels.block_mass`: summed over queries, heads and layers, as H2O accumulates
it). Decoding adds a block every ``block_size`` tokens and evicts the weakest one past the budget. Keys keep the
positions they were rotated at, so a request's later tokens are written after its kept blocks and attend to exactly
them. A prefix hit's blocks are scored by the queries computed after them; a request that evicts gives up its
prefix-tree locks (the tree keeps those blocks as a cache, reclaimed when the pool needs room) and publishes no more.
`NoEviction` is the engine without a policy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hf_kvgov.engine.parts import HeavyHitter
from hf_kvgov.serving.request import Request


class NoEviction:
    """Every computed token stays in its request's table."""

    observes = False  # whether steps must score blocks

    def check(self, sliding_windows: bool) -> None:
        """Nothing to refuse."""

    def blocks_needed(self, prompt: int, new_tokens: int, block_size: int) -> int:
        """The most blocks one request holds at once."""
        return -(-(prompt + new_tokens) // block_size)

    def evict(self, request: Request, masses: Tensor | None, block_size: int) -> list[int]:
        """Columns of the request's table to drop after a step: none."""
        return []

    def describe(self) -> str:
        return "no eviction"


class BlockEviction(NoEviction):
    """H2O over whole blocks (see the module docstring)."""

    observes = True

    def __init__(self, policy: HeavyHitter) -> None:
        if not isinstance(policy, HeavyHitter):
            raise TypeError(
                f"The serving engine evicts by attention mass (H2O): policy must be a HeavyHitter(...) or None; got "
                f"{type(policy).__name__}."
            )
        unsupported = [
            name for name in ("allocation", "heads", "budget_of", "query_chunk") if getattr(policy, name) is not None
        ]
        if unsupported:
            raise ValueError(
                f"HeavyHitter({', '.join(f'{name}=...' for name in unsupported)}) is not served by the engine: its "
                "blocks are shared by every layer and KV head, so one budget per request applies to all of them, a "
                "fraction of its prompt; use HeavyHitter(budget, recent) or the same policy in a HeavyHitterCache."
            )
        self.policy = policy

    def check(self, sliding_windows: bool) -> None:
        if sliding_windows:
            raise ValueError(
                "HeavyHitter in the serving engine needs a model whose layers all attend in full: a sliding window "
                "counts positions, and eviction leaves a request's kept blocks fewer than the positions they span. "
                "Serve this model without a policy, or use HeavyHitterCache with generate."
            )

    def budget_blocks(self, prompt: int, block_size: int) -> int:
        """Blocks a request keeps: its budget of the prompt, at least one heavy and one recent block."""
        budget = self.policy.budget
        tokens = math.ceil(budget * prompt) if isinstance(budget, float) else budget
        return max(2, -(-tokens // block_size))

    def recent_blocks(self, budget: int, block_size: int) -> int:
        """The most recent blocks always kept (the block being written among them)."""
        recent = self.policy.recent
        blocks = math.ceil(recent * budget) if isinstance(recent, float) else -(-recent // block_size)
        return min(budget - 1, max(1, blocks))

    def blocks_needed(self, prompt: int, new_tokens: int, block_size: int) -> int:
        """The whole prompt while it is computed, then its budget: decoding evicts as it grows."""
        whole = -(-(prompt + min(new_tokens, block_size)) // block_size)
        return min(whole, super().blocks_needed(prompt, new_tokens, block_size))

    def evict(self, request: Request, masses: Tensor | None, block_size: int) -> list[int]:
        """Add the step's `masses` to the request's block scores; once its prompt is computed, the columns past its
        budget with the least attention outside its recent blocks (their scores are dropped with them)."""
        assert request.table is not None
        columns = len(request.table)
        scores = request.block_mass
        if scores is None:
            scores = torch.zeros(columns, device=masses.device if masses is not None else None)
        elif scores.shape[0] < columns:
            scores = torch.cat((scores, scores.new_zeros(columns - scores.shape[0])))
        if masses is not None:
            scores[: masses.shape[0]] += masses.to(scores.device)
        request.block_mass = scores
        if request.computed < len(request.prompt):
            return []
        budget = self.budget_blocks(len(request.prompt), block_size)
        excess = columns - budget
        if excess <= 0:
            return []
        candidates = columns - self.recent_blocks(budget, block_size)
        dropped = sorted(scores[:candidates].topk(excess, largest=False).indices.tolist())
        keep = torch.ones(columns, dtype=torch.bool, device=scores.device)
        keep[dropped] = False
        request.block_mass = scores[keep]
        return dropped

    def describe(self) -> str:
        return f"{self.policy.describe()} per request, in whole blocks"


def eviction_for(policy: HeavyHitter | None) -> NoEviction:
    """The engine's eviction for a `policy` argument."""
    return NoEviction() if policy is None else BlockEviction(policy)
