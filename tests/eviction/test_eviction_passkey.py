"""Passkey retrieval on SmolLM2-135M with 20% of the prompt kept: SnapKV beside H2O.

Each prompt (~1,000 tokens, chat template) states a 5-digit pass key at 10% depth of a Pride and Prejudice
passage and ends with the question and the answer's start, as RULER asks it: "What is the pass key?" then
"The pass key is". Budgets are 20% of the prompt (199 slots per KV head); greedy, float32 on CPU.

Measured on the 10 prompts of `hf_kvgov.bench.passkey_prompts` (the full cache answers 8; the other two are left
out):

    full cache (DynamicCache)                   8 / 8
    SnapKV, window 32, max pool of 7 (default)  5 / 8   the 3 misses give the first 4 digits, not the 5th
    SnapKV, window 32, max pool of 15           7 / 8
    SnapKV, window 64, avg pool of 5            0 / 8   kvpress's settings (SnapKVPress)
    HeavyHitterCache (H2O), half recent         7 / 8
    TOVA                                        0 / 8   first 1-4 digits
    KeyNorm, 32 recent                          0 / 8

SmolLM2 reads digits one token each, and the observation window ("The pass key is") attends most to the
needle's own "pass key is", just before the number: a pool of 7 slots reaches 3 tokens past it, so the
kept neighbourhood often ends before the last digit. Without the answer's start in the prompt (the model
writes "The pass key is" itself) the full cache answers 4 of these 10, SnapKV 0 (pool of 7) and 3 (pool
of 15) of those 4, H2O 0. The thresholds below are the measured counts less one sample, room for other
BLAS builds to flip a greedy digit.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, eviction_attention
from hf_kvgov.bench.passkey_prompts import passkey_prompts
from hf_kvgov.hf.eviction import PolicyCache
from hf_kvgov.policies import SnapKV

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def samples(smollm2):  # type: ignore[no-untyped-def]
    return passkey_prompts(smollm2[1])


def answers(model, tokenizer, samples, make_cache) -> list[bool]:  # type: ignore[no-untyped-def]
    found = []
    for key, prompt in samples:
        with torch.inference_mode(), eviction_attention(model):
            out = model.generate(**prompt, cache=make_cache(), max_new_tokens=7, do_sample=False)
        found.append(str(key) in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :]))
    return found


@pytest.mark.usefixtures("one_thread")
def test_snapkv_at_20_percent_retrieves_the_pass_key_stated_early(smollm2, samples) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    assert min(prompt["input_ids"].shape[1] for _, prompt in samples) >= 990
    full = answers(model, tokenizer, samples, lambda: DynamicCache(config=model.config))
    snapkv = answers(model, tokenizer, samples, lambda: PolicyCache(model, SnapKV(), budget=0.2))
    h2o = answers(model, tokenizer, samples, lambda: HeavyHitterCache(model, budget=0.2))
    report = f"full {sum(full)}/8, SnapKV {sum(snapkv)}/8, H2O {sum(h2o)}/8"
    assert all(full), report
    assert sum(snapkv) >= 4, report
    assert sum(h2o) >= 6, report
