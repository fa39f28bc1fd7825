"""One conformance battery: every registered cache name through the same properties, on the tiny random Llama.

Names are read from the registry when this module is imported, so a name registered later is covered without
editing this file:

- every fixed name (`registry.CACHES`);
- every example a family's syntax or the registry's docstring gives (`h2o@0.2`, `sink@4+252:int8`, `int8@64`,
  `quant@map.json`, ...);
- for every family, its grammar (`h2o@<budget>[:<codec>][+recall][+pyramid][+ada]`) filled in at the tiny
  model's scale twice: without the optional parts (`h2o@0.2`, `int8@8`, `disk@8`, `sink@2+6`) and with all of
  them (`h2o@0.2:int8+recall+pyramid+ada`); `<codec>` takes each slot codec in turn over the families that
  accept one, so every codec runs. A placeholder this file cannot size fails `test_every_family_is_sized`.

A name whose argument is a file (`quant@<map.json>`) gets that file written into the test's tmp_path, and every
spill file (disk tiers, recall pages) is made in a tmp_path directory that must be empty again after `release()`.
Nothing is downloaded and no server is needed: no registered name uses a remote tier.

Properties, per name (one test function each, so a failure names the property):

1. a greedy batch of two left-padded prompts of different lengths (40 and 32 tokens, 8 new): rows never
   interact, so every step of each row equals that row fed alone (its padding and positions included) to a
   fresh cache of the same name, a token per forward;
2. beam search (`num_beams=3`: with 2 the random model's beams rarely swap, and a cache that does not reorder
   slips through): a beam's cache state is its own tokens', so each returned beam's score equals its tokens
   re-scored alone by a fresh cache of the same name. No registered cache refuses beams (block
   stores share blocks copy on write, eviction caches reorder every per-slot tensor); a cache class that ever
   does goes in `BEAM_REFUSALS` with its message, and must then raise ValueError or NotImplementedError before
   it stores a token;
3. crop then continue, where the cache says it can (`is_croppable`, transformers' flag); a cache that says it
   cannot (eviction caches: evicted tokens cannot come back) must refuse `crop` with a ValueError or
   NotImplementedError naming crop, change nothing, and keep working; a lossless name must be croppable;
4. `reset()` then generate again gives the first run's tokens, and a reset cache holds no pool block;
5. `release()` frees every byte: no token, no stats byte, no pool block (sealed ones included), no spill file;
6. the stats' byte count equals the pool's own count of bytes in use, where the cache has a pool (for an
   eviction cache without one, its bytes add up as its stats document).

Lossless names (`CacheSpec.lossless`: the registry's own mark) must give exactly DynamicCache's greedy and beam
tokens, with logits within 1e-5, and crop then continue must equal DynamicCache's forward. Lossy names only get
the bound that holds by construction on any model: the prompt's step attends uncompressed K/V (a codec seals
blocks after the step's last layer read them, an eviction policy evicts at the commit after attention, recall
has nothing evicted yet), so the first step's logits equal DynamicCache's (within 1e-4: the eviction attention is
another kernel) and so does every row's first token. Nothing after that step is guaranteed on random weights:
how close lossy caches stay is measured on trained models elsewhere (tests/quantized, tests/eviction and the
real-model tests with their thresholds, eval/RESULTS.md), not here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import CacheStats, EvictionStats, KVStats, QuantConfig, QuantizedBlockPool, registry
from hf_kvgov.registry import CACHES, FAMILIES, SLOT_CODECS, get_cache_spec
from tests.conftest import tiny_llama
from tests.eviction.test_kvzip import CharTokenizer

# ------------------------------------------------------------------ the names

# What each placeholder of a family's grammar becomes on the tiny model (prompts of 40 tokens): budgets and
# windows that evict, blocks and hot windows small enough that blocks are sealed and spilled.
PLACEHOLDER_VALUES = {
    "budget": "0.2",
    "sinks": "2",
    "window": "6",
    "block size": "8",
    "hot tokens": "8",
    "map.json": "map.json",
}
# Files a name may refer to (written into the test's tmp_path): a per-layer format map for the 2-layer model.
FILE_CONTENTS = {
    "map.json": {"quant_config": QuantConfig(layer_formats={0: "int4", 1: "int8"}).to_json()},
}
_PLACEHOLDER = re.compile(r"<([^<>]+)>")
_GRAMMAR = r"(?:<[^<>]+>|\[[^\[\]]+\]|[^\s,;()<\[`])+"  # placeholders, [optional parts], literal characters
_OPTIONAL = re.compile(r"\[[^\[\]]*\]")


def _examples(text: str, family: str) -> list[str]:
    """The concrete names of `family` that `text` gives as examples (placeholders excluded)."""
    return [name.rstrip(".:") for name in re.findall(rf"(?<![\w@])({re.escape(family)}@[^\s,;()<>\[\]`]+)", text)]


def _fill(form: str, codec: str) -> str | None:
    """`form` with its placeholders sized for the tiny model; None if one is not in `PLACEHOLDER_VALUES`."""
    try:
        return _PLACEHOLDER.sub(lambda m: codec if m.group(1) == "codec" else PLACEHOLDER_VALUES[m.group(1)], form)
    except KeyError:
        return None


def _battery() -> tuple[list[str], list[str], set[str]]:
    """(every name to run, in registry order; the families whose grammar could not be sized; the families whose
    argument is a file)."""
    names = dict.fromkeys(CACHES)
    unsized: list[str] = []
    file_families: set[str] = set()
    codecs = itertools.cycle(SLOT_CODECS)
    for family in FAMILIES.values():
        for text in (family.syntax, registry.__doc__ or ""):
            names.update(dict.fromkeys(_examples(text, family.name)))
        match = re.search(rf"(?<![\w@]){re.escape(family.name)}@({_GRAMMAR})", family.syntax)
        if match is None:
            unsized.append(family.name)
            continue
        form = match.group(1)
        if any("." in placeholder for placeholder in _PLACEHOLDER.findall(form)):
            file_families.add(family.name)
        codec = next(codecs) if "<codec>" in form else ""
        shortest = _fill(_OPTIONAL.sub("", form), codec)
        longest = _fill(form.replace("[", "").replace("]", ""), codec)
        if shortest is None or longest is None:
            unsized.append(family.name)
            continue
        names.update(dict.fromkeys(f"{family.name}@{argument}" for argument in (shortest, longest)))
    return list(names), unsized, file_families


EVERY_NAME, UNSIZED_FAMILIES, FILE_FAMILIES = _battery()
# A name that compresses a context before its question is known (`kvzip@...`) is built from that context, never from
# generate's prompt, so the properties above do not apply to it: `test_a_context_cache_*` below checks it instead.
CONTEXT_NAMES = [
    name
    for name in EVERY_NAME
    if "@" in name and name.partition("@")[0] not in FILE_FAMILIES and get_cache_spec(name, context=True).needs_context
]
NAMES = [name for name in EVERY_NAME if name not in CONTEXT_NAMES]

# Cache classes that refuse beam search, by class name -> the message they refuse with (none today).
BEAM_REFUSALS: dict[str, str] = {}

# ------------------------------------------------------------------ inputs and the reference

PROMPT_LEN, SHORT_LEN, NEW_TOKENS = 40, 32, 8
# Beam scores as plain sums of log-probabilities (no length penalty), so one row's tokens can be re-scored.
BEAM_SEARCH = {"num_beams": 3, "length_penalty": 0.0, "output_scores": True}
CROP_CHUNKS, CROP_TOKENS = (32, 8), 21  # prefilled in two steps (the second spills); 21 cropped: into sealed blocks


def _prompts() -> dict[str, torch.Tensor]:
    """Two prompts, of 40 and 32 tokens: the second left-padded with the pad id 0 (tokens are 3..95, no EOS)."""
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 96, (2, PROMPT_LEN), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, : PROMPT_LEN - SHORT_LEN], mask[1, : PROMPT_LEN - SHORT_LEN] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


PROMPTS = _prompts()
CROP_IDS = torch.randint(3, 96, (2, sum(CROP_CHUNKS)), generator=torch.Generator().manual_seed(12))


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    """The tiny random-weight Llama of tests/conftest.py, on one thread (two stall each other on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llama()
    torch.set_num_threads(threads)


def _generate(model: Any, spec: Any, cache: Any, **kwargs: Any) -> Any:
    with spec.attention(model), torch.inference_mode():
        return model.generate(
            **PROMPTS,
            cache=cache,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )


def _teacher_forced(model: Any, spec: Any, row: int, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits before each of `tokens`, when a fresh cache of `spec` takes prompt `row` alone (its padding and
    the positions generate gives it included), then the tokens one forward each."""
    cache = spec.build_for(model, PROMPT_LEN)  # outside generate, a fraction resolves on the prompt's length
    mask = PROMPTS["attention_mask"][row : row + 1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with spec.attention(model), torch.inference_mode():
        step = model(PROMPTS["input_ids"][row : row + 1], attention_mask=mask, position_ids=positions, cache=cache)
        for token in tokens[:-1].tolist():  # the last token is never fed back
            logits.append(step.logits[0, -1])
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
            step = model(torch.tensor([[token]]), attention_mask=mask, position_ids=positions, cache=cache)
        logits.append(step.logits[0, -1])
    release = getattr(cache, "release", None)
    if callable(release):
        release()
    return logits


@dataclass(frozen=True)
class Reference:
    greedy: Any
    beams: Any
    crop_logits: torch.Tensor  # DynamicCache's logits for CROP_IDS in one forward


@pytest.fixture(scope="module")
def reference(model: Any) -> Reference:
    dynamic = get_cache_spec("dynamic")
    with torch.inference_mode():
        crop_logits = model(CROP_IDS, cache=DynamicCache(config=model.config)).logits
    return Reference(
        greedy=_generate(model, dynamic, DynamicCache(config=model.config)),
        beams=_generate(model, dynamic, DynamicCache(config=model.config), **BEAM_SEARCH),
        crop_logits=crop_logits,
    )


# ------------------------------------------------------------------ one cache per test


@dataclass
class Case:
    name: str
    spec: Any
    cache: Any
    spill_dir: Path


def _resolve(name: str, tmp_path: Path) -> str:
    """The name as the registry must read it: a file argument is written into tmp_path first."""
    family, _, argument = name.partition("@")
    if family not in FILE_FAMILIES:
        return name
    path = tmp_path / argument
    path.write_text(json.dumps(FILE_CONTENTS[Path(argument).name]), encoding="utf-8")
    return f"{family}@{path}"


@pytest.fixture(params=NAMES)
def case(request: pytest.FixtureRequest, model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Case]:
    name = request.param
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill_dir))  # disk tiers and recall pages spill here
    spec = get_cache_spec(_resolve(name, tmp_path))
    built = Case(name, spec, spec.build(model), spill_dir)
    yield built
    release = getattr(built.cache, "release", None)
    if callable(release):  # a failed test still gives its blocks, threads and files back
        with contextlib.suppress(Exception):
            release()


# ------------------------------------------------------------------ accounting helpers


def _pool(cache: Any) -> Any:
    return getattr(cache, "pool", None)


def _pool_bytes(pool: Any) -> int:
    """Bytes the pool itself counts in use: its blocks, and a quantized pool's sealed blocks."""
    used = pool.stats().bytes_used
    return used + (pool.sealed_stats().bytes_used if isinstance(pool, QuantizedBlockPool) else 0)


def _pool_blocks(pool: Any) -> int:
    used = pool.stats().used_blocks
    return used + (pool.sealed_stats().used_blocks if isinstance(pool, QuantizedBlockPool) else 0)


def _stats_pool_bytes(stats: Any) -> int:
    """The part of a cache's stats bytes that lives in its pool's blocks."""
    if isinstance(stats, EvictionStats):
        return stats.kv_bytes  # positions, validity, mass and recall's pages are tensors beside the pool
    return stats.bytes_used - getattr(stats, "read_buffer_bytes", 0)  # a disk tier's read-ahead rows are not blocks


def _assert_accounting(cache: Any) -> None:
    """Property 6 at this moment: the stats' shared figures, and their bytes are the pool's bytes in use (or add up,
    without a pool)."""
    if not hasattr(cache, "stats"):
        assert type(cache) is DynamicCache, f"only the reference may lack stats(); {type(cache).__name__} does"
        return
    stats = cache.stats()
    # One record shape: the figures every cache's stats share, whatever else its record holds.
    assert isinstance(stats, KVStats), f"{type(cache).__name__}.stats() returns {type(stats).__name__}, not a KVStats"
    assert stats.tokens == stats.sequences * cache.get_seq_length() > 0
    assert stats.bytes_per_token == stats.bytes_used / stats.tokens
    pool = _pool(cache)
    if pool is not None:
        assert _stats_pool_bytes(stats) == _pool_bytes(pool), (stats, pool.stats())
    else:
        assert isinstance(stats, EvictionStats), f"{type(cache).__name__} stores blocks without a pool"
        assert stats.bytes_used == stats.kv_bytes + stats.metadata_bytes + stats.recall_bytes


def _assert_prefill_bound(got: Any, expected: Any, greedy: bool) -> None:
    """Lossy names: the prompt's step attends uncompressed K/V, so its logits are DynamicCache's, and so is each
    row's first greedy token (a beam's first token is not: a later step may rank another beam first)."""
    torch.testing.assert_close(got.logits[0], expected.logits[0], atol=1e-4, rtol=1e-4)
    if greedy:
        assert torch.equal(got.sequences[:, PROMPT_LEN], expected.sequences[:, PROMPT_LEN])


def _assert_same_run(got: Any, expected: Any) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.logits) == len(expected.logits)
    for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)


def _assert_shape(out: Any, rows: int) -> None:
    assert out.sequences.shape == (rows, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(out.sequences[:, :PROMPT_LEN], PROMPTS["input_ids"][:rows])


# ------------------------------------------------------------------ the battery


def test_every_family_is_sized() -> None:
    assert UNSIZED_FAMILIES == [], f"add their placeholders to PLACEHOLDER_VALUES: {UNSIZED_FAMILIES}"


def test_every_registered_name_and_family_is_in_the_battery() -> None:
    assert set(CACHES) <= set(NAMES)
    assert {name.partition("@")[0] for name in NAMES + CONTEXT_NAMES if "@" in name} == set(FAMILIES)
    assert CONTEXT_NAMES  # kvzip@...


@pytest.mark.parametrize("name", CONTEXT_NAMES)
def test_a_context_cache_is_refused_for_a_whole_prompt_and_built_from_its_context(name: str, model: Any) -> None:
    """Refused wherever a prompt is whole; built from a context it holds that context's slots within its budget,
    generate appends the question and the answer, its stats add up, and `reset` empties it."""
    with pytest.raises(ValueError, match="compresses a context before its question is known"):
        get_cache_spec(name)
    spec = get_cache_spec(name, context=True)
    with pytest.raises(ValueError, match="compresses a context before its question is known"):
        spec.build(model)
    context = PROMPTS["input_ids"][:1, :SHORT_LEN]
    cache = spec.context_cache(model, CharTokenizer(model.config.vocab_size), context)
    kept = cache.stats().kept
    assert 0 < sum(map(sum, kept)) <= len(kept) * len(kept[0]) * int(0.2 * SHORT_LEN)  # 20%, ranked across layers
    with spec.attention(model), torch.inference_mode():
        out = model.generate(
            input_ids=PROMPTS["input_ids"][:1], cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert out.shape == (1, PROMPT_LEN + NEW_TOKENS)
    assert cache.get_seq_length() == PROMPT_LEN + NEW_TOKENS - 1
    _assert_accounting(cache)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_left_padded_greedy_batch(case: Case, model: Any, reference: Reference) -> None:
    out = _generate(model, case.spec, case.cache)
    _assert_shape(out, 2)
    # Rows never interact: each row's every step is that row's alone (padding included) with a fresh cache.
    for row in range(2):
        alone = _teacher_forced(model, case.spec, row, out.sequences[row, PROMPT_LEN:])
        for step, expected in enumerate(alone):
            torch.testing.assert_close(out.logits[step][row], expected, atol=1e-4, rtol=1e-4)
    if case.spec.lossless:
        _assert_same_run(out, reference.greedy)
    else:
        _assert_prefill_bound(out, reference.greedy, greedy=True)
    assert case.cache.get_seq_length() == PROMPT_LEN + NEW_TOKENS - 1  # the last token is never fed back


def test_beam_search(case: Case, model: Any, reference: Reference) -> None:
    refusal = BEAM_REFUSALS.get(type(case.cache).__name__)
    if refusal is not None:
        with pytest.raises((ValueError, NotImplementedError), match=refusal):
            _generate(model, case.spec, case.cache, **BEAM_SEARCH)
        assert case.cache.get_seq_length() == 0, "the refusal must come before any token is stored"
        return
    out = _generate(model, case.spec, case.cache, **BEAM_SEARCH)
    _assert_shape(out, 2)
    # A beam's cache state is its own tokens' (reordering moved all of it): its score is those tokens re-scored
    # one by one by a fresh cache of the same name.
    for row in range(2):
        generated = out.sequences[row, PROMPT_LEN:]
        alone = _teacher_forced(model, case.spec, row, generated)
        pairs = zip(alone, generated.tolist(), strict=True)
        rescored = sum(torch.log_softmax(step, dim=-1)[token].item() for step, token in pairs)
        assert out.sequences_scores[row].item() == pytest.approx(rescored, abs=1e-4)
    if case.spec.lossless:
        _assert_same_run(out, reference.beams)
    else:
        _assert_prefill_bound(out, reference.beams, greedy=False)
    _assert_accounting(case.cache)  # beams share blocks: each counts once on both sides
    _assert_release_frees_every_byte(case)  # shared blocks included


def _forward(model: Any, case: Case, ids: torch.Tensor) -> torch.Tensor:
    with case.spec.attention(model), torch.inference_mode():
        return model(ids, cache=case.cache).logits


def test_crop_then_continue(case: Case, model: Any, reference: Reference) -> None:
    # A forward outside generate: a budget given as a fraction of the prompt is resolved on the text's length.
    if hasattr(case.cache, "release"):
        case.cache.release()
    case.cache = case.spec.build_for(model, CROP_IDS.shape[1])
    first, second = CROP_CHUNKS
    _forward(model, case, CROP_IDS[:, :first])
    _forward(model, case, CROP_IDS[:, first:])  # this step's start spills what became cold
    length = first + second
    assert case.cache.get_seq_length() == length
    if case.spec.lossless:
        assert case.cache.is_croppable, "a lossless cache keeps every token: it can always be cropped"
    if not case.cache.is_croppable:
        with pytest.raises((ValueError, NotImplementedError), match="crop"):
            case.cache.crop(-CROP_TOKENS)
        assert case.cache.get_seq_length() == length, "a refused crop must change nothing"
        logits = _forward(model, case, CROP_IDS[:, -1:])  # and the cache still works
        assert bool(torch.isfinite(logits).all()) and case.cache.get_seq_length() == length + 1
        return
    case.cache.crop(-CROP_TOKENS)
    kept = length - CROP_TOKENS
    assert case.cache.get_seq_length() == kept
    stats = case.cache.stats() if hasattr(case.cache, "stats") else None
    if isinstance(stats, CacheStats):
        assert stats.tokens == CROP_IDS.shape[0] * kept
    _assert_accounting(case.cache)  # the pool took the blocks past the crop back
    logits = _forward(model, case, CROP_IDS[:, kept:])
    assert case.cache.get_seq_length() == length
    if case.spec.lossless:
        torch.testing.assert_close(logits, reference.crop_logits[:, kept:], atol=1e-5, rtol=1e-5)
    else:
        assert bool(torch.isfinite(logits).all())
    _assert_accounting(case.cache)


def test_reset_then_generate_repeats_the_first_run(case: Case, model: Any) -> None:
    first = _generate(model, case.spec, case.cache)
    case.cache.reset()
    assert case.cache.get_seq_length() == 0
    pool = _pool(case.cache)
    if pool is not None:
        assert _pool_blocks(pool) == 0, pool.stats()
    again = _generate(model, case.spec, case.cache)
    _assert_same_run(again, first)


def _spill_files(case: Case) -> list[str]:
    """What the library spilled under the test's temporary directory (its files and directories are `kvgov-*`;
    torch may leave its own directories there too)."""
    return sorted(path.name for path in case.spill_dir.rglob("kvgov*"))


def _assert_release_frees_every_byte(case: Case) -> None:
    if not hasattr(case.cache, "release"):
        assert type(case.cache) is DynamicCache, f"only the reference may lack release(); {case.name} does"
        return
    stats = case.cache.stats()
    assert stats.bytes_used > 0
    recall = getattr(stats, "recall", None)
    if getattr(stats, "bytes_written", 0) or (recall is not None and recall.bytes_written):
        assert _spill_files(case), "what the cache wrote to disk must be in the test's temporary directory"
    pool = _pool(case.cache)
    case.cache.release()
    assert case.cache.get_seq_length() == 0
    assert case.cache.stats().bytes_used == 0, case.cache.stats()
    if pool is not None:
        assert (_pool_blocks(pool), _pool_bytes(pool)) == (0, 0), pool.stats()
    assert _spill_files(case) == [], "release must delete its spill files"


def test_release_frees_every_byte(case: Case, model: Any) -> None:
    _generate(model, case.spec, case.cache)
    _assert_release_frees_every_byte(case)


def test_stats_bytes_equal_pool_bytes(case: Case, model: Any) -> None:
    _generate(model, case.spec, case.cache)
    _assert_accounting(case.cache)
    if _pool(case.cache) is not None:
        assert _pool_bytes(_pool(case.cache)) > 0
