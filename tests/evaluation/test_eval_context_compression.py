"""`--compress context` (kvpress's protocol): a cache compresses a prompt's context before its question is seen.

Checked here: every synthetic task and LongBench template splits where its question starts; a policy compresses
the context alone and appends the question and the answer; a lossless cache, a budget above the length and
KVzip keeping everything give the whole-prompt run's answers on the tiny model; `kvzip@...` runs only so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_kvgov.cli.eval import COMPRESS_CHOICES
from hf_kvgov.cli.main import main
from hf_kvgov.evaluation import synthetic_run
from hf_kvgov.evaluation.generation import COMPRESS_INPUTS, generate_greedy
from hf_kvgov.evaluation.longbench import run as longbench_run
from hf_kvgov.evaluation.longbench.data import load_task
from hf_kvgov.evaluation.longbench.prompts import build_question, prepare_prompt
from hf_kvgov.evaluation.registry import generate_synthetic, synthetic_tasks
from hf_kvgov.evaluation.synthetic_run import SyntheticOptions
from hf_kvgov.registry import get_cache_spec
from tests.conftest import tiny_llama
from tests.evaluation.conftest import FILLER
from tests.evaluation.eval_tiny import LONGBENCH_DIR, save_tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("task", list(synthetic_tasks()))
def test_a_synthetic_prompt_ends_with_its_question_and_holds_the_answers_before_it(task: str) -> None:
    for seed in (0, 1):
        sample = generate_synthetic(task, FILLER * 8, tiny_tokenizer(), 900, 1, seed)[0]
        context = sample.prompt.removesuffix(sample.question)
        assert sample.question.strip() and context != sample.prompt
        assert all(answer in context for answer in sample.answers)
        assert len(sample.question) < 200 and sample.question.count("\n") == 1  # one line: the question alone
        # What follows the context is the template's question alone: no sentence of the haystack.
        assert not any(sentence in sample.question for sentence in FILLER.split(". ") if sentence.strip())


def test_a_longbench_prompt_splits_where_its_template_puts_the_question() -> None:
    tokenizer = tiny_tokenizer(chat=True)
    for task in ("hotpotqa", "trec", "samsum"):
        for sample in load_task(LONGBENCH_DIR, task):
            prompt = prepare_prompt(task, sample, tokenizer, 4096)
            question = build_question(task, sample)
            assert prompt.context_chars is not None
            assert prompt.text[prompt.context_chars :].startswith(question.strip())
            assert sample.context[-20:] in prompt.text[: prompt.context_chars]
    # A middle cut that takes part of the question leaves no context to compress apart from it.
    sample = load_task(LONGBENCH_DIR, "hotpotqa")[0]
    assert prepare_prompt("hotpotqa", sample, tokenizer, 80).context_chars is None


def test_a_policy_compresses_the_context_alone_and_appends_the_question_and_the_answer() -> None:
    model = tiny_llama()
    ids = torch.randint(4, 90, (1, 120), generator=torch.Generator().manual_seed(0))
    spec = get_cache_spec("snapkv@0.5")
    cache = spec.context_cache(model, tiny_tokenizer(), ids[:, :100])
    before = cache.stats()
    assert before.tokens_seen == 100
    assert {n for layer in before.kept for n in layer} == {50}  # half of the context, per KV head
    with spec.attention(model), torch.inference_mode():
        model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    after = cache.stats()
    assert after.tokens_seen == 123
    assert {n for layer in after.kept for n in layer} == {50 + 20 + 3}  # the question and answer, all kept
    # The whole prompt given to generate: half of it is kept, and every step evicts back to that.
    whole = spec.build(model)
    with spec.attention(model), torch.inference_mode():
        model.generate(input_ids=ids, cache=whole, max_new_tokens=4, do_sample=False)
    assert {n for layer in whole.stats().kept for n in layer} == {60}


def test_the_context_split_changes_no_answer_of_a_cache_that_keeps_everything(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny", chat=True)
    reports = {}
    for compress, caches in (("prompt", "dynamic"), ("context", "dynamic,paged@8,snapkv@4096,kvzip@1.0")):
        out = tmp_path / f"{compress}.json"
        argv = ["eval", "synthetic", "--model", str(model_dir), "--tasks", "passkey,variable_tracking"]
        argv += ["--lengths", "300", "--samples", "2", "--caches", caches, "--compress", compress]
        assert main([*argv, "--max-new-tokens", "6", "--json", str(out)]) == 0
        reports[compress] = json.loads(out.read_text())
    assert reports["context"]["options"]["compress"] == "context"
    by_cache: dict[str, list[str]] = {}
    for report in reports.values():
        for sample in report["samples"]:
            by_cache.setdefault(sample["cache"], []).append(sample["prediction"])
    whole = [s["prediction"] for s in reports["prompt"]["samples"]]
    assert len(whole) == 4 and len(by_cache["dynamic"]) == 8
    for cache in ("paged@8", "snapkv@4096", "kvzip@1.0"):
        assert by_cache[cache] == whole, cache
    assert by_cache["dynamic"] == whole * 2


def test_kvzip_runs_only_where_a_context_comes_apart_from_its_question(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert COMPRESS_CHOICES == COMPRESS_INPUTS
    refusal = r"'kvzip@0.2' compresses a context before its question is known \(KVzip\).*--compress context"
    with pytest.raises(ValueError, match=refusal):
        get_cache_spec("kvzip@0.2")
    with pytest.raises(ValueError, match=refusal):
        SyntheticOptions(caches=("kvzip@0.2",))
    with pytest.raises(ValueError, match=refusal):
        get_cache_spec("kvzip@0.2", context=True).build(tiny_llama())
    with pytest.raises(ValueError, match="compress must be one of prompt, context; got 'question'"):
        SyntheticOptions(compress="question")
    with pytest.raises(ValueError, match="the codec after ':' must be one of"):
        get_cache_spec("kvzip@0.2:int3", context=True)
    model_dir = save_tiny_model(tmp_path / "tiny")
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(model_dir), "--caches", "kvzip@0.2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvgov eval ppl: error: The cache 'kvzip@0.2'") and "\n" not in err


def test_the_context_is_the_tokens_it_shares_with_the_whole_prompt() -> None:
    model, tokenizer = tiny_llama(), tiny_tokenizer()
    spec = get_cache_spec("dynamic")
    with pytest.raises(ValueError, match=r"The context must be a part of the prompt \(5 characters\); got 5"):
        generate_greedy(model, tokenizer, spec, "abcde", 2, context_chars=5)
    with pytest.raises(ValueError, match=r"The context must be a part of the prompt \(5 characters\); got 0"):
        generate_greedy(model, tokenizer, spec, "abcde", 2, context_chars=0)
    whole = generate_greedy(model, tokenizer, spec, "abcdefgh", 3)
    split = generate_greedy(model, tokenizer, spec, "abcdefgh", 3, context_chars=5)
    assert split == whole


def test_longbench_splits_every_sample_before_it_generates_any(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny", chat=True)
    reports = {}
    for compress, caches in (("prompt", "dynamic"), ("context", "dynamic,paged@8,snapkv@4096")):
        out = tmp_path / f"{compress}.json"
        argv = ["eval", "longbench", "--model", str(model_dir), "--data", str(LONGBENCH_DIR)]
        argv += ["--tasks", "hotpotqa,trec", "--caches", caches, "--compress", compress, "--max-new-tokens", "4"]
        assert main([*argv, "--json", str(out)]) == 0
        reports[compress] = json.loads(out.read_text())
    whole = {s["id"]: s["prediction"] for s in reports["prompt"]["samples"]}
    for cache in ("dynamic", "paged@8", "snapkv@4096"):
        assert {s["id"]: s["prediction"] for s in reports["context"]["samples"] if s["cache"] == cache} == whole
    # A middle cut into the questions: refused up front, naming the samples, before any generation.
    monkeypatch.setattr(longbench_run, "generate_greedy", lambda *args, **kwargs: pytest.fail("generated"))
    items = longbench_run.load_items(["hotpotqa"], data_dir=LONGBENCH_DIR)
    options = longbench_run.LongBenchOptions(caches=("dynamic",), max_length=80, compress="context")
    with pytest.raises(ValueError, match=r"3 LongBench sample\(s\) have no context before their question.*hotpotqa"):
        longbench_run.run_longbench(tiny_llama(), tiny_tokenizer(chat=True), items, options)


def test_a_synthetic_sample_without_a_question_is_refused_before_any_generation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(synthetic_run, "generate_greedy", lambda *args, **kwargs: pytest.fail("generated"))
    passkey = generate_synthetic("passkey", FILLER * 8, tiny_tokenizer(), 600, 1, 0)[0]
    unsplit = dataclasses.replace(passkey, task="my_task", question="")  # a task registered without one
    items = [synthetic_run.SyntheticItem(0, passkey), synthetic_run.SyntheticItem(1, unsplit)]
    options = SyntheticOptions(caches=("dynamic",), compress="context")
    with pytest.raises(ValueError, match="The samples of 'my_task' name no question after their context"):
        synthetic_run.run_synthetic(tiny_llama(), tiny_tokenizer(), items, options)
