"""One dispatch point for attention over block tables.

Backends, by name:
- "torch": the reference (`kernels.reference`), the specification; serves every call.
- "triton": the paged decode kernel (`kernels.triton_paged`), registered when triton is installed. Its
  module is imported on first use, so importing hf_kvgov does not pay for triton, and a
  `TRITON_INTERPRET=1` set before that first use still takes effect.

Automatic choice: "triton" for CUDA tensors when `triton_paged.supports(...)` accepts the call (decode,
q_len == 1, power-of-two head_dim, ...), else "torch". On the CPU the torch reference stays the default
even where the Triton interpreter could run the kernel: the interpreter is exact but slow.

`set_backend(name)` forces a backend; calls it cannot serve (prefill on "triton", CPU tensors without the
interpreter) still run on "torch". `last_backend()` names the backend that actually ran.

Environment: `KVGOV_ATTENTION_BACKEND=torch|triton`, read once when this module is imported, forces a
backend as `set_backend` does; unset, empty or "auto" means automatic. `set_backend(None)` returns to
the automatic choice.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from hf_kvgov.kernels.reference import paged_attention_reference

PagedAttentionFn = Callable[..., torch.Tensor]
SupportsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], bool]
ENV_VAR = "KVGOV_ATTENTION_BACKEND"


def _triton_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    from hf_kvgov.kernels.triton_paged import paged_attention_triton

    return paged_attention_triton(*args, **kwargs)


def _triton_supports(query: torch.Tensor, key_cache: torch.Tensor, mask: torch.Tensor | None) -> bool:
    from hf_kvgov.kernels.triton_paged import supports

    return supports(query, key_cache, mask)


BACKENDS: dict[str, PagedAttentionFn] = {"torch": paged_attention_reference}
# Which calls a fast backend can serve; a backend missing here serves every call.
SUPPORTS: dict[str, SupportsFn] = {}
if importlib.util.find_spec("triton") is not None:
    BACKENDS["triton"] = _triton_attention
    SUPPORTS["triton"] = _triton_supports


def _backend_from_environment() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not an available paged attention backend; "
            f"accepted: {sorted(BACKENDS)}, 'auto' or unset."
        )
    return value


_forced: str | None = _backend_from_environment()
_last: str | None = None


def set_backend(name: str | None) -> None:
    """Force one backend by name (None restores automatic choice)."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"Unknown paged attention backend {name!r}; available: {sorted(BACKENDS)}.")
    _forced = name


def last_backend() -> str | None:
    """The backend that served the latest call (for stats and debugging)."""
    return _last


def choose_backend(query: torch.Tensor, key_cache: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> str:
    """The backend that will serve a call with these inputs (without `key_cache`, only "torch" is sure)."""
    wanted = _forced if _forced is not None else _automatic(query)
    supports = SUPPORTS.get(wanted)
    if supports is None:
        return wanted
    if key_cache is None or not supports(query, key_cache, mask):
        return "torch"
    return wanted


def _automatic(query: torch.Tensor) -> str:
    return "triton" if query.is_cuda and "triton" in BACKENDS else "torch"


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """See `paged_attention_reference` for shapes; returns `[batch, q_len, q_heads, head_dim]`."""
    global _last
    name = choose_backend(query, key_cache, mask)
    _last = name
    return BACKENDS[name](query, key_cache, value_cache, block_table, kv_length, scale, mask=mask, softcap=softcap)
