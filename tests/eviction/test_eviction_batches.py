"""Left-padded batches and beam search through generate, with evictions happening (tiny Llama)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_kvgov import HeavyHitterCache, SinkCache, eviction_attention
from tests.conftest import tiny_llama

MODEL = tiny_llama(num_kv_heads=2, seed=2)
# 4x query/key weights: peaked, content-dependent attention, so two prompts rank their slots differently
# (the plain random model's mass depends mostly on position).
SHARP = tiny_llama(num_kv_heads=2, seed=2)
with torch.no_grad():
    for _layer in SHARP.model.layers:
        _layer.self_attn.q_proj.weight.mul_(4.0)
        _layer.self_attn.k_proj.weight.mul_(4.0)
SMALL = {
    "h2o": lambda model: HeavyHitterCache(model, budget=6, recent=3),
    "sink": lambda model: SinkCache(model, n_sink=2, window=4),
}


def generate(cache, inputs, **kwargs):  # type: ignore[no-untyped-def]
    with eviction_attention(MODEL):
        return MODEL.generate(**inputs, cache=cache, return_dict_in_generate=True, output_logits=True, **kwargs)


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_each_left_padded_row_equals_its_own_unpadded_run(kind: str) -> None:
    # If padding were ever kept (as a sink, a heavy hitter, or attended), padded rows would drift from
    # their solo runs, which have no padding at all.
    lengths = (9, 14, 11)
    generator = torch.Generator().manual_seed(21)
    rows = [torch.randint(3, 96, (n,), generator=generator) for n in lengths]
    ids = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros(3, 14, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 14 - len(row) :], mask[i, 14 - len(row) :] = row, 1
    cache = SMALL[kind](MODEL)
    batch = generate(cache, {"input_ids": ids, "attention_mask": mask}, max_new_tokens=12, do_sample=False)
    for i, row in enumerate(rows):
        solo = generate(SMALL[kind](MODEL), {"input_ids": row[None]}, max_new_tokens=12, do_sample=False)
        assert torch.equal(batch.sequences[i, 14:], solo.sequences[0, len(row) :])
        for batch_step, solo_step in zip(batch.logits, solo.logits, strict=True):
            torch.testing.assert_close(batch_step[i], solo_step[0], atol=1e-5, rtol=1e-5)
    # Every row now has more real tokens than the budget: no padding filler is left in any slot.
    assert all(bool(layer.valid.all()) for layer in cache.layers)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_padding_is_never_a_sink_or_kept_after_prefill(kind: str) -> None:
    ids = torch.tensor([[0, 0, 0, 0, 0, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]])
    mask = (ids != 0).long()
    cache = SMALL[kind](MODEL)
    with eviction_attention(MODEL):
        MODEL(ids, attention_mask=mask, cache=cache)
    for layer in cache.layers:
        valid: Any = layer.valid  # type: ignore[attr-defined]
        positions: Any = layer.positions  # type: ignore[attr-defined]
        assert valid.shape == (2, 2, 6)
        # Without position_ids the model numbers tokens absolutely: row 0's pads are 0..4, its real tokens 5..11.
        assert bool(valid.all())
        assert bool((positions[0] >= 5).all())
    if kind == "sink":  # 2 sinks (the first real tokens, not pads) + a window of 4
        assert cache.layers[0].positions[0, 0].tolist() == [5, 6, 8, 9, 10, 11]  # type: ignore[attr-defined]


def teacher_forced_log_prob(model, cache, prompt: torch.Tensor, generated: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    """Sum of log-probabilities of ``generated`` after ``prompt``, one token per forward.

    Beam search normalizes before min_new_tokens masks EOS, so the plain log-softmax is what it sums.
    """
    total = 0.0
    with eviction_attention(model), torch.inference_mode():
        logits = model(prompt[None], cache=cache).logits[0, -1]
        for token in generated.tolist():
            total += torch.log_softmax(logits, dim=-1)[token].item()
            logits = model(torch.tensor([[token]]), cache=cache).logits[0, -1]
    return total


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_beam_search_scores_follow_reordered_cache_rows(kind: str) -> None:
    # A beam's cache state depends only on its own tokens. If reorder_cache did not move every per-row
    # tensor (attention mass included), the beam's score would not equal a fresh single-sequence rescoring.
    prompts = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(4))
    out = generate(
        SMALL[kind](MODEL),
        {"input_ids": prompts},
        num_beams=3,
        max_new_tokens=10,
        min_new_tokens=10,
        length_penalty=0.0,
        do_sample=False,
        output_scores=True,
    )
    for row in range(2):
        generated = out.sequences[row, 8:]
        rescored = teacher_forced_log_prob(MODEL, SMALL[kind](MODEL), prompts[row], generated)
        assert out.sequences_scores[row].item() == pytest.approx(rescored, abs=1e-4)


def test_reorder_and_repeat_move_every_per_row_tensor() -> None:
    cache = HeavyHitterCache(MODEL, budget=4, recent=2)
    ids = torch.randint(3, 96, (3, 7), generator=torch.Generator().manual_seed(5))
    with eviction_attention(MODEL):
        MODEL(ids, cache=cache)
    names = ("keys", "values", "positions", "valid", "scores")
    before = [{name: getattr(layer, name).clone() for name in names} for layer in cache.layers]
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    for layer, saved in zip(cache.layers, before, strict=True):
        for name in names:
            assert torch.equal(getattr(layer, name), saved[name][[2, 0, 0]])
    cache.batch_repeat_interleave(2)
    for layer, saved in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.scores, saved["scores"][[2, 2, 0, 0, 0, 0]])  # type: ignore[attr-defined]
    cache.batch_select_indices(torch.tensor([1, 4]))
    assert torch.equal(cache.layers[0].keys, before[0]["keys"][[2, 0]])


def test_reordered_rows_continue_exactly_like_their_source_rows() -> None:
    # Row 0 is left-padded and row 1 is not, so their slots' validity and mass differ; after swapping the
    # rows, each must decode (and evict) exactly as a cache that held them in the swapped order from the start.
    prompts = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(prompts)
    prompts[0, :4], mask[0, :4] = 0, 0
    follow = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(7))
    swapped_cache, direct_cache = (
        HeavyHitterCache(SHARP, budget=5, recent=1),
        HeavyHitterCache(SHARP, budget=5, recent=1),
    )
    with eviction_attention(SHARP), torch.inference_mode():
        SHARP(prompts, attention_mask=mask, cache=swapped_cache)
        swapped_cache.reorder_cache(torch.tensor([1, 0]))
        mask = mask[[1, 0]]
        SHARP(prompts[[1, 0]], attention_mask=mask, cache=direct_cache)
        for step in range(10):
            mask = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1)
            token = follow[:, step : step + 1]
            got = SHARP(token, attention_mask=mask, cache=swapped_cache).logits
            expected = SHARP(token, attention_mask=mask, cache=direct_cache).logits
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    for got_layer, expected_layer in zip(swapped_cache.layers, direct_cache.layers, strict=True):
        assert torch.equal(got_layer.positions, expected_layer.positions)  # type: ignore[attr-defined]


def test_eviction_after_reorder_uses_the_moved_attention_mass() -> None:
    # Random models rank slots mostly by position, so plant masses by hand: row 0 ascending, row 1
    # descending, 10 apart (one decode step adds at most 2 per KV head: 2 query heads x probability 1).
    cache = HeavyHitterCache(MODEL, budget=5, recent=1)
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(8))
    with eviction_attention(MODEL), torch.inference_mode():
        MODEL(ids, cache=cache)
        planted = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0], [50.0, 40.0, 30.0, 20.0, 10.0]])
        for layer in cache.layers:
            layer.scores = planted[:, None, :].expand(2, 2, 5).clone()  # type: ignore[attr-defined]
        cache.reorder_cache(torch.tensor([1, 0]))
        MODEL(torch.tensor([[7], [8]]), cache=cache)
    for layer in cache.layers:
        positions: Any = layer.positions  # type: ignore[attr-defined]
        # Row 0 now holds old row 1 (descending mass): its lightest old slot is position 4, evicted.
        assert positions[0].tolist() == [[0, 1, 2, 3, 5]] * 2
        # Row 1 holds old row 0 (ascending mass): position 0 goes.
        assert positions[1].tolist() == [[1, 2, 3, 4, 5]] * 2
