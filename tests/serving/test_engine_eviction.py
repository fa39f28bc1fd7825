"""Heavy-hitter eviction in the serving engine (`ServingEngine(policy=HeavyHitter(...))`) on tiny random models.

The block scores are the attention an eager forward measures; what a request keeps is exactly what a DynamicCache
pruned to the same blocks holds (its greedy tokens equal that cache's); a budget above every length is lossless;
requests evict alike together or alone; tables stay within budget, and what is refused is refused at construction.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov.engine.parts import Disk, HeavyHitter, Sink
from hf_kvgov.policies.head_adaptive import HeadAdaptive
from hf_kvgov.serving import SamplingParams, ServingEngine
from hf_kvgov.serving.eviction import BlockEviction
from tests.conftest import tiny_gemma3, tiny_llama, tiny_mistral

BLOCK = 8


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    return tiny_llama()


def random_prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def greedy(new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, ignore_eos=True)


def eager_block_mass(model, prompt: list[int], layers: list[int] | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Per block of the prompt, the attention every query paid it, summed over `layers` (default: all) and heads
    (eager weights)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([prompt]), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    chosen = range(len(out.attentions)) if layers is None else layers
    per_key = sum(out.attentions[i][0].sum(dim=(0, 1)) for i in chosen)  # [keys]
    blocks = -(-len(prompt) // BLOCK)
    return torch.nn.functional.pad(per_key, (0, blocks * BLOCK - len(prompt))).view(blocks, BLOCK).sum(-1)


class Recorder(BlockEviction):
    """Records each request's block scores at the step its prompt completes, before anything is evicted."""

    def __init__(self, policy: HeavyHitter) -> None:
        super().__init__(policy)
        self.at_prompt: dict[int, torch.Tensor] = {}
        self.kept: dict[int, list[int]] = {}

    def evict(self, request, masses, block_size):  # type: ignore[no-untyped-def]
        before = len(request.tables)
        dropped = super().evict(request, masses, block_size)
        if request.computed == len(request.prompt) and request.request_id not in self.at_prompt:
            assert request.block_mass is not None
            kept = [c for c in range(before) if c not in dropped]
            scores = torch.zeros(before)
            scores[kept] = request.block_mass.cpu()
            self.at_prompt[request.request_id] = scores
            self.kept[request.request_id] = kept
        return dropped


def recording_engine(model, policy: HeavyHitter, **kwargs) -> tuple[ServingEngine, Recorder]:  # type: ignore[no-untyped-def]
    engine = ServingEngine(model, block_size=BLOCK, **kwargs, policy=policy)
    recorder = Recorder(policy)
    engine.scheduler.eviction = recorder
    return engine, recorder


@pytest.mark.parametrize("max_batched_tokens", [512, 24])
def test_block_scores_are_the_attention_an_eager_forward_measures(llama, max_batched_tokens: int) -> None:
    prompts = random_prompts(llama.config.vocab_size, (45, 70))
    engine, recorder = recording_engine(
        llama, HeavyHitter(100_000), max_batched_tokens=max_batched_tokens, prefix_sharing=False
    )
    with engine:
        engine.generate(prompts, greedy(2))
    for request_id, prompt in enumerate(prompts):
        expected = eager_block_mass(llama, prompt)
        kept = recorder.kept[request_id]
        torch.testing.assert_close(recorder.at_prompt[request_id][kept], expected[kept], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_a_budget_above_every_length_changes_no_token(build) -> None:  # type: ignore[no-untyped-def]
    model = build()
    prompts = random_prompts(model.config.vocab_size, (50, 90, 33, 17))
    for codec in (None, "int8"):
        with ServingEngine(model, block_size=BLOCK, codec=codec) as engine:
            full = engine.generate(prompts, greedy(20))
        with ServingEngine(
            model, block_size=BLOCK, codec=codec, policy=HeavyHitter(100_000), max_batched_tokens=32
        ) as engine:
            assert engine.generate(prompts, greedy(20)) == full
            assert engine.stats().evicted_blocks == 0


def test_a_request_attends_to_exactly_the_blocks_it_kept(llama) -> None:
    """Greedy tokens after the prompt's eviction equal a DynamicCache pruned to the same blocks, keys at their own
    positions (the tokens stay within the tail block, so nothing more is evicted)."""
    prompt = random_prompts(llama.config.vocab_size, (67,), seed=3)[0]  # 8 full blocks + 3 tokens
    new = BLOCK - 3 - 1  # the tail block fills to one short of full: no later eviction
    policy = HeavyHitter(0.5, recent=0.25)  # 5 blocks kept; 9 would be computed before one streams out
    engine, recorder = recording_engine(llama, policy, prefix_sharing=False)
    with engine:
        (tokens,) = engine.generate([prompt], greedy(new))
        assert engine.stats().evicted_blocks == -(-len(prompt) // BLOCK) - len(recorder.kept[0])
    assert len(recorder.kept[0]) == BlockEviction(policy).budget_blocks(len(prompt), BLOCK)
    assert tokens == pruned_dynamic_cache_tokens(llama, prompt, recorder.kept[0], new)


def test_requests_evict_alike_together_or_alone(llama) -> None:
    prompts = random_prompts(llama.config.vocab_size, (64, 100, 40, 130), seed=5)
    policy = HeavyHitter(0.25)
    with ServingEngine(llama, block_size=BLOCK, policy=policy, prefix_sharing=False, max_batched_tokens=48) as engine:
        together = engine.generate(prompts, greedy(30))
    for prompt, tokens in zip(prompts, together, strict=True):
        with ServingEngine(llama, block_size=BLOCK, policy=policy, prefix_sharing=False) as engine:
            assert engine.generate([prompt], greedy(30)) == [tokens]


def test_tables_stay_within_budget_and_every_block_comes_back(llama) -> None:
    prompts = random_prompts(llama.config.vocab_size, (120, 96, 150), seed=7)
    policy = HeavyHitter(0.2)
    eviction = BlockEviction(policy)
    with ServingEngine(llama, block_size=BLOCK, policy=policy, prefix_sharing=False, codec="int8") as engine:
        ids = [engine.add_request(p, greedy(40)) for p in prompts]
        while engine.has_work:
            engine.step()
            for request_id, prompt in zip(ids, prompts, strict=True):
                request = engine.request(request_id)
                if request is None or request.tables is None:
                    continue
                budget = eviction.budget_blocks(len(prompt), BLOCK)
                assert len(request.tables) <= budget + (eviction.slack if request.computed < len(prompt) else 0)
        stats = engine.stats()
        assert stats.finished == 3 and stats.evicted_blocks > 0
        assert engine.pool.num_used == 0 and stats.kv_bytes_used == 0


@pytest.mark.parametrize(("build", "cap"), [(tiny_llama, 16), (tiny_gemma3, 32)], ids=["llama", "gemma3"])
def test_a_small_cap_preempts_and_every_request_finishes(build, cap: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`cap` blocks (a gemma3 block is one layer's, so it takes more); the swapped run answers as the uncapped."""
    model = build()
    prompts = random_prompts(model.config.vocab_size, (20, 22, 18, 25, 21, 19, 23, 20), seed=9)
    policy = HeavyHitter(16)  # two blocks a request
    with ServingEngine(model, block_size=BLOCK, policy=policy, prefix_sharing=False) as engine:
        alone = engine.generate(prompts, greedy(48))
        per_block = engine.pool.bytes_per_block
    for spill in (None, Disk(str(tmp_path))):
        with ServingEngine(
            model,
            block_size=BLOCK,
            policy=policy,
            prefix_sharing=False,
            max_bytes=cap * per_block,
            reserve_blocks=0,  # decoders grow into a full pool
            max_batched_tokens=16,  # prefills hold their blocks over several steps
            spill=spill,
        ) as engine:
            outputs = engine.generate(prompts, greedy(48))
            stats = engine.stats()
        assert stats.finished == len(prompts) and stats.preemptions > 0
        assert stats.kv_bytes_peak <= cap * per_block
        if spill is not None:  # swapped back with the blocks it kept and their scores, a request goes on as before
            assert stats.swapped_blocks > 0
            assert outputs == alone


def test_prefix_hits_and_eviction_together(llama) -> None:
    doc = random_prompts(llama.config.vocab_size, (96,), seed=11)[0]
    questions = random_prompts(llama.config.vocab_size, (9, 14, 6), seed=12)
    with ServingEngine(llama, block_size=BLOCK, policy=HeavyHitter(0.25)) as engine:
        first = engine.generate([doc + questions[0]], greedy(20))
        later = engine.generate([doc + q for q in questions[1:]], greedy(20))
        stats = engine.stats()
    # With a tree each prompt is held whole until computed, so the tree gets it whole: both later requests hit
    # every full block of the document.
    assert stats.prefix_hit_tokens >= 2 * (len(doc) // BLOCK) * BLOCK
    assert stats.evicted_blocks > 0 and len(first[0]) == 20 and all(len(t) == 20 for t in later)


def test_blocks_an_evicting_request_still_reads_are_not_counted_free(llama) -> None:
    """An evicting request gives up its tree locks but still reads the blocks it kept: evicting them from the tree
    frees nothing, so admission must not count them free; whatever `free_blocks()` says can be allocated."""
    doc, question = random_prompts(llama.config.vocab_size, (96, 9), seed=11)
    with ServingEngine(llama, block_size=BLOCK) as probe:
        per_block = probe.pool.bytes_per_block
    with ServingEngine(llama, block_size=BLOCK, policy=HeavyHitter(0.25), max_bytes=40 * per_block) as engine:
        engine.add_request(doc + question, greedy(30))
        request = None
        while request is None or not request.evicted_tokens:
            engine.step()
            request = engine.scheduler.running[0]
        assert not request.locks and request.tables is not None
        assert any(block in engine.prefix.tree for block in request.tables.live_ids())  # type: ignore[union-attr]
        blocks = engine.pool.allocate(engine.scheduler.free_blocks())  # PoolExhausted if it counted too many
        engine.pool.decref(blocks)


def pruned_dynamic_cache_tokens(model, prompt: list[int], kept: list[int], new: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy tokens of a `DynamicCache` whose full-attention layers keep only the blocks `kept` of the prompt (keys
    at their own positions); sliding layers keep their window."""
    kept_tokens = torch.tensor([c * BLOCK + i for c in kept for i in range(BLOCK) if c * BLOCK + i < len(prompt)])
    full = [i for i, kind in enumerate(getattr(model.config, "layer_types", None) or []) if kind == "full_attention"]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        for i in full or range(len(cache.layers)):
            cache.layers[i].keys = cache.layers[i].keys[:, :, kept_tokens]
            cache.layers[i].values = cache.layers[i].values[:, :, kept_tokens]
        expected = [int(logits.argmax())]
        for step in range(new - 1):
            position = torch.tensor([[len(prompt) + step]])
            out = model(torch.tensor([[expected[-1]]]), cache=cache, position_ids=position, use_cache=True)
            expected.append(int(out.logits[0, -1].argmax()))
    return expected


def test_a_hybrid_model_evicts_from_its_full_layers_only() -> None:
    """Gemma-3 in miniature (layers 0 and 2 slide over 8 tokens, layer 1 attends in full): blocks are scored by the
    full layer's attention alone, its tables lose the evicted blocks while the sliding ones keep their window, and
    the greedy tokens equal a DynamicCache whose full layer was pruned to the same blocks."""
    gemma = tiny_gemma3()
    prompts = random_prompts(gemma.config.vocab_size, (45, 67), seed=3)
    engine, recorder = recording_engine(gemma, HeavyHitter(100_000), prefix_sharing=False, max_batched_tokens=24)
    with engine:
        engine.generate(prompts, greedy(2))
    for request_id, prompt in enumerate(prompts):
        expected = eager_block_mass(gemma, prompt, layers=[1])
        kept = recorder.kept[request_id]
        torch.testing.assert_close(recorder.at_prompt[request_id][kept], expected[kept], rtol=1e-4, atol=1e-4)
    prompt, new = prompts[1], BLOCK - 3 - 1  # 8 full blocks + 3 tokens; the tail block fills to one short of full
    policy = HeavyHitter(0.5, recent=0.25)
    engine, recorder = recording_engine(gemma, policy, prefix_sharing=False)
    with engine:
        request_id = engine.add_request(prompt, greedy(new))
        tokens, decoded = [], 0
        while engine.has_work:
            tokens += [event.token for event in engine.step()]
            request = engine.request(request_id)
            if request is not None and request.evicted_tokens:
                assert request.tables is not None
                full, *sliding = [request.tables.tables[g] for g in (2, 0, 1)]  # groups: (0,) 8, (2,) 8, (1,) full
                assert len(full) == len(recorder.kept[request_id]) and full.freed == 0
                assert all(len(table) == -(-request.computed // BLOCK) for table in sliding)  # every position
                if len(request.output) > 1:  # after a decode step: the window's 8 tokens span at most 2 blocks
                    assert all(len(table.live_ids) <= 2 for table in sliding)
                    decoded += 1
        assert decoded > 0
        assert engine.stats().evicted_blocks == -(-len(prompt) // BLOCK) - len(recorder.kept[request_id])
        assert engine.pool.num_used == 0
    assert len(recorder.kept[request_id]) == BlockEviction(policy).budget_blocks(len(prompt), BLOCK)
    assert tokens == pruned_dynamic_cache_tokens(gemma, prompt, recorder.kept[request_id], new)


def test_what_the_engine_cannot_evict_is_refused_at_construction(llama) -> None:
    with pytest.raises(TypeError, match="HeavyHitter"):
        ServingEngine(llama, policy=Sink())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heads=\.\.\.") as refused:
        ServingEngine(llama, policy=HeavyHitter(0.2, heads=HeadAdaptive()))
    assert "every layer and KV head" in str(refused.value)
    mistral = tiny_mistral()
    with pytest.raises(ValueError, match="every layer of this model slides"):
        ServingEngine(mistral, policy=HeavyHitter(0.2))
    assert mistral.config._attn_implementation != "kvgov_ragged"


def test_a_scored_prompt_is_scored_with_the_policy_in_the_loop_whether_or_not_the_engine_shares_prefixes(
    llama,
) -> None:  # type: ignore[no-untyped-def]
    """`score` is the policy's perplexity with the cache in the loop: a scored prompt streams, evicting as it is
    computed, with or without a prefix tree. With one, it used to be held whole for the tree, so its log-probabilities
    were the full cache's (equal to one plain forward) while the policy evicted only afterwards."""
    prompts = random_prompts(llama.config.vocab_size, (120, 97, 64), seed=5)
    full = []
    for prompt in prompts:
        with torch.no_grad():
            logits = llama(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        full.append(logits.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0])
    scored = {}
    for sharing in (False, True):
        with ServingEngine(
            llama, block_size=BLOCK, max_batched_tokens=16, policy=HeavyHitter(0.25), prefix_sharing=sharing
        ) as engine:
            scored[sharing] = [torch.tensor(logprobs) for logprobs in engine.score(prompts)]
            assert engine.stats().evicted_blocks > 0
    for streamed, shared, reference in zip(scored[False], scored[True], full, strict=True):
        torch.testing.assert_close(shared, streamed)
        assert (shared - reference).abs().max() > 1e-3  # lossy: the evicted blocks are missed
