"""A character tokenizer with exactly the tiny Llama's 96 ids, so the check and its CLI run end to end
on the tiny model (a saved directory loads like any local model)."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = " \n" + string.ascii_letters + string.digits + string.punctuation[:28]  # 2 + 52 + 10 + 28 = 92


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One id per character (no merges); ids 0-3 are pad, bos, eos, unk; 96 ids in all."""
    vocab = {token: i for i, token in enumerate(SPECIALS + list(CHARACTERS))}
    assert len(vocab) == 96, len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
