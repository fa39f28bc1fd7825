"""LongBench prompts as the official ``pred.py`` builds them, for any tokenizer-like object.

Steps, in pred.py's order:

1. fill the task's template with the record (``template.format(**record)``);
2. if the prompt has more than ``max_length`` tokens, keep the first ``max_length // 2`` and the
   last ``max_length // 2`` tokens (special tokens included in the count, skipped when decoding)
   and decode the two halves back to text; the middle goes because the instructions sit at both ends;
3. wrap it in the chat template, except for trec, triviaqa, samsum, lsht, lcc and repobench-p;
4. generate at most ``dataset2maxlen[task]`` tokens, greedily; samsum also stops at a newline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_kvgov.evaluation.longbench.config import (
    max_new_tokens,
    prompt_template,
    stops_at_newline,
    uses_chat_template,
)
from hf_kvgov.evaluation.longbench.data import LongBenchSample
from hf_kvgov.evaluation.synthetic.sample import question_of
from hf_kvgov.evaluation.tokenizer import SupportsEncodeDecode, check_encoder


def build_prompt(task: str, sample: LongBenchSample) -> str:
    """The official template of ``task`` filled with ``sample`` (before any truncation)."""
    return prompt_template(task).format(**sample.template_fields())


def build_question(task: str, sample: LongBenchSample) -> str:
    """What the template of ``task`` puts after the context, filled with ``sample``: the question and the rest."""
    return question_of(lambda context: prompt_template(task).format(**{**sample.template_fields(), "context": context}))


def _check_max_length(max_length: int) -> None:
    # Below 2, half is 0 and pred.py's ids[-0:] would keep the whole prompt instead of cutting it.
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an integer of at least 2 tokens; got {max_length!r}.")


def middle_halves(ids: Sequence[int], max_length: int) -> tuple[Sequence[int], Sequence[int]] | None:
    """The kept head and tail of ``ids`` (``max_length // 2`` each), or None when ``ids`` fits.

    For an odd ``max_length`` the result holds ``max_length - 1`` ids, as in pred.py.
    """
    _check_max_length(max_length)
    if len(ids) <= max_length:
        return None
    half = max_length // 2
    return ids[:half], ids[-half:]


def truncate_middle(prompt: str, tokenizer: SupportsEncodeDecode, max_length: int) -> str:
    """``prompt`` cut to at most ``max_length`` tokens by dropping its middle (pred.py's rule)."""
    check_encoder(tokenizer, SupportsEncodeDecode)
    halves = middle_halves(tokenizer.encode(prompt), max_length)
    if halves is None:
        return prompt
    head, tail = halves
    return tokenizer.decode(head, skip_special_tokens=True) + tokenizer.decode(tail, skip_special_tokens=True)


def apply_chat_template(prompt: str, tokenizer: object) -> str | None:
    """``prompt`` as a single user turn in the tokenizer's chat template, or None without one.

    pred.py used a hand-written template per model; a transformers tokenizer's own
    ``chat_template`` is the same thing for current models. A base model has none and gets the raw
    prompt, as pred.py does for the models it has no template for.
    """
    if getattr(tokenizer, "chat_template", None) is None or not hasattr(tokenizer, "apply_chat_template"):
        return None
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) must return a string; got {type(text).__name__}.")
    return text


def newline_token_id(tokenizer: SupportsEncodeDecode) -> int:
    """The id pred.py adds as a second EOS for samsum: the last id of ``encode("\\n")`` without specials."""
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) == 0:
        raise ValueError("The tokenizer encodes '\\n' to no tokens, so samsum cannot stop at a newline.")
    return int(ids[-1])


@dataclass(frozen=True)
class PreparedPrompt:
    """A LongBench prompt ready for ``generate``.

    Attributes:
        task: the LongBench task.
        text: the prompt text to tokenize.
        max_new_tokens: the official generation budget of the task.
        chat_template_applied: whether ``text`` is wrapped in the chat template. The template
            already holds the model's leading special tokens, so encode it with
            ``add_special_tokens=False`` then (see ``add_special_tokens``).
        truncated: whether the middle of the prompt was dropped.
        extra_eos_token_ids: ids that also end generation (the newline for samsum), to add to the
            model's own EOS ids.
        min_new_tokens: at least this many tokens are generated (1 for samsum, so an immediate
            newline cannot end it empty; pred.py sets ``min_length = prompt length + 1``).
        context_chars: the first characters of ``text`` that are the context (up to where the template's
            question starts), for a cache that compresses the context before the question; None when the
            middle cut took part of the question.
    """

    task: str
    text: str
    max_new_tokens: int
    chat_template_applied: bool
    truncated: bool
    extra_eos_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    context_chars: int | None = None

    @property
    def add_special_tokens(self) -> bool:
        """Whether the tokenizer should add its special tokens when encoding ``text``."""
        return not self.chat_template_applied


def prepare_prompt(
    task: str, sample: LongBenchSample, tokenizer: SupportsEncodeDecode, max_length: int
) -> PreparedPrompt:
    """Build, middle-truncate to ``max_length`` tokens and (where official) chat-wrap one prompt."""
    raw = build_prompt(task, sample)
    cut = truncate_middle(raw, tokenizer, max_length)
    chat_text = apply_chat_template(cut, tokenizer) if uses_chat_template(task) else None
    newline_stop = stops_at_newline(task)
    text = cut if chat_text is None else chat_text
    question = build_question(task, sample).strip()  # the middle cut's decode may change the whitespace around it
    context_chars = text.rfind(question) if question and cut.rstrip().endswith(question) else -1
    return PreparedPrompt(
        task=task,
        text=text,
        max_new_tokens=max_new_tokens(task),
        chat_template_applied=chat_text is not None,
        truncated=cut != raw,
        extra_eos_token_ids=(newline_token_id(tokenizer),) if newline_stop else (),
        min_new_tokens=1 if newline_stop else 0,
        context_chars=context_chars if context_chars > 0 else None,
    )
