"""Synthetic RULER-style tasks: determinism, length control, needle depth, independent answer checks."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from hf_kvgov.evaluation import registry
from hf_kvgov.evaluation.registry import (
    SyntheticTask,
    generate_synthetic,
    get_synthetic_task,
    register_synthetic_task,
    score_synthetic,
    synthetic_tasks,
)
from hf_kvgov.evaluation.synthetic import (
    CommonWordsConfig,
    NiahConfig,
    SyntheticSample,
    VariableTrackingConfig,
    generate_common_words,
    generate_niah,
    generate_variable_tracking,
    string_match_all,
    string_match_part,
)
from hf_kvgov.evaluation.synthetic.haystack import fit_to_length
from hf_kvgov.evaluation.synthetic.niah import VARIED_WORDINGS

ALL_TASKS = sorted(synthetic_tasks())
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def context_of(sample: SyntheticSample) -> str:
    """The haystack: RULER templates put it between the first and the last newline."""
    return sample.prompt[sample.prompt.index("\n") + 1 : sample.prompt.rindex("\n")]


def test_registry_lists_the_ruler_tasks() -> None:
    expected = sorted(
        [
            "passkey",
            "needles",
            "niah_single",
            "niah_single_uuid",
            "niah_multikey",
            "niah_multikey_uuid",
            "niah_multivalue",
            "niah_multiquery",
            "variable_tracking",
            "common_words",
        ]
    )
    assert expected == ALL_TASKS
    with pytest.raises(ValueError, match="Unknown synthetic task 'niah'"):
        get_synthetic_task("niah")
    with pytest.raises(ValueError, match="already registered"):
        register_synthetic_task(get_synthetic_task("passkey"))


@pytest.mark.parametrize("name", ALL_TASKS)
def test_same_seed_same_sample_other_seed_other_sample(name: str, filler: str, whitespace_tokenizer: object) -> None:
    task = get_synthetic_task(name)
    first = task.make(filler, whitespace_tokenizer, 1500, 11)  # type: ignore[arg-type]
    again = task.make(filler, whitespace_tokenizer, 1500, 11)  # type: ignore[arg-type]
    other = task.make(filler, whitespace_tokenizer, 1500, 12)  # type: ignore[arg-type]
    assert first == again
    assert first.prompt != other.prompt and first.answers != other.answers
    assert first.task == name and first.seed == 11


@pytest.mark.parametrize("name", ALL_TASKS)
@pytest.mark.parametrize("target", [1000, 8000])
def test_prompt_hits_the_target_length(name: str, target: int, filler: str, whitespace_tokenizer: object) -> None:
    sample = get_synthetic_task(name).make(filler, whitespace_tokenizer, target, 3)  # type: ignore[arg-type]
    measured = len(sample.prompt.split())
    assert sample.length == measured and sample.target_length == target
    # One filler word is one token; one more rare word in common_words adds (repeats x 2) tokens.
    slack = 2 * 3 if name == "common_words" else 1
    assert target - slack < measured <= target


def test_long_prompt_hits_32k(filler: str, whitespace_tokenizer: object) -> None:
    sample = get_synthetic_task("niah_single").make(filler, whitespace_tokenizer, 32_000, 5)  # type: ignore[arg-type]
    assert 31_999 <= len(sample.prompt.split()) <= 32_000


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_needle_sits_at_the_requested_depth(depth: float, filler: str, whitespace_tokenizer: object) -> None:
    sample = generate_niah(filler, whitespace_tokenizer, 4000, 1, NiahConfig(depths=(depth,)))  # type: ignore[arg-type]
    context = context_of(sample)
    (value,) = sample.answers
    needle_start = context.index("One of the special magic numbers")
    needle = context[needle_start : context.index(value) + len(value) + 1]
    before = len(context[:needle_start].split())
    total = len(context.split()) - len(needle.split())
    assert abs(before / total - depth) <= 0.02
    assert sample.depths == (depth,)


def test_single_needle_prompt_text(filler: str, whitespace_tokenizer: object) -> None:
    sample = get_synthetic_task("niah_single").make(filler, whitespace_tokenizer, 1000, 4)  # type: ignore[arg-type]
    (value,) = sample.answers
    assert re.fullmatch(r"\d{7}", value)
    key = re.search(r"for (\S+) is: " + value, sample.prompt).group(1)  # type: ignore[union-attr]
    assert sample.prompt.startswith("A special magic number is hidden within the following text.")
    assert sample.prompt.endswith(f"What is the special magic number for {key} mentioned in the provided text?")
    assert sample.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert value not in filler and sample.prompt.count(value) == 1


def test_passkey_prompt(filler: str, whitespace_tokenizer: object) -> None:
    sample = get_synthetic_task("passkey").make(filler, whitespace_tokenizer, 1000, 4)  # type: ignore[arg-type]
    (value,) = sample.answers
    assert f"The pass key is {value}. Remember it. {value} is the pass key." in sample.prompt
    assert sample.prompt.endswith("What is the pass key?")


def test_needles_vary_wording_digits_and_depth_and_plant_one_answer(filler: str, whitespace_tokenizer: object) -> None:
    task = get_synthetic_task("needles")
    samples = [task.make(filler, whitespace_tokenizer, 1500, seed) for seed in range(40)]  # type: ignore[arg-type]
    wordings = {tuple(sample.answer_prefix.split()[:2]) for sample in samples}  # "The pass", "The access", ...
    assert len(wordings) == len(VARIED_WORDINGS) == 5  # every wording drawn
    assert {len(sample.answers[0]) for sample in samples} == {5, 6, 7, 8}
    depths = [sample.depths[0] for sample in samples]
    assert min(depths) < 0.2 and max(depths) > 0.8 and len(set(depths)) > 30
    for sample in samples:
        (code,) = sample.answers
        assert code.isdigit() and sample.prompt.count(code) == (2 if "pass key" in sample.prompt else 1)
        assert code not in filler


def test_multikey_asks_one_key_among_distractors(filler: str, whitespace_tokenizer: object) -> None:
    sample = get_synthetic_task("niah_multikey").make(filler, whitespace_tokenizer, 2000, 9)  # type: ignore[arg-type]
    needles = dict(re.findall(r"for (\S+) is: (\d{7})\.", context_of(sample)))
    assert len(needles) == 4 and len(sample.answers) == 1
    asked = re.search(r"magic number for (\S+) mentioned", sample.prompt.rsplit("\n", 1)[1]).group(1)  # type: ignore[union-attr]
    assert sample.answers == (needles[asked],)
    distractors = " ".join(v for k, v in needles.items() if k != asked)
    assert string_match_all(distractors, sample.answers) == 0.0


def test_multikey_uuid_uses_uuids(filler: str, whitespace_tokenizer: object) -> None:
    sample = get_synthetic_task("niah_multikey_uuid").make(filler, whitespace_tokenizer, 2000, 9)  # type: ignore[arg-type]
    assert UUID.match(sample.answers[0])
    assert len(re.findall(r"special magic uuids for [0-9a-f-]{36} is: [0-9a-f-]{36}\.", sample.prompt)) == 4


def test_multivalue_and_multiquery_answers(filler: str, whitespace_tokenizer: object) -> None:
    multivalue = get_synthetic_task("niah_multivalue").make(filler, whitespace_tokenizer, 2000, 2)  # type: ignore[arg-type]
    keys_in_needles = set(re.findall(r"for (\S+) is: \d{7}\.", multivalue.prompt))
    assert len(multivalue.answers) == 4 and len(keys_in_needles) == 1
    assert "What are all the special magic numbers for" in multivalue.prompt
    # Recall: two of four values named -> 0.5.
    assert string_match_all(" ".join(multivalue.answers[:2]), multivalue.answers) == 0.5
    multiquery = get_synthetic_task("niah_multiquery").make(filler, whitespace_tokenizer, 2000, 2)  # type: ignore[arg-type]
    assert sorted(multiquery.answers) == sorted(re.findall(r"is: (\d{7})\.", multiquery.prompt))
    assert ", and " in multiquery.prompt.rsplit("\n", 1)[1]


def resolve_assignments(text: str) -> dict[str, str]:
    """Brute-force reference: follow every 'VAR X = ...' statement to a number."""
    direct = dict(re.findall(r"VAR ([A-Z]+) = (\d+)\.", text))
    links = dict(re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)\.", text))
    values = dict(direct)
    while len(values) < len(direct) + len(links):
        for target, source in links.items():
            if source in values:
                values[target] = values[source]
    return values


def test_variable_tracking_answers_match_a_brute_force_resolution(filler: str, whitespace_tokenizer: object) -> None:
    config = VariableTrackingConfig(num_chains=3, num_hops=4)
    sample = generate_variable_tracking(filler, whitespace_tokenizer, 3000, 8, config)  # type: ignore[arg-type]
    query = re.search(r"assigned the value (\d+) in the text above", sample.prompt).group(1)  # type: ignore[union-attr]
    values = resolve_assignments(context_of(sample))
    assert len(values) == 15
    assert sorted(sample.answers) == sorted(name for name, value in values.items() if value == query)
    # Each assignment comes after the statement it reads from.
    for target, source in re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)\.", sample.prompt):
        assert sample.prompt.index(f"VAR {source} =") < sample.prompt.index(f"VAR {target} =")
    others = " ".join(name for name, value in values.items() if value != query)
    assert string_match_all(others, sample.answers) == 0.0


def test_common_words_answers_are_the_most_frequent_listed_words(filler: str, whitespace_tokenizer: object) -> None:
    sample = generate_common_words(filler, whitespace_tokenizer, 5000, 6)  # type: ignore[arg-type]
    listing = re.findall(r"(\d+)\. (\S+)", context_of(sample))
    assert [int(number) for number, _ in listing] == list(range(1, len(listing) + 1))
    counts = Counter(word for _, word in listing)
    top = counts.most_common(11)
    assert {word for word, _ in top[:10]} == set(sample.answers)
    # From 4096 tokens on: common words 30 times, rare ones 3 times (RULER).
    assert top[9][1] == 30 and top[10][1] == 3
    assert "What are the 10 most common words in the above list?" in sample.prompt


def test_common_words_short_prompts_use_fewer_repeats(filler: str, whitespace_tokenizer: object) -> None:
    sample = generate_common_words(filler, whitespace_tokenizer, 1500, 6, CommonWordsConfig(num_common=5))  # type: ignore[arg-type]
    counts = Counter(re.findall(r"\d+\. (\S+)", sample.prompt)).most_common(6)
    assert len(sample.answers) == 5 and counts[4][1] == 6 and counts[5][1] == 1


@pytest.mark.parametrize("name", ALL_TASKS)
def test_scorer_gives_truth_one_and_wrong_answer_zero(name: str, filler: str, whitespace_tokenizer: object) -> None:
    task = get_synthetic_task(name)
    sample = task.make(filler, whitespace_tokenizer, 1200, 21)  # type: ignore[arg-type]
    assert task.score(" ".join(sample.answers), sample.answers) == 1.0
    assert task.score(" ".join(sample.answers).upper(), sample.answers) == 1.0
    assert task.score("I could not find it in the text.", sample.answers) == 0.0


def test_string_match_scorers() -> None:
    assert string_match_all("The values are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_part("The value is 456.", ["123", "456"]) == 1.0
    assert string_match_part("none", ["123", "456"]) == 0.0


def test_generate_and_score_a_batch(filler: str, whitespace_tokenizer: object) -> None:
    samples = generate_synthetic("niah_single", filler, whitespace_tokenizer, 1000, 3, seed=5)  # type: ignore[arg-type]
    assert samples == generate_synthetic("niah_single", filler, whitespace_tokenizer, 1000, 3, seed=5)  # type: ignore[arg-type]
    assert len({s.answers for s in samples}) == 3
    predictions = [samples[0].answers[0], "no idea", samples[2].answers[0]]
    # (1 + 0 + 1) / 3 -> 66.67.
    assert score_synthetic("niah_single", predictions, samples) == 66.67
    with pytest.raises(ValueError, match="one prediction per sample"):
        score_synthetic("niah_single", predictions[:2], samples)


def test_invalid_requests_are_clear_errors(filler: str, whitespace_tokenizer: object) -> None:
    with pytest.raises(ValueError, match="shorter than the task's fixed text"):
        generate_niah(filler, whitespace_tokenizer, 20, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one word"):
        generate_niah("   ", whitespace_tokenizer, 1000, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_queries"):
        NiahConfig(num_keys=1, num_queries=2)
    with pytest.raises(ValueError, match="one entry per needle"):
        NiahConfig(num_keys=2, depths=(0.5,))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        NiahConfig(depths=(1.5,))
    with pytest.raises(ValueError, match="Unknown key/value kind"):
        NiahConfig(value_kind="emoji")
    with pytest.raises(TypeError, match="tokenizer-like"):
        generate_niah(filler, object(), 1000, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        generate_niah(filler, whitespace_tokenizer, 1000, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive number of tokens"):
        generate_common_words(filler, whitespace_tokenizer, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too few distinct words"):
        generate_common_words("one two three", whitespace_tokenizer, 1000, 0)  # type: ignore[arg-type]


def test_custom_task_registration(filler: str, whitespace_tokenizer: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_SYNTHETIC", dict(registry._SYNTHETIC))  # undone after the test
    task = SyntheticTask("test_passkey_deep", get_synthetic_task("passkey").generate, string_match_all, "test")
    register_synthetic_task(task, replace=True)
    sample = get_synthetic_task("test_passkey_deep").make(filler, whitespace_tokenizer, 800, 1)  # type: ignore[arg-type]
    assert sample.task == "test_passkey_deep" and "pass key" in sample.prompt


@pytest.mark.parametrize("growth", ["linear", "quadratic", "steps"])
def test_length_search_finds_the_largest_fitting_size(growth: str, whitespace_tokenizer: object) -> None:
    words_for = {
        "linear": lambda n: 7 + 3 * n,
        "quadratic": lambda n: 7 + n * n,
        "steps": lambda n: 7 + 10 * (n // 4),
    }[growth]

    def render(size: int) -> str:
        return "w " * words_for(size)

    for target in [7, 8, 50, 999, 1000, 4321]:
        text, length = fit_to_length(render, whitespace_tokenizer, target, 10_000, "exhausted")  # type: ignore[arg-type]
        brute = max(n for n in range(2_000) if words_for(n) <= target)
        assert (text, length) == (render(brute), words_for(brute)), target
    with pytest.raises(ValueError, match="exhausted"):
        fit_to_length(render, whitespace_tokenizer, 10**6, 20, "exhausted")  # type: ignore[arg-type]
