"""KVzip (Kim et al., 2025): compress a context by how much the model needs each token to repeat the context.

After the prefill the model reads "Repeat the previous context exactly." (a chat model: then the assistant turn's
opening) and the context again, in chunks of ``chunk_size`` (a later chunk's prompt ends with the 8 tokens before
it). A token's score is the most attention any of those queries, in any query head of its KV group, pays it, the
softmax over the sinks, the chunk and the repeat, as the authors' and kvpress's code. The scores do not depend on
a question, so one compressed context serves every question after it. The best-scored tokens of the full-attention
layers are kept, ranked across layers and heads (KVzip's non-uniform budgets) at the uniform budget's bytes;
sliding-window layers keep their window. Cost: two more passes over the context (the first eager, for the
attention weights); memory peaks at the full context's KV plus one layer's weights for one chunk. Each row of a
batch is scored on its own, so left padding changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from hf_kvgov.hf.attention import eviction_attention
from hf_kvgov.hf.compat import (
    attention_implementation,
    decoder_config,
    decoder_layer_names,
    kv_heads_and_head_dim,
    layer_kinds,
)
from hf_kvgov.hf.eviction.policy_cache import PolicyCache
from hf_kvgov.policies import GivenScores, HeadAdaptive
from hf_kvgov.policies.budget import BudgetSpec, check_budget_spec, resolve_budget

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk that lead a later chunk's prompt
DEFAULT_CHUNK = 2048
DEFAULT_SINKS = 4


def reconstruction_scores(
    model: Any,
    tokenizer: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    sinks: int = DEFAULT_SINKS,
) -> list[Tensor | None]:
    """Per decoder layer, float ``[batch, kv_heads, length]``: each context token's KVzip score (None for a
    sliding-window layer, which keeps its window and is not scored). A left-padded row's scores are indexed by
    the positions its tokens get (0 for its first real token); padding scores 0."""
    config = decoder_config(model)
    if (
        not isinstance(input_ids, Tensor)
        or input_ids.dim() != 2
        or input_ids.shape[1] == 0
        or input_ids.dtype not in (torch.long, torch.int)
    ):
        got = (
            f"a {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
            if isinstance(input_ids, Tensor)
            else f"a {type(input_ids).__name__}"
        )
        raise ValueError(f"input_ids must be an integer tensor [batch, length] with length > 0; got {got}.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int number of tokens; got {chunk_size!r}.")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0 (leading tokens always kept); got {sinks!r}.")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}.")
    kv_heads = kv_heads_and_head_dim(config)[0]
    scored = [kind.sliding_window is None for kind in layer_kinds(config)]
    batch, length = input_ids.shape
    tables: list[Tensor | None] = [torch.zeros(batch, kv_heads, length) if s else None for s in scored]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in (REPEAT_PROMPT, CONTINUE_PROMPT)]
    prompts.append(_turn_suffix(tokenizer))
    previous = attention_implementation(model.config)
    model.set_attn_implementation("eager")  # the hooks read the attention weights
    try:
        for row in range(batch):
            ids = input_ids[row][mask[row].bool()]
            for layer, found in enumerate(_score_row(model, ids, prompts, scored, kv_heads, chunk_size, sinks)):
                table = tables[layer]
                if table is not None and found is not None:
                    table[row, :, : ids.numel()] = found
    finally:
        model.set_attn_implementation(previous)
    return tables


def _turn_suffix(tokenizer: Any) -> list[int]:
    """What a chat model reads between a user's request and its answer (the assistant turn's opening), as the
    authors' code puts it after the repeat prompt; nothing for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    dummy, separator = "context", "\n#######"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text.split(separator)[-1], add_special_tokens=False))


def _attention_modules(model: Any, num_layers: int) -> list[Any]:
    """Each decoder layer's attention module (``self_attn``), whose forward returns the eager attention weights."""
    names = decoder_layer_names(model, num_layers)
    modules = dict(model.named_modules())
    found = [getattr(modules[name], "self_attn", None) for name in names or ()]
    if names is None or any(module is None for module in found):
        raise ValueError(
            f"KVzip reads each decoder layer's attention weights from its self_attn module; {type(model).__name__} "
            "has no such layers (supported: transformers' Llama-style decoders: Llama, Qwen, Mistral, Gemma-3, ...)."
        )
    return found


def _score_row(
    model: Any,
    ids: Tensor,
    prompts: Sequence[list[int]],  # the repeat prompt, the continue prompt, the turn suffix
    scored: Sequence[bool],
    kv_heads: int,
    chunk_size: int,
    sinks: int,
) -> list[Tensor | None]:
    """One unpadded row's scores per layer, ``[kv_heads, n]``."""
    n = ids.numel()
    found: list[Tensor | None] = [torch.zeros(kv_heads, n) if s else None for s in scored]
    span = {"start": 0, "end": 0, "queries": 0}

    def hook(layer: int) -> Any:
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            weights = output[1]  # [1, heads, q, n + q]
            start, end, queries = span["start"], span["end"], span["queries"]
            head = min(sinks, start)
            kept = torch.cat([weights[..., :head], weights[..., start:end], weights[..., n : n + queries]], dim=-1)
            kept = kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)
            chunk = kept[0, :, :, head : head + end - start].float()  # [heads, q, chunk]
            best = chunk.amax(dim=1).reshape(kv_heads, -1, end - start).amax(dim=1)
            table = found[layer]
            assert table is not None
            table[:, start:end] = best

        return record

    attention = _attention_modules(model, len(scored))
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids[None], cache=cache, use_cache=True)
        hooks = [attention[i].register_forward_hook(hook(i)) for i, s in enumerate(scored) if s]
        try:
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                # "Repeat ...", or for a later chunk "Repeat the part ... starting with" and the tokens before it;
                # then the assistant turn's opening (empty without a chat template) and the chunk itself.
                lead = prompts[0] if start == 0 else [*prompts[1], *ids[max(0, start - OVERLAP) : start].tolist()]
                lead = [*lead, *prompts[2]]
                repeat = torch.tensor([[*lead, *ids[start:end].tolist()]], device=ids.device)
                span.update(start=start, end=end, queries=repeat.shape[1])
                model(input_ids=repeat, cache=cache, use_cache=True)
                cache.crop(-repeat.shape[1])  # the repeat is read, never kept
        finally:
            for handle in hooks:
                handle.remove()
    return found


def kvzip_cache(
    model: Any,
    tokenizer: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    budget: BudgetSpec = 0.2,
    *,
    layerwise: bool = False,
    sinks: int = DEFAULT_SINKS,
    chunk_size: int = DEFAULT_CHUNK,
    **cache_options: Any,
) -> PolicyCache:
    """A `PolicyCache` holding the context ``input_ids`` compressed by KVzip, ready for the question to follow.

    Args:
        model, tokenizer: the model and the tokenizer that spells the repeat prompt.
        input_ids, attention_mask: the context, ``[batch, length]`` (left padding allowed).
        budget: slots kept per (sequence, KV head) on average: an int, or a fraction of ``length``.
        layerwise: every full-attention layer keeps the same total (its heads still share it by score); False
            (KVzip's default): the layers' best slots are ranked together, the same total bytes.
        sinks, chunk_size: leading tokens always kept; tokens repeated per reconstruction pass.
        cache_options: further `PolicyCache` options (``codec``, ``pool``, ``query_chunk``, ``recall``).

    Continue with ``model.generate(input_ids=context_and_question, cache=cache, ...)`` under
    `eviction_attention`; the cache holds only the kept slots (memory freed, not masked).
    """
    check_budget_spec("kvzip_cache", "budget", budget)
    for refused in ("compress", "layer_budgets", "head_budgets", "budget_of", "decode_policy"):
        if refused in cache_options:
            raise ValueError(f"kvzip_cache sets {refused} itself (a one-time compression of the context).")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    scores = reconstruction_scores(model, tokenizer, input_ids, mask, chunk_size=chunk_size, sinks=sinks)
    per_head = resolve_budget(budget, input_ids.shape[1], max(sinks, 1))
    policy = GivenScores(tuple(scores), sinks)
    layer_budgets = {} if layerwise else _global_budgets(scores, mask, per_head, sinks)
    for layer, kind in enumerate(layer_kinds(decoder_config(model))):
        if kind.sliding_window is not None:  # not scored: it keeps what its window can see, as it always does
            layer_budgets[layer] = max(kind.sliding_window, per_head)
    cache = PolicyCache(
        model,
        policy,
        per_head,
        compress="prefill",
        layer_budgets=layer_budgets or None,
        head_budgets=HeadAdaptive(floor=0.0),
        **cache_options,
    )
    with eviction_attention(model), torch.inference_mode():
        model(input_ids=input_ids, attention_mask=mask, cache=cache, use_cache=True)
    return cache


def _global_budgets(scores: Sequence[Tensor | None], mask: Tensor, per_head: int, sinks: int) -> dict[int, int]:
    """Each scored layer's budget (slots per KV head) when every row ranks its layers' slots together.

    A row keeps ``layers x kv_heads x per_head`` of its slots over all scored layers (sinks first); each layer's
    budget is the mean over rows of what it got, divided by its heads, at least the sinks.
    """
    layers = [i for i, table in enumerate(scores) if table is not None]
    if not layers:
        return {}
    stacked = torch.stack([scores[i] for i in layers])  # type: ignore[misc]  # [layers, batch, heads, length]
    count, batch, heads, _ = stacked.shape
    lengths = mask.sum(-1)
    shares = torch.zeros(count)
    for row in range(batch):
        n = int(lengths[row])
        row_scores = stacked[:, row, :, :n].clone()
        row_scores[..., : min(sinks, n)] = float("inf")
        keep = min(count * heads * per_head, row_scores.numel())
        chosen = row_scores.reshape(-1).topk(keep).indices // (heads * n)
        shares += torch.bincount(chosen, minlength=count).float()
    budgets = (shares / (batch * heads)).round().long().clamp_min(max(sinks, 1)).tolist()
    return dict(zip(layers, budgets, strict=True))
