"""The model runner: one forward pass over a scheduled step, packed into one row, and the sampling after it.

The step's tokens are packed without padding (`input_ids` and `position_ids` of shape `[1, tokens]`, each sequence
at its own positions), the `kvgov_ragged` attention reads the step's `RaggedStep` from the forward's kwargs, and
`logits_to_keep` asks the model for the logits of each sampling sequence's last token only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hf_kvgov.kernels.ragged import RaggedStep, SequenceSlice
from hf_kvgov.serving.request import Request
from hf_kvgov.serving.scheduler import ScheduledStep
from hf_kvgov.storage.layer_groups import full_group
from hf_kvgov.storage.pool import BlockPool


class ModelRunner:
    """Runs a model over packed steps whose K/V live in `pool`; the model must use the `kvgov_ragged` attention."""

    def __init__(
        self,
        model: Any,
        pool: BlockPool,
        step_key: str,
        device: torch.device,
        step_class: type[RaggedStep],
        observe_masses: bool = False,
        kv_sources: Mapping[int, int] | None = None,
    ) -> None:
        self.model = model
        self.step_class = step_class
        self.kv_sources = dict(kv_sources or {})  # layers past the pool's -> the layer whose K/V they attend over
        self._attending = frozenset(range(pool.geometry.num_layers)) | self.kv_sources.keys()  # every step, each once
        self.observe_masses = observe_masses  # score blocks by the attention they receive (an eviction policy)
        self.pool = pool
        self.step_key = step_key
        self.device = device

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> tuple[list[int | None], list[torch.Tensor | None]]:
        """Compute the step; returns, per request in order, its sampled token or None (its prompt goes on), and the
        attention each column of its table received (None unless `observe_masses`)."""
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        sampling: list[int] = []  # packed index of each sampling request's last token
        samplers: list[Request] = []
        scored: list[int] = []  # packed indices whose next prompt token is scored (`prompt_logprobs`)
        targets: list[int] = []
        scorers: list[tuple[Request, int]] = []  # each scoring request and how many of its tokens this step scores
        for request, count in zip(step.requests, step.counts, strict=True):
            start, end = request.computed, request.computed + count
            tokens = request.tokens
            if request.params.prompt_logprobs:
                last = min(end, len(request.prompt) - 1)  # the positions whose next token is a prompt token
                scored.extend(range(len(ids), len(ids) + max(0, last - start)))
                targets.extend(tokens[start + 1 : last + 1])
                scorers.append((request, max(0, last - start)))
            ids.extend(tokens[start:end])
            positions.extend(range(start, end))  # the positions keys are rotated at, whatever was evicted before
            assert request.tables is not None
            stored = request.tables.indices(request.computed, request.evicted_tokens)
            slices.append(SequenceSlice(count, [index + count for index in stored], request.tables.block_ids))
            if end == request.num_tokens:
                sampling.append(len(ids) - 1)
                samplers.append(request)
        ragged = self.step_class.build(self.pool, slices, self.device, self.kv_sources)
        masses = ragged.observe_masses() if self.observe_masses else None
        logits = self._forward(ids, positions, sampling + scored, ragged)
        if scored:
            rows = logits[len(sampling) :].float().log_softmax(dim=-1)
            logprobs = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0].tolist()
            for request, count in scorers:
                request.prompt_logprobs.extend(logprobs[:count])
                del logprobs[:count]
        chosen = sample(logits[: len(sampling)], samplers) if samplers else []
        by_request = dict(zip((id(r) for r in samplers), chosen, strict=True))
        sampled = [by_request.get(id(request)) for request in step.requests]
        if masses is None:
            return sampled, [None] * len(step.requests)
        size, decoding = self.pool.block_size, ragged.num_decoding
        full = full_group(self.pool.groups)  # the tables that evict
        assert full is not None, "block masses are observed only with a full-attention group"
        return sampled, list(masses.per_sequence([-(-s.kv_lengths[full] // size) for s in slices[:decoding]]))

    def _forward(self, ids: list[int], positions: list[int], keep: list[int], ragged: RaggedStep) -> torch.Tensor:
        """The model over one packed row; the logits `[len(keep), vocab]` of the packed indices `keep`. Every layer
        must have attended through `ragged`: one that did not saw none of its sequences' earlier tokens."""
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
            **{self.step_key: ragged},
        )
        missed = sorted(self._attending - ragged.attended)
        if missed:
            raise ValueError(
                f"{type(self.model).__name__} cannot be served by the engine: layers {missed} attended without its "
                "step (their attention bypasses transformers' attention interface, or the model does not pass its "
                "keyword arguments down to it), so they would see no earlier token of any request."
            )
        return out.logits[0]

    @torch.inference_mode()
    def check_layers_reach_the_step(self) -> None:
        """One token through the model on a block of its own: a `ValueError` naming a model whose layers do not all
        attend through the engine's step, before any request is served (rather than answers without context)."""
        (block,) = self.pool.allocate(1)
        try:
            groups = len(self.pool.groups)
            probe = [SequenceSlice(1, [1] * groups, [[block]] * groups)]
            ragged = self.step_class.build(self.pool, probe, self.device, self.kv_sources)
            try:
                self._forward([0], [0], [0], ragged)
            except ValueError:
                raise
            except Exception as err:  # e.g. the kvgov_ragged attention called without the step, or a model's own
                # attention code reading the mask the packed step does not build
                raise ValueError(
                    f"{type(self.model).__name__} cannot be served by the engine: one token through its step failed "
                    f"({type(err).__name__}: {err})"
                ) from err
        finally:
            self.pool.decref([block])


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One token per row of `logits` `[rows, vocab]`, by each request's own parameters and generator."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, request in enumerate(requests):
        params = request.params
        adjusts = params.repetition_penalty != 1.0 or len(request.output) < params.min_new_tokens
        if params.greedy and not adjusts:
            continue
        scores = adjusted(logits[row].float(), request) if adjusts else logits[row].float()
        if params.greedy:
            tokens[row] = int(scores.argmax())
            continue
        scores = scores / params.temperature
        if params.top_k:
            kept = scores.topk(min(params.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kept, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if params.top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            keep = ordered.cumsum(0) - ordered < params.top_p  # the smallest head whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], ordered[keep])
        tokens[row] = int(torch.multinomial(probs, 1, generator=request.generator).item())
    return tokens


def adjusted(scores: torch.Tensor, request: Request) -> torch.Tensor:
    """`scores` (float `[vocab]`) after the request's repetition penalty and its minimum length, in transformers'
    order (before temperature, top-k and top-p): a token seen in the prompt or output has a positive logit divided
    by the penalty and a negative one multiplied; the stop tokens are masked until `min_new_tokens` were made."""
    params = request.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.tokens)), dtype=torch.long, device=scores.device)
        picked = scores[seen]
        scores = scores.clone()
        scores[seen] = torch.where(picked < 0, picked * params.repetition_penalty, picked / params.repetition_penalty)
    if len(request.output) < params.min_new_tokens and request.stop_ids and not params.ignore_eos:
        scores = scores.index_fill(0, torch.tensor(request.stop_ids, device=scores.device), float("-inf"))
    return scores
