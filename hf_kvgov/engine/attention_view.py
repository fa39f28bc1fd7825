"""What a cache hands the hf_kvgov attention for one layer's step, and the name transformers knows that attention by.

transformers calls ``cache.update(k, v, layer_idx, kwargs=kwargs)`` and then splats that same ``kwargs`` into the
attention call. A cache that attends its own way (paged blocks read in place, an eviction cache's per-head slots)
puts an `AttentionView` under `VIEW_KEY` there; the one hf_kvgov attention (`ATTENTION_NAME`, registered by
`hf_kvgov.hf.attention`) attends through whichever view it finds, and runs sdpa on the given K/V when there is none.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

ATTENTION_NAME = "kvgov"
VIEW_KEY = "kvgov_view"


class AttentionView(Protocol):
    """One layer's step as its cache stores it."""

    def attend(
        self, query: Tensor, mask: Tensor | None, scale: float, softcap: float | None, sinks: Tensor | None = None
    ) -> Tensor:
        """Attention of ``query`` ``[batch, q_heads, q_len, head_dim]`` under transformers' ``mask`` for this step,
        with the model's learned sink logit per query head (``sinks`` ``[q_heads]``: transformers' ``s_aux``) in
        each softmax's denominator when it has them; returns ``[batch, q_len, q_heads, head_dim]``."""
        ...
