"""Which requests run in the next step, and with how many tokens: admission by blocks, preemption, prefix sharing.

Each step has a token budget: running requests go first, then waiting requests are admitted while their blocks fit,
and a decode step that finds the pool full preempts the newest running request (`Scheduler` gives the rules). The
caller never sees `PoolExhausted`; a request that could not fit in the whole pool is refused when it is added.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from hf_kvgov.errors import PoolExhausted, SpillCorrupted
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.serving.blocks import FullPrecisionBlocks
from hf_kvgov.serving.eviction import NoEviction, stored_blocks
from hf_kvgov.serving.request import Request, RequestState
from hf_kvgov.serving.swap import SwapSpace
from hf_kvgov.storage.block_table import SequenceTables
from hf_kvgov.storage.pool import BlockPool


@dataclass(frozen=True)
class ScheduledStep:
    """The requests of one step in packing order (those computing one token first), and how many tokens each
    computes."""

    requests: tuple[Request, ...]
    counts: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests, hits included
    evicted_blocks: int = 0  # blocks an eviction policy dropped from running requests


class Scheduler:
    """The waiting queue, the running set and their blocks in one pool.

    Each step has a token budget. Running requests go first, oldest first: one token each when decoding, the next
    chunk of their prompt when in prefill (chunked prefill mixed with decode). Then waiting requests are admitted
    in arrival order while the budget lasts: a request enters when the blocks of its prompt, after the longest
    prefix the tree holds, can be allocated and `reserve_blocks` per running request stay free for their decode
    growth (with a codec, the codes those blocks become; the prefix tree's unlocked blocks count as free, the
    pool's reclaimer evicts them on demand, unless an evicting request still reads them); a request whose prefix
    another is still prefilling waits for it, so the prefix is computed once. A decode step that finds the pool
    full preempts the newest running request: its blocks go back, it waits at the head of the queue, and its
    tokens are computed again when it re-enters (what the tree kept of them is matched, not recomputed), or, with
    a swap space (`hf_kvgov.serving.swap`), its blocks are written to disk and read back. With a codec, a request
    whose last step's codes found no room has them sealed before its next step (`_sealed`).

    Args:
        pool: the block pool every request's table draws from (its cap is the engine's KV budget).
        prefix: the prefix tree shared by every request, or None for no sharing.
        max_batched_tokens: tokens one step computes at most (prefill chunks are cut to fit).
        max_running: requests running at once at most.
        reserve_blocks: blocks kept free per running request when admitting another.
        blocks: how blocks are stored (full precision, or sealed by a codec after each step).
        swap: where preempted requests' blocks wait on disk (None: they are computed again).
        eviction: which blocks running requests give up (`hf_kvgov.serving.eviction`; default: none).
    """

    def __init__(
        self,
        pool: BlockPool,
        prefix: PrefixCache | None,
        max_batched_tokens: int,
        max_running: int,
        reserve_blocks: int = 1,
        blocks: FullPrecisionBlocks | None = None,
        swap: SwapSpace | None = None,
        eviction: NoEviction | None = None,
    ) -> None:
        for name, value in (("max_batched_tokens", max_batched_tokens), ("max_running", max_running)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}.")
        if reserve_blocks < 0:
            raise ValueError(f"reserve_blocks must be >= 0; got {reserve_blocks!r}.")
        self.pool = pool
        self.prefix = prefix
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self.reserve_blocks = reserve_blocks
        self.blocks = blocks or FullPrecisionBlocks()
        self.swap = swap
        self.eviction = eviction or NoEviction()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledStep:
        """The next step's requests and token counts; allocates their blocks (preempting when the pool is full)."""
        budget = self.max_batched_tokens
        decoding: list[tuple[Request, int]] = []
        chunks: list[tuple[Request, int]] = []
        preemptions = self.counters.preemptions  # a step that preempts, or holds a request back, admits nothing
        held_back = False
        for request in list(self.running):
            if budget == 0:
                break
            if request.state is not RequestState.RUNNING:  # preempted by an older request of this step
                continue
            count = self._chunk(request, budget)
            if not self._sealed(request):
                held_back = True  # waits a step for room for its codes
                continue
            while not self._grow(request, count):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    break
            if request.state is RequestState.RUNNING:
                (decoding if count == 1 else chunks).append((request, count))
                budget -= count
        admitting = self.counters.preemptions == preemptions and not held_back
        while self.waiting and budget > 0 and admitting and len(self.running) < self.max_running:
            request = self.waiting[0]
            if self._follows_a_prefill(request) or not self._admit(request):
                break  # first come, first served: nothing overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(request)
            count = self._chunk(request, budget)
            (decoding if count == 1 else chunks).append((request, count))
            budget -= count
        ordered = decoding + chunks
        return ScheduledStep(tuple(r for r, _ in ordered), tuple(c for _, c in ordered))

    def _sealed(self, request: Request) -> bool:
        """Seal the blocks whose codes found no room after the request's last step, so its next step reads them as
        codes, as a quantized cache alone does: newer requests are preempted for the room; the newest waits while
        others run (False), and alone goes on reading them in full precision."""
        while not self.blocks.seal_ready(request, self.pool):
            if self.running[-1] is not request:
                self.preempt(self.running[-1])
            else:
                return len(self.running) == 1
        return True

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens the request computes next: what is pending, within the step's budget and where its eviction policy
        needs the prefill to stop."""
        limit = self.eviction.chunk_limit(request, self.pool.block_size)
        return min(request.pending, budget, request.pending if limit is None else limit)

    def _follows_a_prefill(self, request: Request) -> bool:
        """True while a running request is still prefilling full blocks that `request` shares: admitted now, it would
        compute them again; a step or two later the tree serves them (a burst of questions on one document)."""
        if self.prefix is None:
            return False
        size = self.pool.block_size
        tokens = request.tokens
        for leader in self.running:
            if leader.computed >= len(leader.prompt) or leader.namespace != request.namespace:
                continue
            shared = common_prefix(leader.prompt, tokens) // size * size
            if shared > leader.published and shared >= size:
                return True
        return False

    def _grow(self, request: Request, count: int) -> bool:
        """Blocks for the request's next `count` tokens, after its sliding groups gave back what left their window."""
        assert request.tables is not None
        request.tables.slide(request.computed)
        try:
            request.tables.prepare_write(request.computed, request.computed + count, request.evicted_tokens)
        except PoolExhausted:
            return False
        return True

    def _admit(self, request: Request) -> bool:
        """Give `request` a table holding its prefix hit and blocks for the rest of its tokens, if they fit."""
        if request.swapped is not None:
            return self._swap_in(request)
        tokens = request.tokens
        locks: list[int] = []
        hit: list[list[int | None]] = []
        # A scored prompt computes every token; otherwise at least one is left to compute: its logits are sampled.
        if self.prefix is not None and not request.params.prompt_logprobs:
            locks, hit = self.prefix.match_tables(tokens, request.namespace, max_tokens=len(tokens) - 1)
        tables = SequenceTables(self.pool, hit)
        computed = len(tables) * self.pool.block_size
        limit = self.eviction.chunk_limit(request, self.pool.block_size, computed)
        end = len(tokens) if limit is None else min(len(tokens), computed + limit)
        try:  # sliding groups only up to their first full window and a step: then they free blocks as they go
            tables.prepare_write(computed, end, sliding_end=self._sliding_reach(computed))
        except PoolExhausted:
            self._drop(tables, locks)
            return False
        if not self._leaves_a_reserve():
            self._drop(tables, locks)
            return False
        if request.preemptions:
            self.counters.recomputed_tokens += len(tokens) - computed
        else:
            self.counters.prompt_tokens += len(tokens)
            self.counters.prefix_hit_tokens += computed
            request.prefix_hit_tokens = computed
        request.tables, request.locks, request.computed, request.published = tables, locks, computed, computed
        request.prompt_logprobs = []  # a preempted request's prompt is scored again as it is computed again
        request.state = RequestState.RUNNING
        if request.admitted_at is None:
            request.admitted_at = time.perf_counter()
        return True

    def _sliding_reach(self, computed: int) -> int:
        """Where an admitted request's sliding groups are given blocks up to, from position `computed`: a step past
        their first full window, the most they hold at once. With less, a prompt longer than the window would find
        no block for its next chunk, preempt itself and lose its chunk, step after step (each admission holding
        only its first step)."""
        windows = [group.window for group in self.pool.groups if group.window is not None]
        return max(computed, max(windows, default=0)) + self.max_batched_tokens

    def _leaves_a_reserve(self) -> bool:
        """Whether `reserve_blocks` per running request (in each layer group) are still free for their decode
        growth."""
        if not self.running:
            return True
        reserve = self.reserve_blocks * len(self.pool.groups) * len(self.running)
        return self.free_blocks() >= self.blocks.growth_blocks(reserve, self.pool)

    def _swap_in(self, request: Request) -> bool:
        """Read a swapped-out request's blocks back and give it room for its pending tokens, if they fit; it goes on
        where it stopped. A damaged block sends it to be computed again from its tokens."""
        assert self.swap is not None and request.swapped is not None
        try:
            tables = self.swap.swap_in(request.swapped)
        except SpillCorrupted:
            self._release(request)  # and forget the swap
            return self._admit(request)
        if tables is None:
            return False
        end, ahead = request.num_tokens, self._sliding_reach(request.computed)
        try:
            tables.prepare_write(request.computed, end, request.evicted_tokens, sliding_end=ahead)
        except PoolExhausted:
            tables.release()
            return False
        if not self._leaves_a_reserve():
            tables.release()
            return False
        self.swap.returned(request.swapped)
        request.swapped = None
        request.tables, request.state = tables, RequestState.RUNNING
        return True

    def _forget_swap(self, request: Request) -> None:
        if self.swap is not None and request.swapped is not None:
            self.swap.discard(request.swapped)
        request.swapped = None

    def _drop(self, tables: SequenceTables, locks: list[int]) -> None:
        tables.release()
        if self.prefix is not None:
            self.prefix.unlock(locks)

    def free_blocks(self) -> int:
        """Blocks an allocation can still get: the pool's free ones and what evicting the prefix tree's unlocked
        blocks would free (not those a request that gave up its locks still reads)."""
        if self.prefix is None:
            return self.pool.num_free
        evicting = [r for r in self.running if r.tables is not None and r.evicted_tokens and not r.locks]
        unlocked = [block for r in evicting for block in r.tables.live_ids()]  # type: ignore[union-attr]
        return self.pool.num_free + self.blocks.reclaimed_blocks(self.prefix.reclaimable_blocks(unlocked), self.pool)

    def advance(self, request: Request, count: int, masses: Tensor | None = None) -> None:
        """`count` more of the request's tokens have their K/V in the pool; blocks past its residual window are
        sealed (with a codec). In prefill, the full blocks go to the prefix tree after every chunk, so a request
        with the same prefix admitted meanwhile finds them; generated tokens' blocks go when it finishes. Then the
        eviction policy, given the attention the step's `masses` measured, drops blocks past the request's budget."""
        request.computed += count
        self.blocks.seal_ready(request, self.pool)
        if self.prefix is not None and request.published < len(request.prompt) and not request.evicted_tokens:
            self.publish(request)
        dropped = self.eviction.evict(request, masses, self.pool.block_size)
        if dropped:
            self._drop_blocks(request, dropped)

    def _drop_blocks(self, request: Request, columns: list[int]) -> None:
        """Evict the blocks at `columns` of the request's table. Its prefix-tree locks go first: the tree keeps
        what it holds as a cache others may still match, and reclaims it when the pool needs room."""
        assert request.tables is not None
        if self.prefix is not None and request.locks:
            self.prefix.unlock(request.locks)
            request.locks = []
        request.tables.drop(columns)
        request.evicted_tokens += len(columns) * self.pool.block_size
        self.counters.evicted_blocks += len(columns)

    def publish(self, request: Request) -> None:
        """Offer the request's full blocks to the tree (a block it already holds is stored once); not once blocks
        were evicted from its table, which then no longer lists its tokens in order."""
        if self.prefix is None or request.tables is None or request.evicted_tokens:
            return
        size = self.pool.block_size
        full = self.blocks.publishable(request, size) // size * size
        if full <= request.published // size * size:
            return
        tokens = request.tokens[:full]
        offered = request.tables.published(full // size)
        swapped, locks = self.prefix.publish_tables(tokens, offered, request.namespace)
        request.tables.adopt(swapped)
        request.locks.extend(locks)
        request.published = full

    def preempt(self, request: Request) -> None:
        """Take the request's blocks back and queue it first; its blocks wait on disk (with a swap space that takes
        them), else its tokens are computed again when it re-enters."""
        self.running.remove(request)
        swapped = None
        if self.swap is not None and request.tables is not None:
            swapped = self.swap.swap_out(request.tables)
        if swapped is None:
            self._release(request)
        else:
            assert request.tables is not None
            self._drop(request.tables, request.locks)  # its blocks are on disk; the tree keeps what it published
            request.tables, request.locks, request.swapped = None, [], swapped
        request.state = RequestState.WAITING
        request.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, state: RequestState) -> None:
        """The request leaves: its full blocks stay in the prefix tree, the rest go back to the pool at once."""
        if request in self.running:
            self.publish(request)
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.state = state

    def _release(self, request: Request) -> None:
        self._forget_swap(request)
        if request.tables is not None:
            self._drop(request.tables, request.locks)
        request.tables, request.locks, request.computed, request.published = None, [], 0, 0
        request.evicted_tokens = 0
        request.block_mass = None

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could not run even alone in the whole pool (it would wait forever)."""
        cap = self.pool.max_blocks
        if cap is None:
            return
        size = self.pool.block_size
        prompt, new = len(request.prompt), request.params.max_new_tokens
        kept, whole = self.eviction.blocks_needed(request, size), stored_blocks(prompt, new, size)

        def needed(step: int) -> int:
            return sum(kept if g.window is None else self._most_held(g.window, whole, step) for g in self.pool.groups)

        if needed(self.max_batched_tokens) > cap:
            groups = f" over {len(self.pool.groups)} layer groups" if len(self.pool.groups) > 1 else ""
            # A sliding group holds its window and one step's tokens: a smaller step may be what makes it fit.
            fitting = next((step for step in range(self.max_batched_tokens - 1, 0, -1) if needed(step) <= cap), None)
            smaller = "" if fitting is None else f", or give the engine max_batched_tokens={fitting} or less"
            raise ValueError(
                f"Request {request.request_id} needs {needed(self.max_batched_tokens)} blocks{groups} "
                f"({len(request.prompt)} prompt tokens + max_new_tokens={request.params.max_new_tokens}, {size} tokens "
                f"a block, {self.max_batched_tokens} a step) but the pool holds at most {cap}; shorten it or give the "
                f"engine a larger max_bytes{smaller}."
            )

    def _most_held(self, window: int, blocks: int, step: int | None = None) -> int:
        """The most blocks a sliding group's table holds at once, for a request of `blocks` blocks: its window and
        one step's tokens (`step`, by default `max_batched_tokens`)."""
        step = self.max_batched_tokens if step is None else step
        return min(blocks, -(-(window + step - 1) // self.pool.block_size) + 1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
