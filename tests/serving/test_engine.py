"""The serving engine on tiny random models: each request's greedy tokens equal the same request run alone with
`DynamicCache`, whatever the engine does around it (chunked prefill beside decode, prefix hits, preemption under a
small cap, sliding windows), and every block goes back to the pool."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import PoolExhausted, QuantizedCache
from hf_kvgov.serving import SamplingParams, ServingEngine
from hf_kvgov.serving.loop import EngineLoop
from hf_kvgov.storage.quantized_pool import is_sealed
from tests.conftest import tiny_gemma3, tiny_llama, tiny_mistral

NEW = 12


def alone(model, prompt: list[int], new: int = NEW) -> list[int]:  # type: ignore[no-untyped-def]
    """The request run by itself: batch of one, DynamicCache, greedy."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        cache=DynamicCache(config=model.config),
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def prompts_with_shared_prefix(vocab: int, lengths: tuple[int, ...], shared: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, vocab, (shared,), generator=generator).tolist()
    return [doc + torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def greedy(new: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    return tiny_llama()


@pytest.fixture(scope="module")
def mixed_prompts(llama):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, llama.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 33, 2, 40)]


@pytest.fixture(scope="module")
def mixed_reference(llama, mixed_prompts):  # type: ignore[no-untyped-def]
    return [alone(llama, p) for p in mixed_prompts]


@pytest.mark.parametrize("max_batched_tokens", [512, 20, 3])
def test_requests_of_unequal_lengths_equal_each_run_alone(
    llama, mixed_prompts, mixed_reference, max_batched_tokens: int
) -> None:
    """512: all prefills in one step; 20 and 3: prompts cut into chunks that share steps with other rows' decode."""
    with ServingEngine(llama, max_batched_tokens=max_batched_tokens) as engine:
        assert engine.generate(mixed_prompts, greedy()) == mixed_reference
        stats = engine.stats()
    assert stats.finished == len(mixed_prompts) and stats.generated_tokens == NEW * len(mixed_prompts)
    # No cap: the token budget alone bounds how many run at once (a request enters with at least one token).
    assert stats.max_running == min(len(mixed_prompts), max_batched_tokens)


def test_logits_match_dynamic_cache(llama, mixed_prompts) -> None:
    """The last step's logits of a packed row equal the model's over the whole sequence, within float tolerance."""
    prompt = mixed_prompts[2]
    with ServingEngine(llama, block_size=4) as engine:
        tokens = engine.generate([prompt, mixed_prompts[4]], greedy(3))[0]
        captured = {}
        forward = llama.forward

        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = forward(*args, **kwargs)
            captured["logits"] = out.logits[0, 0].clone()
            return out

        llama.forward = spy
        try:
            engine.generate([prompt + tokens], greedy(1))  # the prefix tree serves all but the last token
        finally:
            del llama.forward
        assert engine.stats().prefix_hit_tokens > 0
    with torch.no_grad():
        expected = llama(torch.tensor([prompt + tokens])).logits[0, -1]
    torch.testing.assert_close(captured["logits"], expected, rtol=1e-4, atol=1e-4)


def test_prefix_hits_and_preemption_under_a_small_cap(llama) -> None:
    prompts = prompts_with_shared_prefix(llama.config.vocab_size, (5, 17, 3, 2, 9, 11, 4, 8), shared=37)
    reference = [alone(llama, p, 20) for p in prompts]
    per_block = ServingEngine(llama, block_size=4)
    bytes_per_block = per_block.pool.bytes_per_block
    per_block.close()
    for blocks in (20, 40):
        with ServingEngine(llama, block_size=4, max_bytes=blocks * bytes_per_block, max_batched_tokens=32) as engine:
            assert engine.generate(prompts, greedy(20)) == reference
            stats = engine.stats()
            assert stats.preemptions > 0 and stats.recomputed_tokens > 0  # the cap forced it
            assert stats.prefix_hit_tokens > 0
            assert stats.kv_bytes_peak <= blocks * bytes_per_block
            assert engine.pool.num_used == len(engine.prefix.tree)  # only the tree's blocks are left
            engine.prefix.check_invariants()
        assert engine.pool.num_used == 0  # closing clears the tree


def test_a_burst_on_one_document_computes_it_once(llama) -> None:
    """Requests arriving together on one document wait while the first prefills it (16 tokens a step), then hit
    every full block of it; without the wait they would be admitted beside it and compute it again."""
    prompts = prompts_with_shared_prefix(llama.config.vocab_size, (3, 5, 2, 6), shared=37)
    reference = [alone(llama, p) for p in prompts]
    with ServingEngine(llama, block_size=4, max_batched_tokens=16) as engine:
        ids = [engine.add_request(p, greedy()) for p in prompts]
        requests = [engine.request(i) for i in ids]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        for event in engine.run_until_done():
            outputs[event.request_id].append(event.token)  # type: ignore[arg-type]
    assert [outputs[i] for i in ids] == reference
    assert [r.prefix_hit_tokens for r in requests] == [0, 36, 36, 36]  # type: ignore[union-attr]


def test_without_prefix_sharing_every_block_returns(llama, mixed_prompts, mixed_reference) -> None:
    with ServingEngine(llama, prefix_sharing=False, block_size=4) as engine:
        assert engine.generate(mixed_prompts, greedy()) == mixed_reference
        assert engine.pool.num_used == 0
        assert engine.stats().prefix_hit_tokens == 0


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mistral], ids=["gemma3", "mistral"])
def test_sliding_window_models_with_prefix_hits(build) -> None:  # type: ignore[no-untyped-def]
    """Hits of unequal length on sliding-window layers (window 8): no padding enters any row's window."""
    model = build()
    prompts = prompts_with_shared_prefix(model.config.vocab_size, (3, 14, 1, 9), shared=21)
    reference = [alone(model, p) for p in prompts]
    with ServingEngine(model, block_size=4, max_batched_tokens=16) as engine:
        first = engine.generate(prompts[:1], greedy())  # publishes the shared prefix
        rest = engine.generate(prompts[1:], greedy())
        assert engine.stats().prefix_hit_tokens >= 3 * 20
    assert first + rest == reference


def test_cancel_returns_blocks_at_once(llama, mixed_prompts) -> None:
    with ServingEngine(llama, prefix_sharing=False, block_size=4) as engine:
        ids = [engine.add_request(p, greedy(50)) for p in mixed_prompts]
        engine.step()
        engine.step()
        held = engine.pool.num_used
        assert held > 0
        event = engine.cancel(ids[1])
        assert event is not None and event.finish_reason == "cancelled"
        assert engine.pool.num_used == held - -(-(len(mixed_prompts[1]) + 1) // 4)
        assert engine.cancel(ids[1]) is None  # already gone
        for request_id in ids:
            engine.cancel(request_id)
        assert engine.pool.num_used == 0 and not engine.has_work
        assert engine.stats().cancelled == len(ids)


def test_stop_tokens_and_lengths(llama, mixed_prompts, mixed_reference) -> None:
    stop = mixed_reference[0][4]
    first = mixed_reference[0].index(stop)
    with ServingEngine(llama) as engine:
        request_id = engine.add_request(mixed_prompts[0], SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)))
        events = list(engine.run_until_done())
    assert [e.token for e in events] == mixed_reference[0][: first + 1]
    assert events[-1].finish_reason == "stop" and events[-1].request_id == request_id
    with ServingEngine(llama) as engine:
        events = [e for e in engine.run_until_done()] if engine.add_request(mixed_prompts[0], greedy(3)) == 0 else []
    assert [e.finish_reason for e in events] == [None, None, "length"]


def test_sampling_is_per_request_and_seeded(llama, mixed_prompts) -> None:
    """A seeded request draws the same tokens alone or beside others; temperature and top_p change what it draws."""
    params = SamplingParams(max_new_tokens=10, temperature=1.5, top_p=0.9, seed=7, ignore_eos=True)
    with ServingEngine(llama) as engine:
        alone_tokens = engine.generate([mixed_prompts[1]], params)[0]
        together = engine.generate(mixed_prompts, [greedy(), params, greedy(), greedy(), greedy()])[1]
        greedy_tokens = engine.generate([mixed_prompts[1]], greedy(10))[0]
    assert together == alone_tokens
    assert alone_tokens != greedy_tokens


def test_a_request_without_a_seed_follows_torch_manual_seed_and_leaves_it_alone(llama, mixed_prompts) -> None:  # type: ignore[no-untyped-def]
    """Its seed is drawn from torch's global generator (not a fresh random seed, which would also reseed that
    generator): `torch.manual_seed` before adding it reproduces its tokens, and the global stream stays seeded."""
    params = SamplingParams(max_new_tokens=10, temperature=1.5, ignore_eos=True)
    runs = []
    with ServingEngine(llama) as engine:
        for _ in range(2):
            torch.manual_seed(1234)
            tokens = engine.generate([mixed_prompts[1]], params)[0]
            runs.append((tokens, torch.rand(3)))  # what the caller draws next from the global generator
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


def test_bad_requests_are_refused_when_added(llama) -> None:
    with ServingEngine(llama, block_size=4, max_bytes=None) as engine:
        with pytest.raises(ValueError, match="empty prompt"):
            engine.add_request([])
        vocab = llama.config.vocab_size
        for bad, shown in ((vocab, str(vocab)), (-1, "-1"), (3.7, "3.7"), ("a", "'a'")):
            with pytest.raises(ValueError, match=f"Prompt token {shown} at position 1 is not an id of the model's"):
                engine.add_request([5, bad], greedy(2))  # type: ignore[list-item]
        assert not engine.requests and not engine.has_work  # nothing was queued: the steps never see a bad id
        with pytest.raises(ValueError, match="model's 512 positions"):
            engine.add_request([5] * 500, greedy(20))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="min_new_tokens must be an int from 0 to max_new_tokens=8; got 9"):
        SamplingParams(max_new_tokens=8, min_new_tokens=9)
    with pytest.raises(ValueError, match=r"repetition_penalty must be > 0 \(1.0 is none\); got 0.0"):
        SamplingParams(repetition_penalty=0.0)
    one_block = ServingEngine(llama, block_size=4)
    size = one_block.pool.bytes_per_block
    one_block.close()
    prompt = [5 + i % 50 for i in range(30)]
    expected = alone(llama, prompt, 11)
    with ServingEngine(llama, block_size=4, max_bytes=10 * size) as engine:
        with pytest.raises(ValueError, match=r"needs 11 blocks .* holds at most 10"):
            engine.add_request([5] * 30, greedy(13))
        assert not engine.has_work
        # 30 + 11 tokens fill 10 blocks: the last one sampled is never stored, so it fits exactly.
        assert engine.generate([prompt], greedy(11)) == [expected]
        assert engine.stats().kv_bytes_peak == 10 * size
        # One prompt refused refuses the batch before any is queued (the others used to be left in the queue, and the
        # next call computed them and dropped their tokens).
        for serve in (lambda prompts: engine.generate(prompts, greedy(11)), engine.score):
            with pytest.raises(ValueError, match=r"needs 1\d blocks .* holds at most 10"):
                serve([prompt, prompt[:5], [5] * 44])
            assert not engine.requests and not engine.has_work
        assert engine.generate([prompt], greedy(11)) == [expected]
        assert engine.stats().finished == 2
        # Requests added one by one are the caller's to step: a batch call would consume their tokens.
        added = engine.add_request(prompt[:5], greedy(3))
        for serve in (lambda prompts: engine.generate(prompts, greedy(11)), engine.score):
            with pytest.raises(RuntimeError, match=r"1 request\(s\) added with add_request are still live"):
                serve([prompt])
        assert list(engine.requests) == [added]
        assert [event.token is not None for event in engine.run_until_done()] == [True] * 3
    with pytest.raises(ValueError, match="max_batched_tokens must be an int >= 1"):
        ServingEngine(llama, max_batched_tokens=0)


def test_closed_engine_restores_attention(llama) -> None:
    before = llama.config._attn_implementation
    engine = ServingEngine(llama)
    assert llama.config._attn_implementation == "kvgov_ragged"
    with pytest.raises(RuntimeError, match="already served by an open ServingEngine"):
        ServingEngine(llama)  # a second engine would restore the first one's attention when it closes
    engine.close()
    assert llama.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request([5, 6])


def test_background_loop_streams_and_cancels(llama, mixed_prompts, mixed_reference) -> None:
    with ServingEngine(llama, block_size=4, prefix_sharing=False) as engine, EngineLoop(engine) as loop:
        streams = [loop.submit(p, greedy()) for p in mixed_prompts]
        endless = loop.submit(mixed_prompts[0], SamplingParams(max_new_tokens=400, ignore_eos=True))
        assert [s.result() for s in streams] == mixed_reference
        assert all(s.finish_reason == "length" for s in streams)
        seen = [token for token, _ in zip(endless, range(3), strict=False)]
        assert len(seen) == 3
        endless.cancel()
        endless.result()
        assert endless.finish_reason == "cancelled"
        assert engine.pool.num_used == 0
        assert engine.request(endless.request_id) is None


def alone_quantized(model, prompt: list[int], bits: int, new: int = 20) -> list[int]:  # type: ignore[no-untyped-def]
    cache = QuantizedCache(model, bits=bits, block_size=4)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, cache=cache, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
@pytest.mark.parametrize("max_batched_tokens", [512, 16])
def test_sealed_codes_answer_as_a_quantized_cache_alone(llama, codec: str, max_batched_tokens: int) -> None:
    """Each request's blocks are sealed once its prompt is computed (chunks attend to it in full precision), so its
    tokens are those of `QuantizedCache` running it alone, chunked prefill or not. A codec name takes the settings
    `QuantizedCache(model, bits=...)` takes (int2 used to seal with no residual window and no value groups)."""
    prompts = prompts_with_shared_prefix(llama.config.vocab_size, (5, 17, 3, 2, 9, 11), shared=37)
    bits = {"int8": 8, "int4": 4, "int2": 2}[codec]
    reference = [alone_quantized(llama, p, bits) for p in prompts]
    with ServingEngine(
        llama, block_size=4, max_batched_tokens=max_batched_tokens, codec=codec, prefix_sharing=False
    ) as engine:
        assert engine.generate(prompts, greedy(20)) == reference
        assert engine.pool.num_used == 0 and engine.pool.sealed_stats().used_blocks == 0  # every byte returned


def test_sealed_codes_under_a_cap_with_prefix_hits(llama) -> None:
    """int8 holds more requests under the same cap than full precision; what a hit serves is the tree's codes."""
    prompts = prompts_with_shared_prefix(llama.config.vocab_size, (5, 17, 3, 2, 9, 11, 4, 8), shared=37)
    full = [alone(llama, p, 20) for p in prompts]
    cap = 30 * 4 * 512  # 30 full-precision blocks of 4 tokens (512 bytes a token)
    peaks = {}
    for codec in (None, "int8"):
        with ServingEngine(llama, block_size=4, max_bytes=cap, max_batched_tokens=32, codec=codec) as engine:
            got = engine.generate(prompts, greedy(20))
            stats = engine.stats()
            assert stats.kv_bytes_peak <= cap and stats.kv_bytes_held <= cap
            assert stats.prefix_hit_tokens > 0 and stats.finished == len(prompts)
            peaks[codec] = stats.max_running
            engine.prefix.check_invariants()
            # The tree's codes count as free by the bytes evicting them gives back, not as whole blocks.
            assert engine.scheduler.free_blocks() * engine.pool.bytes_per_block <= cap
        agreement = sum(a == b for r, g in zip(full, got, strict=True) for a, b in zip(r, g, strict=True))
        assert agreement >= 0.9 * 20 * len(prompts), codec
    assert peaks["int8"] > peaks[None]


def test_a_step_reads_codes_where_a_quantized_cache_alone_would_under_a_tight_cap(llama) -> None:
    """Under a cap where a request's codes find no room after its step, the next step does not read those blocks in
    full precision: newer requests are preempted for the room, or the newest waits while older ones run. Checked at
    every step: each request computing past its prompt has every block past its residual window sealed."""
    draw = random.Random(3)
    prompts = [[draw.randrange(4, llama.config.vocab_size) for _ in range(n)] for n in (60, 24, 50, 12, 40, 30)]
    expected = [alone_quantized(llama, p, 4, 16) for p in prompts]
    with ServingEngine(llama, block_size=4) as probe:
        per_block = probe.pool.bytes_per_block
    refused = 0
    for blocks in (20, 24, 26, 28):
        with ServingEngine(
            llama, block_size=4, codec="int4", prefix_sharing=False, max_batched_tokens=16, reserve_blocks=0,
            max_bytes=blocks * per_block,
        ) as engine:  # fmt: skip
            ids = [engine.add_request(p, greedy(16)) for p in prompts]
            outputs: dict[int, list[int]] = {i: [] for i in ids}
            seal, quant = engine.pool.seal, engine.scheduler.blocks.quant  # type: ignore[attr-defined]

            def counted(block_ids, seal=seal):  # type: ignore[no-untyped-def]
                nonlocal refused
                try:
                    return seal(block_ids)
                except PoolExhausted:
                    refused += 1
                    raise

            schedule = engine.scheduler.schedule

            def checked(schedule=schedule, cap=blocks, quant=quant, scheduler=engine.scheduler):  # type: ignore[no-untyped-def]
                step = schedule()
                for request in step.requests:
                    if request.computed < len(request.prompt) or len(scheduler.running) == 1:
                        continue
                    ready = max(0, request.computed - quant.residual) // 4
                    table = request.tables.block_ids[0]
                    assert all(is_sealed(b) for b in table[quant.sink_blocks : ready]), (cap, request.request_id)
                return step

            engine.pool.seal = counted  # type: ignore[method-assign]
            engine.scheduler.schedule = checked  # type: ignore[method-assign]
            while engine.has_work:
                for event in engine.step():
                    outputs[event.request_id].append(event.token)  # type: ignore[arg-type]
            assert [outputs[i] for i in ids] == expected
    assert refused > 0  # the caps above do leave codes without room after some steps


def test_score_gives_each_prompt_token_the_log_probability_of_one_forward(llama) -> None:
    """Prompts scored in chunks of 16 tokens after the prefix tree already holds them (a scored prompt matches
    nothing, so every token is computed), and scored requests that go on generating under a cap that preempts them
    (scored again as they are computed again): each prompt token's log-probability is that of one plain forward."""
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, llama.config.vocab_size, (n,), generator=generator).tolist() for n in (30, 57, 5, 52)]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            logits = llama(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        expected.append(logits.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0])
    per_block = ServingEngine(llama, block_size=4)
    bytes_per_block = per_block.pool.bytes_per_block
    per_block.close()
    with ServingEngine(llama, block_size=4, max_batched_tokens=16) as engine:
        engine.generate(prompts, greedy(2))
        scored = engine.score(prompts)
    with ServingEngine(llama, block_size=4, max_batched_tokens=16, max_bytes=24 * bytes_per_block) as engine:
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, prompt_logprobs=True)
        requests = [engine.request(engine.add_request(prompt, params)) for prompt in prompts]
        list(engine.run_until_done())
        assert engine.stats().preemptions > 0
    for got in (scored, [r.prompt_logprobs for r in requests]):  # type: ignore[union-attr]
        for logprobs, reference in zip(got, expected, strict=True):
            torch.testing.assert_close(torch.tensor(logprobs), reference, rtol=1e-4, atol=1e-4)


def test_a_preallocated_engine_holds_its_cap_from_the_start_and_never_grows(llama, mixed_prompts) -> None:  # type: ignore[no-untyped-def]
    with ServingEngine(llama, block_size=4) as probe:
        per_block = probe.pool.bytes_per_block
    with ServingEngine(llama, block_size=4, max_bytes=64 * per_block, preallocate=True) as engine:
        held = engine.stats().kv_bytes_held
        assert held == 64 * per_block and engine.pool.capacity == 64  # reserved before any request
        outputs = engine.generate(mixed_prompts, greedy())
        assert engine.pool.capacity == 64 and engine.stats().kv_bytes_held == held  # no growth while serving
    assert outputs == [alone(llama, p) for p in mixed_prompts]
    with pytest.raises(ValueError, match="preallocate=True needs a cap to reserve: give max_bytes"):
        ServingEngine(llama, preallocate=True)
    with pytest.raises(ValueError, match="preallocate=True needs full-precision blocks: leave codec=None"):
        ServingEngine(llama, max_bytes=64 * per_block, codec="int8", preallocate=True)
