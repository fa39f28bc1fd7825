"""The document-QA benchmark's bookkeeping on the tiny model (timings are not asserted)."""

from __future__ import annotations

from typing import Any

import torch

from hf_kvgov.bench import prefix_qa
from tests.conftest import tiny_llama


class CharTokenizer:
    """One token per character, ids 3..95: enough to drive the scenario without a real vocabulary."""

    def __call__(self, text: str, return_tensors: str | None = None) -> dict[str, Any]:
        ids = [3 + ord(c) % 93 for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


def test_sharing_computes_the_document_once_and_holds_it_once() -> None:
    model, tokenizer = tiny_llama(seed=5), CharTokenizer()
    document = "Netherfield Park is let at last. " * 6  # 198 characters
    asks = prefix_qa.questions(4)
    plain = prefix_qa.run_mode(model, tokenizer, document, asks, share=False, new_tokens=3)
    shared = prefix_qa.run_mode(model, tokenizer, document, asks, share=True, new_tokens=3)
    assert plain.tokens_reused == 0 and plain.tokens_computed == plain.prompt_tokens
    # Every prompt starts with document + "\n\nQuestion " (209 characters): requests 2..4 reuse its 13
    # whole blocks of 16 tokens; the rest (from "1:", "2:", ...) differs and is computed.
    common = len(document) + len("\n\nQuestion ")
    assert shared.tokens_reused == 3 * (common // 16) * 16
    assert shared.tokens_computed == shared.prompt_tokens - shared.tokens_reused
    assert shared.kv_bytes_concurrent < plain.kv_bytes_concurrent / 2
    assert shared.kv_bytes_ideal == plain.kv_bytes_ideal
    assert "hit rate" in prefix_qa.render([plain, shared], len(document))
