"""`ServingEngine`: continuous batching over one governed block pool.

Requests arrive at any time (`add_request`), each step runs every request the scheduler lets in as its own
sequence (own block table and positions, no padding), and a request leaves the step it finishes, its blocks back to
the pool at once. `generate` runs a list of prompts to the end; `hf_kvgov.serving.loop.EngineLoop` runs the steps in
a background thread and streams each request's tokens. On a hybrid model (Gemma-3: sliding layers beside full ones)
each layer group has its own tables (`hf_kvgov.storage.layer_groups`), so a sliding layer holds only its window.

    engine = ServingEngine(model, max_bytes=2 << 30)
    outputs = engine.generate([prompt_ids_a, prompt_ids_b], SamplingParams(max_new_tokens=64))
    engine.close()  # the model's attention implementation is restored
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.engine.parts import HeavyHitter, measured_codec
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.hf.attention import RAGGED_ATTENTION_NAME, RAGGED_STEP_KEY, register
from hf_kvgov.hf.compat import (
    attention_implementation,
    cached_layer_count,
    decoder_config,
    kv_heads_and_head_dim,
    kv_sources,
    layer_kinds,
    model_dtype_and_device,
)
from hf_kvgov.prefix.remote_tier import RemoteTier
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.serving.blocks import FullPrecisionBlocks, SealedBlockCodec
from hf_kvgov.serving.eviction import eviction_for
from hf_kvgov.serving.request import Request, RequestState, SamplingParams, TokenEvent
from hf_kvgov.serving.runner import ModelRunner
from hf_kvgov.serving.scheduler import Scheduler
from hf_kvgov.serving.swap import SwapSpace
from hf_kvgov.stats_repr import rounded_repr
from hf_kvgov.storage.geometry import KVGeometry
from hf_kvgov.storage.layer_groups import layer_groups
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE
from hf_kvgov.tiers.spill_config import Disk


@dataclass(frozen=True)
class EngineStats:
    """Where the engine stands, and its counters since it started."""

    __repr__ = rounded_repr

    steps: int
    running: int
    waiting: int
    max_running: int  # the most requests that ran in one step
    finished: int
    cancelled: int
    preemptions: int
    recomputed_tokens: int
    prompt_tokens: int
    prefix_hit_tokens: int
    generated_tokens: int
    kv_bytes_used: int  # bytes of the pool's blocks and codes in use now (prefix-tree blocks included)
    kv_bytes_peak: int  # the most in use at a step's start
    kv_bytes_held: int  # bytes of the pool's tensors, free blocks included
    kv_bytes_cap: int | None
    swapped_blocks: int = 0  # blocks preemptions wrote to the disk tier (spill=)
    swap_fallbacks: int = 0  # preemptions computed again instead: the disk refused, or a block came back damaged
    evicted_blocks: int = 0  # blocks the eviction policy (policy=) dropped from running requests

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def check_servable(model_or_config: Any) -> tuple[int, int]:
    """(KV heads, head_dim) of a model the engine can serve; a `ValueError` naming why not (its layers' kinds, its K/V
    layout). Its config answers as the model would (`kvgov serve` asks before it loads the weights); whether its
    layers attend through the engine's step is checked on the model (`ModelRunner.check_layers_reach_the_step`)."""
    config = decoder_config(model_or_config)
    layer_kinds(config)
    return kv_heads_and_head_dim(config)


class ServingEngine:
    """Serve many requests at once from one block pool under one byte cap.

    Args:
        model: a transformers causal LM with an attention-only decoder (its attention implementation is switched to
            hf_kvgov's ragged one until `close`).
        max_bytes: the KV cap: bytes of blocks the pool may hold (None: unbounded, the pool grows).
        block_size: tokens per block.
        prefix_sharing: keep finished prompts' full blocks in a prefix tree that later requests match.
        max_batched_tokens: tokens one step computes at most (longer prompts are prefilled in chunks).
        max_running: requests running at once at most.
        reserve_blocks: blocks kept free per running request when admitting another (room for decode growth).
        codec: seal each request's full blocks into codes past its residual window: a codec name ("int8", "int4",
            "int2", "fp8", ...) with the settings `QuantizedCache(model, bits=...)` takes (KIVI's residual window
            and value groups for int2), or a `QuantConfig`; None keeps every block in full precision. Codes and
            full-precision blocks share the pool and its cap.
        remote: a tier shared with other processes (`hf_kvgov.tiers.redis_tier.RedisTier`): published prefixes are
            written there and a request's miss is looked up there, so engines on several hosts compute a shared
            document once. Needs `prefix_sharing`; the engine closes it.
        spill: `Disk(path)`: a preempted request's blocks are swapped to a disk tier there and read back when it
            re-enters, instead of being computed again (`hf_kvgov.serving.swap`; ``path`` and ``max_write_bytes``
            apply). None: preemption recomputes.
        policy: `HeavyHitter(budget, recent)`: each request keeps ``budget`` of its prompt in blocks, the recent
            ones and those that collected the most attention (H2O over whole blocks, `hf_kvgov.serving.eviction`),
            so more requests fit the cap; lossy. Its prompt streams without prefix sharing, and is held whole until
            computed with it (a scored prompt streams: `score` gives the policy's log-probabilities). None keeps
            every token. On a hybrid model it evicts from the full-attention layers; sliding ones keep their window.
        preallocate: reserve the whole `max_bytes` when the engine starts, as serving engines do: the pool never
            grows afterwards (no resize while requests run), and a cap the device cannot hold fails here. Needs
            `max_bytes`, and full-precision blocks (a codec's pool shares its cap between blocks and codes).
    """

    def __init__(
        self,
        model: Any,
        max_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_sharing: bool = True,
        max_batched_tokens: int = 512,
        max_running: int = 256,
        reserve_blocks: int = 1,
        codec: str | QuantConfig | None = None,
        remote: RemoteTier | None = None,
        spill: Disk | None = None,
        policy: HeavyHitter | None = None,
        preallocate: bool = False,
    ) -> None:
        if preallocate and max_bytes is None:
            raise ValueError(
                "preallocate=True needs a cap to reserve: give max_bytes (or leave preallocate=False: the pool grows "
                "as needed)."
            )
        config = decoder_config(model)
        eviction = eviction_for(policy, streaming=not prefix_sharing)  # a tree gets each prompt whole
        if spill is not None and not isinstance(spill, Disk):
            raise TypeError(f"spill must be a Disk(path=...) or None; got a {type(spill).__name__}.")
        if remote is not None and not prefix_sharing:
            raise ValueError("remote= shares prefixes through a tier, so it needs prefix_sharing=True.")
        num_kv_heads, head_dim = check_servable(model)
        num_layers = cached_layer_count(config)  # layers sharing an earlier layer's K/V attend over its blocks
        windows = [kind.sliding_window for kind in layer_kinds(config)][:num_layers]
        self.model = model
        self._previous_attention = attention_implementation(model.config)
        if self._previous_attention == RAGGED_ATTENTION_NAME:
            raise RuntimeError(
                "This model is already served by an open ServingEngine (its attention is kvgov_ragged); close that "
                "engine first, or serve more requests through it."
            )
        placement = model_dtype_and_device(model)
        if placement is None:
            raise TypeError(f"ServingEngine needs a transformers model; got {type(model).__name__}.")
        dtype, self.device = placement
        geometry = KVGeometry(num_layers, num_kv_heads, head_dim, dtype, self.device)
        quant = measured_codec(codec, head_dim)
        self.blocks = FullPrecisionBlocks() if quant is None else SealedBlockCodec(quant)
        # A sliding layer frees what left its window; a policy evicts from full-attention layers only.
        self.pool = self.blocks.new_pool(geometry, block_size, max_bytes, layer_groups(windows), preallocate)
        eviction.check(self.pool.groups, windows)
        self.prefix = PrefixCache(self.pool, remote=remote) if prefix_sharing else None
        self.swap = None if spill is None else SwapSpace(self.pool, spill)
        self.scheduler = Scheduler(
            self.pool,
            self.prefix,
            max_batched_tokens,
            max_running,
            reserve_blocks,
            blocks=self.blocks,
            swap=self.swap,
            eviction=eviction,
        )
        register()
        model.set_attn_implementation(RAGGED_ATTENTION_NAME)
        self.runner = ModelRunner(
            model,
            self.pool,
            RAGGED_STEP_KEY,
            self.device,
            self.blocks.step_class,
            eviction.observes,
            kv_sources(config),
        )
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        self.eos_token_ids: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._steps = 0
        self._max_running = 0
        self._finished = 0
        self._cancelled = 0
        self._generated = 0
        self._peak_bytes = 0
        self._closed = False
        try:
            self.runner.check_layers_reach_the_step()
        except BaseException:
            self.close()  # the model gets its attention back
            raise

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, namespace: str = "") -> int:
        """Queue a request; returns its id. Refuses at once what could never run (empty, or larger than the pool)."""
        return self._queue(self._checked_request(prompt, params, namespace))

    def _queue(self, request: Request) -> int:
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def _checked_requests(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[Request]:
        """A request for each prompt, every one checked before any is queued (one refused queues none)."""
        if self.requests:  # their events would be consumed here, their tokens lost to whoever added them
            raise RuntimeError(
                f"generate() and score() serve their own prompts to the end, and {len(self.requests)} request(s) added "
                "with add_request are still live (their tokens would be computed and dropped): step them to the end "
                "first (run_until_done()), or add these prompts with add_request too."
            )
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Give one SamplingParams or one per prompt; got {len(params)} for {len(prompts)}.")
        return [self._checked_request(prompt, p, "") for prompt, p in zip(prompts, params, strict=True)]

    def _checked_request(self, prompt: Sequence[int], params: SamplingParams | None, namespace: str) -> Request:
        """A request, refused if it could never run."""
        self._check_open()
        params = params or SamplingParams()
        ids = self._token_ids(prompt)
        if self.max_positions is not None and len(ids) + params.max_new_tokens > self.max_positions:
            raise ValueError(
                f"{len(ids)} prompt tokens + max_new_tokens={params.max_new_tokens} exceed the model's "
                f"{self.max_positions} positions."
            )
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            # Without a seed of its own, one drawn from torch's global generator: `torch.manual_seed` before adding
            # requests makes them reproducible (transformers' server seeds it so for a request's `seed`).
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,)).item())
            generator.manual_seed(seed)
        stop = self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        request = Request(next(self._ids), ids, params, namespace, stop_ids=tuple(stop), generator=generator)
        self.scheduler.check_fits(request)
        return request

    def _token_ids(self, prompt: Sequence[int]) -> list[int]:
        """`prompt` as a list of ints, each an id of the model's vocabulary: a bad id is refused here, not by the
        embedding in the middle of a step every running request shares."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        ids = list(prompt)
        if not ids:
            raise ValueError("A request needs at least one prompt token; got an empty prompt.")
        for position, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"Prompt token {token!r} at position {position} is not an id of the model's vocabulary (ints "
                    f"from 0 to {self.vocab_size - 1})."
                )
        return [int(token) for token in ids]

    def cancel(self, request_id: int) -> TokenEvent | None:
        """Stop a request now: its blocks go back to the pool at once. None when it had already ended."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, RequestState.CANCELLED)
        self._cancelled += 1
        return TokenEvent(request_id, None, "cancelled")

    def request(self, request_id: int) -> Request | None:
        """The live request with this id (None once it ended)."""
        return self.requests.get(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ steps

    def step(self) -> list[TokenEvent]:
        """Run one step; returns the tokens it produced (a finished request's last one carries why it ended)."""
        self._check_open()
        scheduled = self.scheduler.schedule()
        if not len(scheduled):
            return []
        self._max_running = max(self._max_running, len(self.scheduler.running))
        self._peak_bytes = max(self._peak_bytes, self.blocks.bytes_used(self.pool))
        sampled, masses = self.runner.run(scheduled)
        self._steps += 1
        now = time.perf_counter()
        events = []
        for request, count, token, mass in zip(scheduled.requests, scheduled.counts, sampled, masses, strict=True):
            self.scheduler.advance(request, count, mass)
            if token is None:
                continue
            request.output.append(token)
            request.token_times.append(now)
            if request.first_token_at is None:
                request.first_token_at = now
            self._generated += 1
            reason = request.stop_reason()
            if reason is None and self.max_positions is not None and request.num_tokens >= self.max_positions:
                reason = "length"
            if reason is not None:
                self.scheduler.finish(request, RequestState.FINISHED)
                self.requests.pop(request.request_id, None)
                self._finished += 1
            events.append(TokenEvent(request.request_id, token, reason))
        return events

    def run_until_done(self) -> Iterator[TokenEvent]:
        """Step until no request is left, yielding every token as it comes."""
        while self.has_work:
            yield from self.step()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Serve `prompts` together to the end; returns each one's generated tokens, in the order given. A prompt that
        could never run is refused before any is queued."""
        ids = [self._queue(request) for request in self._checked_requests(prompts, params)]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        for event in self.run_until_done():
            if event.token is not None and event.request_id in outputs:
                outputs[event.request_id].append(event.token)
        return [outputs[i] for i in ids]

    def score(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """Serve `prompts` together, scoring each: per prompt, the log-probability of every token after the first
        given the ones before it as the engine holds them (an eviction policy's cache in the loop: its perplexity
        is ``exp(-mean)``). Nothing is generated past the prompt; no prefix is matched."""
        params = SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=True)
        requests = self._checked_requests(prompts, params)
        for request in requests:
            self._queue(request)
        for _ in self.run_until_done():
            pass
        return [list(request.prompt_logprobs) for request in requests]

    # ------------------------------------------------------------------ state

    def stats(self) -> EngineStats:
        counters = self.scheduler.counters
        return EngineStats(
            steps=self._steps,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            max_running=self._max_running,
            finished=self._finished,
            cancelled=self._cancelled,
            preemptions=counters.preemptions,
            recomputed_tokens=counters.recomputed_tokens,
            prompt_tokens=counters.prompt_tokens,
            prefix_hit_tokens=counters.prefix_hit_tokens,
            generated_tokens=self._generated,
            kv_bytes_used=self.blocks.bytes_used(self.pool),
            kv_bytes_peak=self._peak_bytes,
            kv_bytes_held=self.pool.bytes_held(),
            kv_bytes_cap=self.pool.cap_bytes,
            swapped_blocks=0 if self.swap is None else self.swap.counters.blocks_out,
            swap_fallbacks=0 if self.swap is None else self.swap.counters.fallbacks,
            evicted_blocks=counters.evicted_blocks,
        )

    def close(self) -> None:
        """Cancel what is left, free the prefix tree's blocks and give the model its attention back."""
        if self._closed:
            return
        for request_id in list(self.requests):
            self.cancel(request_id)
        if self.prefix is not None:
            self.prefix.clear()
            self.prefix.close()  # and the remote tier, which writes what it still holds first
        if self.swap is not None:
            self.swap.close()  # deletes the swap files
        self.model.set_attn_implementation(self._previous_attention)
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This ServingEngine is closed; build a new one.")

    def __enter__(self) -> ServingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
