"""Heavy-hitter eviction in the serving engine: each request keeps a budget of blocks, so more requests fit the pool.

`ServingEngine(policy=HeavyHitter(0.2))` applies H2O at the engine's granularity, the block: every layer and KV head
shares a request's block table, so what is evicted is a whole block, and its memory goes back to the pool at once
(`BlockEviction` gives the rules). `NoEviction`: the engine without a policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hf_kvgov.engine.parts import HeavyHitter
from hf_kvgov.serving.request import Request
from hf_kvgov.storage.layer_groups import LayerGroup, full_group

# A streamed prompt is computed this many blocks past the budget before the weakest blocks go, so a request never
# holds more than its budget and these, and its prefill runs in chunks of this many blocks at least.
PREFILL_SLACK_BLOCKS = 4


def stored_blocks(prompt: int, new_tokens: int, block_size: int) -> int:
    """Blocks of every token a request stores: its prompt and what it generates but the last token sampled, which is
    never fed back."""
    return -(-(prompt + new_tokens - 1) // block_size)


class NoEviction:
    """Every computed token stays in its request's table."""

    observes = False  # whether steps must score blocks

    def check(self, groups: Sequence[LayerGroup], windows: Sequence[int | None]) -> None:
        """Refuse a pool of layer `groups` (layer l sliding over `windows[l]`) the policy cannot evict from."""

    def chunk_limit(self, request: Request, block_size: int, stored: int | None = None) -> int | None:
        """Tokens of its prompt the request may compute in its next step (None: no limit of the policy's)."""
        return None

    def blocks_needed(self, request: Request, block_size: int) -> int:
        """The most blocks the request holds at once: all it stores (`stored_blocks`)."""
        return stored_blocks(len(request.prompt), request.params.max_new_tokens, block_size)

    def evict(self, request: Request, masses: Tensor | None, block_size: int) -> list[int]:
        """Columns of the request's table to drop after a step: none."""
        return []


class BlockEviction(NoEviction):
    """H2O over whole blocks.

    On a hybrid model the full-attention layers' tables are evicted from; sliding layers keep their window and are
    not scored. A request keeps at most ``budget`` of its prompt in blocks: the most recent share (``recent``)
    always, the rest the blocks whose tokens collected the most attention so far (`kernels.block_mass`: summed
    over queries, heads and layers, as H2O accumulates it). Without a prefix tree the prompt streams (every
    `PREFILL_SLACK_BLOCKS` blocks past the budget the weakest go); with one it is held whole, so the tree gets it
    whole, unless it is scored (its log-probabilities are the policy's). Once the prompt is computed (its first
    token sampled), and each time decoding fills a block, the request is cut back to its budget. Keys keep the
    positions they were rotated at, so later tokens are written after the kept blocks and attend to exactly them.
    A prefix hit's blocks are scored by the queries after them; a request that evicts gives up its prefix-tree
    locks (the tree keeps those blocks as a cache, reclaimed when the pool needs room).
    """

    observes = True

    def __init__(self, policy: HeavyHitter, slack: int | None = PREFILL_SLACK_BLOCKS) -> None:
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
        self.slack = slack

    def check(self, groups: Sequence[LayerGroup], windows: Sequence[int | None]) -> None:
        if full_group(groups) is None:
            raise ValueError(
                "HeavyHitter in the serving engine evicts from full-attention layers, and every layer of this model "
                "slides over a window (which already bounds what it keeps); serve it without a policy."
            )
        mixed = [i for group in groups if group.window is None for i in group.layers if windows[i] is not None]
        if mixed:
            raise ValueError(
                f"HeavyHitter in the serving engine cannot evict here: sliding-window layers {mixed} share tables "
                "with full-attention layers (the codec's per-layer formats keep one layer group), and a window "
                "counts positions that eviction leaves fewer blocks to span. Give the sliding layers the full "
                "layers' format, or serve without a policy."
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

    def slack_of(self, request: Request) -> int | None:
        """Blocks the request's prompt runs past its budget before the weakest go; None while it is held whole for
        the tree. A scored prompt (`SamplingParams.prompt_logprobs`) always streams: its log-probabilities are the
        policy's, with the cache in the loop."""
        return PREFILL_SLACK_BLOCKS if request.params.prompt_logprobs else self.slack

    def chunk_limit(self, request: Request, block_size: int, stored: int | None = None) -> int | None:
        """In prefill, up to the slack's blocks past the budget: the chunk ends where the weakest blocks go, so
        where a request evicts does not depend on how the scheduler cut its prompt (a prefix hit longer than
        that computes the slack's blocks first). No limit when the prompt is held whole (no slack)."""
        slack = self.slack_of(request)
        if slack is None or request.computed >= len(request.prompt):
            return None
        stored = request.stored if stored is None else stored
        cap = (self.budget_blocks(len(request.prompt), block_size) + slack) * block_size
        return max(cap - stored, slack * block_size)

    def blocks_needed(self, request: Request, block_size: int) -> int:
        """The budget and the prefill's slack, or the whole prompt and one block of growth when it is held whole
        (or the whole request, when that is less)."""
        slack, prompt = self.slack_of(request), len(request.prompt)
        if slack is None:
            return -(-(prompt + min(request.params.max_new_tokens, block_size)) // block_size)
        whole = super().blocks_needed(request, block_size)
        return min(whole, self.budget_blocks(prompt, block_size) + slack)

    def evict(self, request: Request, masses: Tensor | None, block_size: int) -> list[int]:
        """Add the step's `masses` to the request's block scores, then the columns to drop: past its budget, those
        with the least attention outside its recent blocks (their scores go with them). In prefill only once
        the slack's blocks past the budget are stored (never while a prompt is held whole)."""
        assert request.tables is not None
        allocated = len(request.tables)  # blocks for tokens the next steps write may already be there
        scores = request.block_mass
        if scores is None:
            scores = torch.zeros(allocated, device=masses.device if masses is not None else None)
        elif scores.shape[0] < allocated:
            scores = torch.cat((scores, scores.new_zeros(allocated - scores.shape[0])))
        if masses is not None:
            scores[: masses.shape[0]] += masses.to(scores.device)
        request.block_mass = scores
        columns = -(-request.stored // block_size)
        budget = self.budget_blocks(len(request.prompt), block_size)
        excess = columns - budget
        slack = self.slack_of(request)
        if request.computed < len(request.prompt) and (slack is None or excess < slack):
            return []
        if excess <= 0:
            return []
        candidates = columns - self.recent_blocks(budget, block_size)
        dropped = sorted(scores[:candidates].topk(excess, largest=False).indices.tolist())
        keep = torch.ones(allocated, dtype=torch.bool, device=scores.device)
        keep[dropped] = False
        request.block_mass = scores[keep]
        return dropped


def eviction_for(policy: HeavyHitter | None, streaming: bool = True) -> NoEviction:
    """The engine's eviction for a `policy` argument; ``streaming`` False holds each prompt whole until computed."""
    if policy is None:
        return NoEviction()
    return BlockEviction(policy, PREFILL_SLACK_BLOCKS if streaming else None)
