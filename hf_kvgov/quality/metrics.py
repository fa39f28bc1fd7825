"""Running comparison of a candidate's next-token distributions with a reference's.

Per predicted token, with ``p`` the reference and ``q`` the candidate distribution over the vocabulary
and ``y`` the true next token::

    nll    = -log q(y)                        perplexity = exp(mean nll)
    kl     = sum_v p(v) (log p(v) - log q(v))  (nats; 0 when the candidate equals the reference)
    agree  = argmax p == argmax q             top-1 agreement

Only sums are kept, so the text can be scored chunk by chunk without holding every logit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RunningScore:
    """Sums over the tokens seen so far for one candidate (and its reference)."""

    tokens: int = 0
    nll: float = 0.0
    reference_nll: float = 0.0
    kl: float = 0.0
    agreements: int = 0

    def add(self, reference_logits: Tensor, logits: Tensor, targets: Tensor) -> None:
        """Add `n` predictions: logits `[n, vocab]` (any float dtype) and true next tokens long `[n]`."""
        if reference_logits.shape != logits.shape or logits.shape[0] != targets.shape[0]:
            raise ValueError(
                f"Expected reference and candidate logits [n, vocab] and targets [n]; got "
                f"{tuple(reference_logits.shape)}, {tuple(logits.shape)} and {tuple(targets.shape)}."
            )
        ref = reference_logits.float().log_softmax(-1)
        cand = logits.float().log_softmax(-1)
        picked = targets[:, None]
        self.tokens += int(targets.shape[0])
        self.nll -= float(cand.gather(-1, picked).sum())
        self.reference_nll -= float(ref.gather(-1, picked).sum())
        # xlogy-style guard: p = 0 contributes 0 even where log q is -inf.
        self.kl += float(torch.where(ref.isneginf(), 0.0, ref.exp() * (ref - cand)).sum())
        self.agreements += int((ref.argmax(-1) == cand.argmax(-1)).sum())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else math.nan

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll / self.tokens) if self.tokens else math.nan

    @property
    def ppl_increase_pct(self) -> float:
        """Perplexity increase over the reference, in percent."""
        return 100.0 * (self.perplexity / self.reference_perplexity - 1.0)

    @property
    def kl_mean(self) -> float:
        return self.kl / self.tokens if self.tokens else math.nan

    @property
    def top1_agreement(self) -> float:
        return self.agreements / self.tokens if self.tokens else math.nan
