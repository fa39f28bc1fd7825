"""What an eviction cache reads from the model: which models it can serve, and each new token's position."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from hf_kvgov.hf.compat import decoder_config, layer_kinds


def checked_decoder_config(model: Any, owner: str) -> Any:
    """The decoder config of ``model``, refusing what an eviction cache cannot serve."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"{owner} needs the transformers model it will serve (its config and rotary embedding); "
            f"got {type(model).__name__}."
        )
    return decoder_config(model)


def layer_windows(config: Any) -> list[int | None]:
    """Per decoder layer: its sliding window in tokens, or None for a layer that sees the whole context."""
    return [kind.sliding_window for kind in layer_kinds(config)]


def new_token_positions(position_ids: Any, batch: int, q_len: int, seen: int, device: torch.device) -> Tensor:
    """Long ``[batch, q_len]``: the RoPE position of each new token (the model's ``position_ids``).

    Falls back to absolute indices ``seen..seen+q_len-1`` when the model passes none (or 3-D multimodal ones).
    """
    usable = isinstance(position_ids, Tensor) and position_ids.dim() == 2
    if usable and position_ids.shape[-1] == q_len and position_ids.shape[0] in (1, batch):
        return position_ids.to(device=device, dtype=torch.long).expand(batch, q_len)
    return (torch.arange(q_len, device=device) + seen).expand(batch, q_len)
