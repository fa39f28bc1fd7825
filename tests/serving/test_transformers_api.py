"""transformers' own continuous-batching entry points (`generate_batch`, the context manager, its streaming and
cancel), unchanged, running on the governed engine after `install`."""

from __future__ import annotations

import logging
import time
import types

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from hf_kvgov import serving
from hf_kvgov.hf.compat import RequestStatus
from hf_kvgov.serving import GovernedBatchingManager
from tests.conftest import tiny_llama
from tests.serving.test_engine import alone


@pytest.fixture
def model():  # type: ignore[no-untyped-def]
    model = tiny_llama()
    model.generation_config.eos_token_id = None  # every request runs its max_new_tokens, as `alone` does
    serving.install(model, block_size=4, max_batched_tokens=24)
    yield model
    serving.uninstall(model)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (n,), generator=generator).tolist() for n in (5, 17, 33, 9)]


def test_generate_batch_runs_on_the_engine_and_answers_as_alone(model, prompts) -> None:  # type: ignore[no-untyped-def]
    reference = [alone(model, p, 10) for p in prompts]
    results = model.generate_batch(prompts, max_new_tokens=10, record_timestamps=True)
    assert list(results) == ["req_0", "req_1", "req_2", "req_3"]
    assert [r.generated_tokens for r in results.values()] == reference
    assert all(r.is_finished() and r.error is None and len(r.timestamps) == 10 for r in results.values())
    assert model.config._attn_implementation == "sdpa"  # the manager's engine gave the attention back


def test_a_request_the_pool_cannot_hold_fails_alone(prompts) -> None:  # type: ignore[no-untyped-def]
    """One prompt longer than the cap comes back FAILED with the reason, as transformers fails a request; the others
    are answered (the whole call used to return nothing)."""
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    reference = [alone(model, p, 10) for p in prompts]
    serving.install(model, block_size=4, max_batched_tokens=24, max_bytes=20 * 4 * 512)  # 20 blocks
    try:
        results = model.generate_batch([prompts[0], list(range(3, 95)), *prompts[1:]], max_new_tokens=10)
    finally:
        serving.uninstall(model)
    assert list(results) == ["req_0", "req_1", "req_2", "req_3", "req_4"]
    failed = results["req_1"]
    assert failed.status == RequestStatus.FAILED and failed.generated_tokens == []
    assert failed.error is not None and "needs 26 blocks" in failed.error and "holds at most 20" in failed.error
    answered = [results[name] for name in ("req_0", "req_2", "req_3", "req_4")]
    assert [r.generated_tokens for r in answered] == reference and all(r.error is None for r in answered)


def test_context_manager_streams_and_cancels(model, prompts) -> None:  # type: ignore[no-untyped-def]
    reference = alone(model, prompts[1], 10)
    with model.continuous_batching_context_manager() as manager:
        assert isinstance(manager, GovernedBatchingManager)
        request_id = manager.add_request(prompts[1], max_new_tokens=10, streaming=True)
        lengths = []
        for result in manager.request_id_iter(request_id):
            time.sleep(0.02)  # a slow reader: each result still holds the tokens as they were when it was handed out
            lengths.append(len(result.generated_tokens))
        assert lengths == list(range(1, 11))  # one result per token, as it came
        endless = manager.add_request(prompts[0], max_new_tokens=400)
        manager.cancel_request(endless)
        result = manager.get_result(endless, timeout=10)
        assert result is not None and result.is_finished() and len(result.generated_tokens) < 400
        engine = manager.engine
        assert engine is not None and engine.pool.num_used == len(engine.prefix.tree)  # only the tree's blocks
    finished = model.generate_batch([prompts[1]], max_new_tokens=10)
    assert finished["req_0"].generated_tokens == reference


def test_the_servers_stats_line_reads_the_engine(model, prompts) -> None:  # type: ignore[no-untyped-def]
    """transformers' server logs requests running and waiting and how full the KV cache is, from its batch processor;
    its own `state` reads the engine's figures (it printed no KV usage at all before)."""
    from transformers.cli.serving.utils import CBGenerateRunner

    with model.continuous_batching_context_manager() as manager:
        assert CBGenerateRunner.state(types.SimpleNamespace(manager=manager)) == (0, 0, ", KV cache: 0.0% used")
        request_id = manager.add_request(prompts[1], max_new_tokens=400)
        deadline = time.monotonic() + 30
        while (state := CBGenerateRunner.state(types.SimpleNamespace(manager=manager)))[0] == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
        engine = manager.engine
        assert engine is not None
        running, waiting, line = state
        stats = engine.stats()
        assert (running, waiting) == (1, 0) and stats.kv_bytes_used > 0
        used = float(line.removeprefix(", KV cache: ").removesuffix("% used"))
        assert 0 < used <= 100  # the share of the pool's memory in use (no cap given)
        manager.cancel_request(request_id)


def test_refusals_name_what_is_wrong(prompts) -> None:  # type: ignore[no-untyped-def]
    model = tiny_llama()
    with pytest.raises(ValueError, match="max_batched_tokens must be an int >= 1"):
        serving.install(model, max_batched_tokens=0)
    assert "init_continuous_batching" not in vars(model)  # nothing installed
    serving.install(model)
    with (
        model.continuous_batching_context_manager() as manager,
        pytest.raises(ValueError, match="logits processor arguments \\['repetition_penalty'\\]"),
    ):
        manager.add_request(prompts[0], repetition_penalty=1.2)
    manager = model.init_continuous_batching()
    with pytest.raises(RuntimeError, match="Start the manager"):
        manager.add_request(prompts[0])


def test_per_request_sampling_settings(model, prompts) -> None:  # type: ignore[no-untyped-def]
    """transformers' server passes temperature, top_p and top_k per request; top_k=1 is greedy whatever the
    temperature, and the manager says which settings it takes."""
    reference = alone(model, prompts[2], 10)
    with model.continuous_batching_context_manager() as manager:
        assert manager.logit_processor.supported_keys == {"temperature": float, "top_p": float, "top_k": int}
        assert manager.background_thread_status.fatal_error is None
        greedy_id = manager.add_request(prompts[2], max_new_tokens=10, temperature=1.3, top_k=1)
        sampled_id = manager.add_request(prompts[2], max_new_tokens=10, temperature=5.0, top_p=0.95, top_k=20)
        results = {r.request_id: r for r in (manager.get_result(timeout=30), manager.get_result(timeout=30))}
    assert results[greedy_id].generated_tokens == reference
    assert len(results[sampled_id].generated_tokens) == 10 and results[sampled_id].generated_tokens != reference


def generated(model, prompt: list[int], **settings) -> list[int]:  # type: ignore[no-untyped-def]
    """`model.generate` alone on `prompt`, greedy, DynamicCache, with transformers' own `settings`."""
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, cache=DynamicCache(config=model.config), pad_token_id=0, **settings
    )
    return out[0, len(prompt) :].tolist()


def test_repetition_penalty_and_min_new_tokens_of_the_generation_config(model, prompts) -> None:  # type: ignore[no-untyped-def]
    """The engine applies them as `model.generate` does: the same tokens. The stop token is the one the first prompt
    would pick first, so without `min_new_tokens` that request would end at once."""
    stop = alone(model, prompts[0], 1)[0]
    settings = {"max_new_tokens": 8, "repetition_penalty": 1.5, "eos_token_id": stop}
    assert generated(model, prompts[0], **settings) == [stop]  # it would end at once
    config = GenerationConfig(do_sample=False, min_new_tokens=8, **settings)
    results = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    reference = [generated(model, p, min_new_tokens=8, **settings) for p in prompts]
    assert [r.generated_tokens for r in results.values()] == reference
    assert all(len(tokens) == 8 for tokens in reference)
    plain = [generated(model, p, max_new_tokens=8, min_new_tokens=8, eos_token_id=stop) for p in prompts]
    assert plain != reference  # the penalty changed some token


def test_what_a_generation_config_leaves_out_is_taken_as_model_generate_takes_it(model, prompts) -> None:  # type: ignore[no-untyped-def]
    """``max_length`` counts the prompt (it was ignored: 20 new tokens), and a config without end tokens takes the
    model's own (the requests ran past them)."""
    lengths = GenerationConfig(max_length=40, do_sample=False)
    results = model.generate_batch(prompts, generation_config=lengths, progress_bar=False)
    assert [r.generated_tokens for r in results.values()] == [generated(model, p, max_length=40) for p in prompts]
    assert [len(r.generated_tokens) for r in results.values()] == [40 - len(p) for p in prompts]
    stop = alone(model, prompts[1], 3)[2]
    model.generation_config.eos_token_id = stop
    results = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=12), progress_bar=False)
    reference = [generated(model, p, max_new_tokens=12) for p in prompts]
    assert [r.generated_tokens for r in results.values()] == reference
    assert reference[1][-1] == stop and len(reference[1]) == 3  # it ends at the model's end token


def test_num_return_sequences_gives_each_prompt_its_children(model, prompts) -> None:  # type: ignore[no-untyped-def]
    greedy = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=2)  # top_k 1: greedy
    results = model.generate_batch(prompts[:2], generation_config=greedy, progress_bar=False)
    assert list(results) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1"]  # as transformers orders them
    for name, result in results.items():
        assert result.generated_tokens == alone(model, prompts[int(name[4])], 6)
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, num_return_sequences=3)
    results = model.generate_batch(prompts[:1], generation_config=sampled, progress_bar=False)
    assert list(results) == ["req_0__child#0", "req_0__child#1", "req_0"]
    outputs = {tuple(r.generated_tokens) for r in results.values()}
    assert len(outputs) == 3 and all(len(tokens) == 6 for tokens in outputs)  # each child samples on its own


def test_settings_the_engine_does_not_apply_are_named_and_beams_refused(model) -> None:  # type: ignore[no-untyped-def]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.cli.kvgov")
    logger.addHandler(handler)
    try:
        model.init_continuous_batching(GenerationConfig(no_repeat_ngram_size=2, min_p=0.1, repetition_penalty=1.2))
        applied = GenerationConfig(do_sample=True, top_k=5, repetition_penalty=1.2, num_return_sequences=2)
        model.init_continuous_batching(applied)
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1, [r.getMessage() for r in records]  # the second config is applied whole
    message = records[0].getMessage()
    assert "does not apply no_repeat_ngram_size=2, min_p=0.1 from the generation config" in message, message
    with pytest.raises(ValueError, match="num_beams=2: beam search is not continuous batching"):
        model.init_continuous_batching(GenerationConfig(num_beams=2))
