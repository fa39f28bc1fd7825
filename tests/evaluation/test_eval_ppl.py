"""`kvgov eval ppl`: losses with the cache in the loop and in sliding windows, pooling, text sources, CLI."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_kvgov.cli.main import main
from hf_kvgov.evaluation.perplexity import chunked_token_losses, sliding_window_token_losses
from hf_kvgov.evaluation.ppl_run import (
    SLIDING_WINDOW,
    PerplexityOptions,
    Unit,
    UnitLosses,
    merge_losses,
    plan_units,
    run_perplexity,
)
from hf_kvgov.evaluation.texts import Document, TextSource, load_documents
from hf_kvgov.registry import get_cache_spec
from tests.conftest import tiny_llama
from tests.evaluation.eval_tiny import TINY_KV_BYTES_PER_TOKEN, save_tiny_model

MODEL = tiny_llama()


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    """One intra-op thread: the cores are shared with other test processes, and two threads contending for
    a busy core make these small forwards several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def text_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def full_forward_losses(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Reference: one forward over the whole text, loss of every token after the first."""
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return F.cross_entropy(logits, ids[0, 1:], reduction="none").double()


def guide_sliding_window_mean_nll(model, ids: torch.Tensor, window: int, stride: int) -> float:  # type: ignore[no-untyped-def]
    """The loop of the transformers perplexity guide (labels masked with -100), tokens counted exactly.

    The guide counts ``(target_ids != -100).sum() - batch_size`` tokens per window, which is right for the first
    window only (its first label has no logit before it); later windows score all ``trg_len`` of their labels.
    Here the count is the labels the shifted loss really averages, so every token weighs the same.
    """
    seq_len, nll_sum, n_tokens, prev_end = ids.size(1), 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + window, seq_len)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.inference_mode():
            loss = model(input_ids, labels=target_ids, use_cache=False).loss
        num_loss_tokens = int((target_ids[:, 1:] != -100).sum())  # the model shifts labels by one
        nll_sum += float(loss) * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end = end
        if end == seq_len:
            break
    return nll_sum / n_tokens


@pytest.mark.parametrize(("length", "window", "stride"), [(130, 48, 16), (100, 40, 39), (57, 64, 32)])
def test_sliding_window_matches_the_transformers_guide(length: int, window: int, stride: int) -> None:
    ids = text_ids(length)
    losses = sliding_window_token_losses(MODEL, ids, window, stride)
    assert losses.shape == (length - 1,)
    assert float(losses.mean()) == pytest.approx(guide_sliding_window_mean_nll(MODEL, ids, window, stride), rel=1e-6)


def test_a_window_over_the_whole_text_is_the_full_forward() -> None:
    ids = text_ids(90, seed=1)
    torch.testing.assert_close(sliding_window_token_losses(MODEL, ids, 128, 64), full_forward_losses(MODEL, ids))


@pytest.mark.parametrize("chunk", [1, 7])
def test_dynamic_cache_in_the_loop_gives_the_full_forward_losses(chunk: int) -> None:
    ids = text_ids(64, seed=2)
    losses, caches = chunked_token_losses(MODEL, ids, [get_cache_spec("dynamic")], chunk)
    torch.testing.assert_close(losses[0], full_forward_losses(MODEL, ids), atol=1e-5, rtol=1e-5)
    assert caches[0].get_seq_length() == 63  # every token but the last was fed


def test_a_stacked_batch_scores_each_cache_as_if_alone() -> None:
    ids = text_ids(40, seed=3)
    names = ["dynamic", "paged@8", "int4@8"]
    together, _ = chunked_token_losses(MODEL, ids, [get_cache_spec(n) for n in names], 4)
    for row, name in enumerate(names):
        alone, _ = chunked_token_losses(MODEL, ids, [get_cache_spec(name)], 4)
        torch.testing.assert_close(together[row], alone[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(together[2], together[0])  # int4 does change the losses


def test_caches_with_their_own_attention_are_never_stacked() -> None:
    with pytest.raises(ValueError, match=r"The caches \['h2o@0.5'\] need their own attention"):
        chunked_token_losses(MODEL, text_ids(8), [get_cache_spec("dynamic"), get_cache_spec("h2o@0.5")], 1)


def test_units_batch_caches_that_can_share_and_isolate_the_others() -> None:
    options = PerplexityOptions(caches=("dynamic", "h2o@0.2", "int8", "paged", "int4"), rows=2, window=16)
    # Batch by batch over both documents, in the order of each batch's first cache: a cache's row is done
    # once its batch is, the reference's first (what Ctrl-C keeps).
    assert plan_units(2, options) == [
        Unit(0, "chunked", ("dynamic", "int8")),
        Unit(1, "chunked", ("dynamic", "int8")),
        Unit(0, "chunked", ("h2o@0.2",)),
        Unit(1, "chunked", ("h2o@0.2",)),
        Unit(0, "chunked", ("paged", "int4")),
        Unit(1, "chunked", ("paged", "int4")),
        Unit(0, SLIDING_WINDOW),
        Unit(1, SLIDING_WINDOW),
    ]


def test_pooling_by_hand() -> None:
    ln2 = math.log(2)
    pooled = [  # out of order, as processes return them
        UnitLosses(1, "a", [4.0, 5.0], 300),
        UnitLosses(0, "a", [1.0, 2.0, 3.0], 100),
        UnitLosses(0, "b", [1 + ln2, 2 + ln2, 3 + ln2], None),
        UnitLosses(1, "b", [4 + ln2, 5 + ln2], None),
    ]
    a, b = merge_losses(pooled, ["a", "b"], bin_tokens=2)
    assert (a.tokens, a.nll, a.perplexity) == (5, 3.0, pytest.approx(math.exp(3.0)))
    assert a.kv_bytes == 200.0 and a.bytes_per_token == pytest.approx(400 / 7)  # 4 + 3 tokens fed
    # Bin [0, 2) pools 1, 2 (document 0) and 4, 5 (document 1); bin [2, 3) holds only 3.
    assert [(p.start, p.stop, p.tokens, p.loss) for p in a.positions] == [(0, 2, 4, 3.0), (2, 3, 1, 3.0)]
    assert a.vs_reference_pct == 0.0 and b.vs_reference_pct == pytest.approx(100.0)  # every loss + ln 2: ppl x 2
    assert b.kv_bytes is None and b.bytes_per_token is None


def test_options_are_checked_before_any_model_work() -> None:
    with pytest.raises(ValueError, match="Unknown cache 'int3'"):
        PerplexityOptions(caches=("dynamic", "int3"))
    for stride in (16, 32):
        with pytest.raises(ValueError, match=f"window >= 2 and stride < window .*; got window=16 and stride={stride}"):
            PerplexityOptions(window=16, stride=stride)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer; got 0"):
        PerplexityOptions(chunk_tokens=0)


def test_text_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "first doc"}\n\n{"text": ""}\n{"text": "third"}\n', encoding="utf-8")
    docs = load_documents(TextSource(path=str(jsonl), jsonl_field="text"))
    assert [(d.name, d.text) for d in docs] == [("docs.jsonl:1", "first doc"), ("docs.jsonl:4", "third")]
    joined = load_documents(TextSource(path=str(jsonl), jsonl_field="text", join=True))
    assert [d.text for d in joined] == ["first doc\n\n\n\nthird"]
    assert len(load_documents(TextSource(path=str(jsonl), jsonl_field="text", max_documents=1))) == 1
    with pytest.raises(ValueError, match=r"line 1: expected an object with a string field 'body'; found \['text'\]"):
        load_documents(TextSource(path=str(jsonl), jsonl_field="body"))
    assert "Pride and Prejudice" in load_documents(TextSource())[0].text[:200]
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if `datasets` were not installed
    with pytest.raises(ImportError, match=r"needs the package 'datasets' \(`pip install datasets`\)"):
        load_documents(TextSource(dataset="wikitext", dataset_config="wikitext-2-raw-v1"))


def test_cli_writes_json_markdown_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man of good fortune must want a wife. " * 3)
    out, plots = tmp_path / "ppl.json", tmp_path / "plots"
    argv = ["eval", "ppl", "--model", str(model_dir), "--text", str(text), "--tokens", "120", "--chunk", "8"]
    argv += ["--caches", "dynamic,int8@8,h2o@0.5", "--bin", "50", "--json", str(out), "--plots", str(plots)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| cache | tokens | perplexity | vs dynamic % |" in printed and "| sliding-window | 119 |" in printed
    report = json.loads(out.read_text())
    assert report["command"] == "ppl" and report["processes"] == 1 and report["reference"] == "dynamic"
    assert report["documents"] == [{"name": "text.txt", "tokens": 120}]
    # Without --window the window is min(context 512, --tokens 120): one full forward over the text.
    assert report["options"]["window"] == 120 and report["options"]["stride"] == 60
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == ["dynamic", "int8@8", "h2o@0.5", "sliding-window"]
    dynamic, window = results["dynamic"], results["sliding-window"]
    assert dynamic["tokens"] == 119 and dynamic["vs_reference_pct"] == 0.0
    assert dynamic["nll"] == pytest.approx(window["nll"], rel=1e-6)  # both see the whole text before each token
    assert dynamic["kv_bytes"] == 119 * TINY_KV_BYTES_PER_TOKEN  # the last token is never fed
    assert window["kv_bytes"] is None
    assert results["h2o@0.5"]["kv_bytes"] < dynamic["kv_bytes"]  # a budget of 60 of the 120 tokens per head
    assert [(p["start"], p["stop"], p["tokens"]) for p in dynamic["positions"]] == [
        (0, 50, 50),
        (50, 100, 50),
        (100, 119, 19),
    ]
    for name in ("ppl_vs_kv_bytes.png", "ppl_loss_vs_position.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_bad_options_before_loading(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # passes the name check, but no model loads from it
    assert main(["eval", "ppl", "--model", str(tmp_path), "--caches", "dynamic,h2o@2.0"]) == 2
    assert "kvgov eval ppl: error: Cannot read the cache name 'h2o@2.0'" in capsys.readouterr().err


@pytest.mark.real_model
def test_dynamic_ppl_equals_smollm2_own_loss(smollm2, austen_text: str) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    text = austen_text[20_000:24_000]
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :512]
    assert ids.shape[1] == 512
    with torch.inference_mode():
        own = model(input_ids=ids, labels=ids, use_cache=False)
    own_loss = float(own.loss)
    reference = F.cross_entropy(own.logits[0, :-1].float(), ids[0, 1:], reduction="none").double()
    options = PerplexityOptions(caches=("dynamic",), chunk_tokens=32, max_tokens=512, window=None, bin_tokens=128)
    result = run_perplexity(model, tokenizer, [Document("austen", text)], options).results[0]
    assert result.tokens == 511
    assert result.nll == pytest.approx(own_loss, rel=1e-4)
    for position in result.positions:  # the same chunks of the text, loss for loss
        assert position.loss == pytest.approx(float(reference[position.start : position.stop].mean()), rel=1e-4)
    # Decode-faithful (one token per step) over the opening 32 tokens, too.
    losses, _ = chunked_token_losses(model, ids[:, :32], [get_cache_spec("dynamic")], 1)
    torch.testing.assert_close(losses[0], reference[:31], atol=2e-4, rtol=1e-4)
