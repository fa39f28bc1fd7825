"""The tiny random Llama saved as a local model directory, for `kvgov eval` runs without downloads."""

from __future__ import annotations

from pathlib import Path

from tests.char_tokenizer import char_tokenizer
from tests.conftest import tiny_llama

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LONGBENCH_DIR = FIXTURES / "longbench"

# Wraps a user turn as "<user>...<reply>" (every character is in the tiny model's vocabulary).
CHAT_TEMPLATE = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<reply>"
CHAT_WRAPPER_TOKENS = len("<user><reply>")

# The tiny Llama stores 2 layers x (K + V) x 2 KV heads x 16 channels x 4 bytes (fp32) per token.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def tiny_tokenizer(chat: bool = False):  # type: ignore[no-untyped-def]
    """One token per character (no BOS added); with ``chat``, the template above."""
    tokenizer = char_tokenizer()
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(directory: Path, chat: bool = False) -> Path:
    """Write the tiny Llama and its character tokenizer into ``directory`` (loadable by `kvgov --model DIR`)."""
    tiny_llama().save_pretrained(directory)
    tiny_tokenizer(chat).save_pretrained(directory)
    return directory
