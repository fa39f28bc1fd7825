"""The attention backends `dispatch` chooses from: what each one is, and which calls it refuses.

A `Backend` is a small record: the function that attends, a cheap `refuses(probe)` that names why it cannot
serve a call (None when it can), the device types on which the automatic choice may pick it, and its rank
there. The built-in ones wrap `kernels.reference` / `kernels.quantized_reference` (the torch references,
which serve every call), `kernels.gathered_sdpa` (one layer's blocks gathered for PyTorch's sdpa),
`kernels.triton_paged` / `kernels.triton_quantized` (Triton, imported on first
use so that importing hf_kvgov does not import triton and a later `TRITON_INTERPRET=1` still counts) and
`kernels.flash_paged` (flash-attn, itself imported on first call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.kernels import flash_paged, gathered_sdpa
from hf_kvgov.kernels.quantized_reference import SealedReader, quantized_paged_attention_reference
from hf_kvgov.kernels.reference import paged_attention_reference
from hf_kvgov.kernels.sealed_blocks import SealedBlocks

AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Probe:
    """What a backend looks at to decide whether it serves a call (see `Backend.refuses`)."""

    query: torch.Tensor  # [batch, q_heads, q_len, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    mask: torch.Tensor | None = None
    sealed: SealedBlocks | None = None  # the quantized path's sealed blocks
    softcap: float | None = None
    # True when the call also gives `mask` as per-row lengths and a sliding window (`dispatch.paged_attention`),
    # which a backend that `takes_lengths` reads instead of the mask.
    ragged: bool = False
    sinks: torch.Tensor | None = None  # learned sink logits `[q_heads]`, for the backends that `takes_sinks`


@dataclass(frozen=True)
class Backend:
    """One implementation of a path.

    Attributes:
        name: what `set_backend` and the environment variable call it.
        attend: the path's call: `(query, key_cache, value_cache, block_table, kv_length, scale, mask=,
            softcap=)` on "paged", plus keywords `read_sealed=` and `sealed=` on "quantized", and `sinks=` (learned
            sink logits `[q_heads]`) where `takes_sinks`.
        refuses: a sentence saying why it cannot serve a call, None when it can (cheap: called per call);
            None for a backend that serves every call. A call with sinks never reaches a backend that does not
            `takes_sinks`, so `refuses` need not look at them.
        auto_devices: device types on which the automatic choice may pick it.
        priority: among automatic candidates, the highest one that accepts a call serves it.
        takes_lengths: attend also takes ``seq_lens=`` and ``window=`` in place of a ragged call's mask.
        takes_sinks: attend also takes ``sinks=`` (the torch references, Triton).
    """

    name: str
    attend: AttentionFn
    refuses: Callable[[Probe], str | None] | None = None
    auto_devices: frozenset[str] = frozenset()
    priority: int = 0
    takes_lengths: bool = False
    takes_sinks: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"A backend needs a non-empty name; got {self.name!r}.")
        if not callable(self.attend) or (self.refuses is not None and not callable(self.refuses)):
            raise TypeError(f"Backend {self.name!r}: attend and refuses must be callables (refuses may be None).")
        if isinstance(self.auto_devices, str):
            raise TypeError(f"Backend {self.name!r}: auto_devices is a set of device types, e.g. {{'cuda'}}.")
        object.__setattr__(self, "auto_devices", frozenset(self.auto_devices))
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"Backend {self.name!r}: priority must be an int; got {self.priority!r}.")


def _triton_attend(*args: Any, **kwargs: Any) -> torch.Tensor:
    from hf_kvgov.kernels.triton_paged import paged_attention_triton

    return paged_attention_triton(*args, **kwargs)


def _triton_refuses(probe: Probe) -> str | None:
    from hf_kvgov.kernels.triton_paged import unsupported_reason

    return unsupported_reason(probe.query, probe.key_cache, probe.mask)


def _torch_quantized_attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    *,
    read_sealed: SealedReader,
    sealed: SealedBlocks | None,
    mask: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return quantized_paged_attention_reference(
        query, key_cache, value_cache, block_table, kv_length, scale, read_sealed, mask=mask, softcap=softcap,
        sinks=sinks,
    )  # fmt: skip


def _triton_quantized_attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    *,
    read_sealed: SealedReader,
    sealed: SealedBlocks | None,
    mask: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    from hf_kvgov.kernels.triton_quantized import quantized_paged_attention_triton

    assert sealed is not None, "the kernel refuses calls without sealed blocks before it is chosen"
    return quantized_paged_attention_triton(
        query, key_cache, value_cache, block_table, kv_length, scale, sealed, mask=mask, softcap=softcap, sinks=sinks
    )


def _triton_quantized_refuses(probe: Probe) -> str | None:
    from hf_kvgov.kernels.triton_quantized import unsupported_reason

    return unsupported_reason(probe.query, probe.key_cache, probe.mask, probe.sealed)


def _flash_refuses(probe: Probe) -> str | None:
    """A ragged call's mask is read as `cache_seqlens` and `window_size`; any other mask is refused."""
    return flash_paged.unsupported_reason(probe.query, probe.key_cache, None if probe.ragged else probe.mask)


def _sdpa_refuses(probe: Probe) -> str | None:
    return gathered_sdpa.unsupported_reason(probe.softcap)


TORCH = Backend("torch", paged_attention_reference, takes_sinks=True)
# Gather + fused sdpa: on a CPU (or a GPU without Triton) faster than the reference at any batch.
SDPA = Backend("sdpa", gathered_sdpa.paged_attention_gathered_sdpa, _sdpa_refuses, frozenset({"cpu", "cuda"}), 5)
TORCH_QUANTIZED = Backend("torch", _torch_quantized_attend, takes_sinks=True)
# Sealed blocks decoded into one layer's gathered K/V, then fused sdpa: on a CPU faster than the chunked reference.
SDPA_QUANTIZED = Backend(
    "sdpa", gathered_sdpa.quantized_paged_attention_gathered_sdpa, _sdpa_refuses, frozenset({"cpu", "cuda"}), 5
)
TRITON = Backend("triton", _triton_attend, _triton_refuses, frozenset({"cuda"}), priority=10, takes_sinks=True)
TRITON_QUANTIZED = Backend(
    "triton", _triton_quantized_attend, _triton_quantized_refuses, frozenset({"cuda"}), 10, takes_sinks=True
)
FLASH_ATTN = Backend(
    "flash_attn", flash_paged.paged_attention_flash, _flash_refuses, frozenset({"cuda"}), 20, takes_lengths=True
)
