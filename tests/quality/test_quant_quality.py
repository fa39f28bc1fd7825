"""The sanity check's parts: metrics by hand, outlier ratio, protection and recommendation rules, and the
batched lockstep runner against separate runs."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from hf_kvgov import PagedCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.quality import (
    CacheScore,
    CheckOptions,
    QuantCheckReport,
    Recommendation,
    RunningScore,
    StackedCache,
    check_quantization,
    layers_to_protect,
    outlier_ratio,
    recommend,
    score_in_lockstep,
)
from hf_kvgov.quality.recommendation import TOP1_AGREEMENT_FLOOR
from tests.char_tokenizer import char_tokenizer
from tests.conftest import tiny_llama

MODEL = tiny_llama()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return char_tokenizer()


def test_running_score_by_hand() -> None:
    # Reference p = (1/2, 1/4, 1/4) and candidate q = (1/4, 1/2, 1/4) at both positions; targets 0 then 1.
    p = torch.tensor([0.5, 0.25, 0.25]).log().repeat(2, 1)
    q = torch.tensor([0.25, 0.5, 0.25]).log().repeat(2, 1)
    score = RunningScore()
    score.add(p, q, torch.tensor([0, 1]))
    kl = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # sum p log(p/q) = (1/4) ln 2
    assert score.kl_mean == pytest.approx(kl)
    assert score.perplexity == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.5)) / 2))
    assert score.reference_perplexity == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.25)) / 2))
    assert score.ppl_increase_pct == pytest.approx(0.0)  # same two probabilities, swapped
    assert score.top1_agreement == 0.0
    with pytest.raises(ValueError, match=r"\[n, vocab\]"):
        score.add(p, q[:1], torch.tensor([0, 1]))


def test_outlier_ratio_is_max_over_median_channel() -> None:
    keys = torch.ones(1, 2, 5, 4)  # [batch, heads, tokens, dim]: 8 channels of magnitude 1 ...
    keys[0, 1, 3, 2] = -15.0  # ... one of which reaches 15 on one token
    assert outlier_ratio(keys) == pytest.approx(15.0)
    with pytest.raises(ValueError, match="tokens > 0"):
        outlier_ratio(torch.ones(1, 2, 0, 4))


def test_layers_to_protect_takes_the_most_sensitive_until_inside_the_tolerance() -> None:
    increases = [3.0, 0.1, 0.05, 2.0, 0.0, -0.1, 0.0, 0.0]
    # Sum 5.15 > 0.25: protect layer 0 (2.15 left), layer 3 (0.15 left, done); at most 8 // 4 = 2 layers.
    assert layers_to_protect(increases, tolerance_pct=0.5) == (0, 3)
    assert layers_to_protect(increases, tolerance_pct=20.0) == ()
    assert layers_to_protect([5.0, 4.0, 3.0, 2.0], tolerance_pct=0.5) == (0,)  # a quarter of 4 layers
    assert layers_to_protect([-1.0, 0.0], tolerance_pct=0.0) == ()


def score(name: str, increase: float, bytes_per_token: float, top1: float = 0.99) -> CacheScore:
    return CacheScore(name, 100, 10 * (1 + increase / 100), 10.0, increase, 0.01, top1, bytes_per_token, 2.0)


def test_recommend_picks_the_smallest_configuration_within_the_tolerance() -> None:
    scores = [score("int8", 0.1, 150.0), score("fp8", 0.4, 140.0), score("int4", 3.0, 80.0)]
    options = {"int8": {"bits": 8}, "fp8": {"bits": 8, "fmt": "fp8"}, "int4": {"bits": 4}}
    chosen = recommend(scores, options, tolerance_pct=0.5)
    assert chosen.name == "fp8" and chosen.code == "QuantizedCache(model, bits=8, fmt='fp8')"
    assert recommend(scores, options, tolerance_pct=5.0).name == "int4"
    nothing = recommend(scores, options, tolerance_pct=0.05)
    assert nothing.name is None and nothing.code.startswith("PagedCache") and "int4 +3.00%" in nothing.reason


def test_recommend_never_picks_what_the_verdict_warns_about() -> None:
    """int4 within the perplexity tolerance but changing the top token at 3.3% of positions: the verdict warns, so
    the recommendation takes the next cheapest format instead."""
    scores = [score("int8", 0.0, 150.0), score("fp8", -0.03, 140.0), score("int4", 0.2, 80.0, top1=0.967)]
    options = {"int8": {"bits": 8}, "fp8": {"bits": 8, "fmt": "fp8"}, "int4": {"bits": 4}}
    assert recommend(scores, options, tolerance_pct=0.5).name == "fp8"
    only_int4 = recommend(scores[2:], options, tolerance_pct=0.5)
    assert only_int4.name is None and "top-1 96.7%" in only_int4.reason


def chunked_logits(cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return torch.cat([MODEL(ids[:, s : s + chunk], cache=cache).logits for s in range(0, 30, chunk)], 1)


def test_stacked_rows_equal_separate_runs() -> None:
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    alone = [chunked_logits(c, ids, 4) for c in (PagedCache(MODEL, 4), QuantizedCache(MODEL, bits=4, block_size=4))]
    stacked = StackedCache([PagedCache(MODEL, 4), QuantizedCache(MODEL, bits=4, block_size=4)], num_layers=2)
    together = chunked_logits(stacked, ids.expand(2, -1), 4)
    for row in range(2):
        torch.testing.assert_close(together[row : row + 1], alone[row], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(alone[0], alone[1], atol=1e-4)  # the int4 row really differs
    with pytest.raises(ValueError, match="contiguous attention path only"):
        StackedCache([PagedCache(MODEL, attention="paged")], num_layers=2)


def test_a_lossless_candidate_scores_as_the_reference() -> None:
    ids = torch.randint(3, 96, (1, 41), generator=torch.Generator().manual_seed(6))
    candidates = {
        "paged": functools.partial(PagedCache, MODEL, 8),
        "int4": functools.partial(QuantizedCache, MODEL, bits=4, block_size=8),
    }
    result = score_in_lockstep(MODEL, ids, candidates, chunk_tokens=8, block_size=8, max_rows=1)
    lossless, int4 = result.scores["paged"], result.scores["int4"]
    assert lossless.tokens == int4.tokens == 40
    assert lossless.ppl_increase_pct == pytest.approx(0.0, abs=1e-4) and lossless.kl_mean < 1e-9
    assert (lossless.top1_agreement, lossless.compression) == (1.0, 1.0)
    assert int4.kl_mean > 1e-7 and int4.compression > 2.5
    assert result.reference.get_seq_length() == 40  # the last token is never fed: it predicts nothing


def test_check_quantization_report_on_the_tiny_model(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "It is a truth universally acknowledged, that a single man must be in want of a wife. " * 3
    options = CheckOptions(max_tokens=160, block_size=8, scan_tokens=40, max_ppl_increase=1000.0)
    report = check_quantization(MODEL, tokenizer, text, options, model_name="tiny")
    assert [s.name for s in report.formats] == ["int8", "fp8", "int4"]
    assert report.tokens == 160 and all(s.tokens == 159 for s in report.formats)
    assert len(report.key_outlier_ratios) == 2 and all(r >= 1.0 for r in report.key_outlier_ratios)
    assert report.sensitivity is not None and report.sensitivity.format == "int4"
    assert [s.name for s in report.sensitivity.layers] == ["layer 0", "layer 1"]
    assert report.passed and report.gate_failures == ()
    # Every format passes a 1000% gate: the smallest one that keeps the top token (random weights: int4 does not).
    keeping = [s for s in report.formats if s.top1_agreement >= TOP1_AGREEMENT_FLOOR]
    expected = min(keeping, key=lambda s: (s.bytes_per_token, s.ppl_increase_pct))
    assert report.recommendation.name == expected.name
    data = json.loads(report.to_json())
    assert data["passed"] is True and data["recommendation"]["code"].startswith("QuantizedCache(model, bits=")
    for s in report.formats:  # what the verdict warns about is never the recommendation
        warned = any(line.startswith(f"{s.name} keeps perplexity but changes") for line in report.verdict())
        assert warned == (s.top1_agreement < TOP1_AGREEMENT_FLOOR) and not (warned and s.name == expected.name)
    assert "per-layer sensitivity (int4" in report.render()
    with pytest.raises(ValueError, match="needs more than two blocks"):
        check_quantization(MODEL, tokenizer, "short", options)


def test_check_options_are_validated() -> None:
    with pytest.raises(ValueError, match="Unknown or no formats"):
        CheckOptions(formats=("int3",))
    with pytest.raises(ValueError, match="max_ppl_increase is a percentage"):
        CheckOptions(max_ppl_increase=-1.0)
    with pytest.raises(ValueError, match="sink_blocks must be a non-negative int"):
        CheckOptions(sink_blocks=-2)


def test_verdict_flags_top1_shifts_outliers_and_the_gate() -> None:
    formats = (score("int8", 0.1, 150.0), CacheScore("int4", 100, 10.03, 10.0, 0.3, 0.004, 0.95, 80.0, 4.0))
    report = QuantCheckReport(
        model="m",
        tokens=101,
        block_size=16,
        chunk_tokens=16,
        reference_perplexity=10.0,
        formats=formats,
        key_outlier_ratios=(15.0, 2.0, float("nan")),
        sensitivity=None,
        protected=None,
        recommendation=Recommendation("int4", {"bits": 4}, "smallest"),
        tolerance_pct=0.5,
        threshold_pct=0.2,
        gate_failures=("int4",),
    )
    verdict = report.verdict()
    assert verdict[0] == "within +0.5% perplexity: int8, int4"
    assert verdict[1].startswith("int4 keeps perplexity but changes the most likely next token at 5.0% of positions")
    assert verdict[2].startswith("keys of layers 0 have outlier channels (up to 15.0x")
    assert verdict[3] == "gate (every listed format within +0.2%): FAIL: int4"
    data = json.loads(report.to_json())
    assert data["key_outlier_ratios"] == [15.0, 2.0, None] and data["passed"] is False


def test_a_failing_format_is_retried_with_its_most_sensitive_layer_in_full_precision(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    text = "It is a truth universally acknowledged, that a single man must be in want of a wife. " * 3
    options = CheckOptions(formats=("int4",), max_tokens=160, block_size=8, scan_tokens=40, max_ppl_increase=0.0)
    report = check_quantization(MODEL, tokenizer, text, options)
    (int4,) = report.formats
    assert int4.ppl_increase_pct > 0  # measured +0.025% on this text: the 0% gate fails
    assert report.sensitivity is not None and report.protected is not None
    increases = [s.ppl_increase_pct for s in report.sensitivity.layers]
    worst = max(range(2), key=lambda layer: increases[layer])
    assert report.protected.name == f"int4 + full-precision layers {worst}"  # at most 1 of 2 layers
    assert report.protected.compression < int4.compression  # a full-precision layer costs bytes
    assert report.gate_failures == ("int4",)  # the gate judges the listed format, not the retry
