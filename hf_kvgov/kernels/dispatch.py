"""One dispatch point for attention over block tables, chosen per call.

Two paths, each a registry from backend name to a `Backend` record: "paged" (`paged_attention`, full-precision
blocks) with "torch" (the reference, which serves every call), "sdpa", "triton" and "flash_attn"; "quantized"
(`quantized_paged_attention`, tables mixing full-precision and sealed blocks) with "torch", "sdpa" and "triton"
(decode only). Fast backends' modules are imported on first use (a `TRITON_INTERPRET=1` set before still counts).
Automatically, the highest-`priority` backend whose `auto_devices` list the query's device and that accepts the call
serves it, else "torch" (the Triton interpreter is exact but slow, so never picked by itself); a call with learned
sink logits (GPT-OSS) only by one that `takes_sinks`. `set_backend(name)` or `KVGOV_ATTENTION_BACKEND` forces one
backend where it can serve; `last_backend()`, `backend_counts()` and the DEBUG logger `hf_kvgov.kernels.dispatch`
say which backend served and why a preferred one refused.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections import Counter

import torch

from hf_kvgov.kernels import flash_paged
from hf_kvgov.kernels.backends import (
    FLASH_ATTN,
    SDPA,
    SDPA_QUANTIZED,
    TORCH,
    TORCH_QUANTIZED,
    TRITON,
    TRITON_QUANTIZED,
    Backend,
    Probe,
)
from hf_kvgov.kernels.quantized_reference import SealedReader
from hf_kvgov.kernels.sealed_blocks import SealedBlocks

logger = logging.getLogger(__name__)

ENV_VAR = "KVGOV_ATTENTION_BACKEND"
PAGED, QUANTIZED = "paged", "quantized"


_REGISTRY: dict[str, dict[str, Backend]] = {
    PAGED: {"torch": TORCH, "sdpa": SDPA},
    QUANTIZED: {"torch": TORCH_QUANTIZED, "sdpa": SDPA_QUANTIZED},
}
if importlib.util.find_spec("triton") is not None:
    _REGISTRY[PAGED]["triton"] = TRITON
    _REGISTRY[QUANTIZED]["triton"] = TRITON_QUANTIZED
if flash_paged.is_installed():
    _REGISTRY[PAGED]["flash_attn"] = FLASH_ATTN


def register_backend(path: str, backend: Backend) -> None:
    """Add (or replace) `backend` on `path` ("paged" or "quantized"); "torch" cannot be replaced."""
    registry = _registry(path)
    if backend.name == "torch":
        raise ValueError("The 'torch' backend is the reference every fallback relies on; it cannot be replaced.")
    registry[backend.name] = backend


def unregister_backend(path: str, name: str) -> None:
    """Remove backend `name` from `path` (a no-op when it is not there); "torch" stays."""
    if name == "torch":
        raise ValueError("The 'torch' backend is the reference every fallback relies on; it cannot be removed.")
    _registry(path).pop(name, None)


def available_backends(path: str = PAGED) -> tuple[str, ...]:
    """The backend names registered on `path`, sorted."""
    return tuple(sorted(_registry(path)))


def _registry(path: str) -> dict[str, Backend]:
    registry = _REGISTRY.get(path)
    if registry is None:
        raise ValueError(f"Unknown attention path {path!r}; the paths are {sorted(_REGISTRY)}.")
    return registry


def _all_names() -> list[str]:
    return sorted({name for registry in _REGISTRY.values() for name in registry})


# ---------------------------------------------------------------- forcing a backend


def _backend_from_environment() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _all_names():
        raise ValueError(
            f"{ENV_VAR}={value!r} is not an available paged attention backend; "
            f"accepted: {_all_names()}, 'auto' or unset."
        )
    return value


_forced: str | None = _backend_from_environment()
_last: str | None = None
_serving: dict[str, str] = {}  # path -> the backend that served its latest call (for the change log)
_counts: Counter[str] = Counter()


def set_backend(name: str | None) -> None:
    """Force one backend by name on every path that has it (None restores the automatic choice)."""
    global _forced
    if name is not None and name not in _all_names():
        raise ValueError(f"Unknown paged attention backend {name!r}; available: {_all_names()}.")
    _forced = name


def forced_backend() -> str | None:
    """The backend forced by `set_backend` or the environment, None when the choice is automatic."""
    return _forced


# ---------------------------------------------------------------- choosing


def choose_backend(
    query: torch.Tensor,
    key_cache: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    path: str = PAGED,
    sealed: SealedBlocks | None = None,
    softcap: float | None = None,
) -> str:
    """The backend that will serve a call with these inputs (without `key_cache`, only "torch" is sure)."""
    return _choose(_registry(path), query, key_cache, mask, sealed, softcap)[0]


def refusals(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    path: str = PAGED,
    sealed: SealedBlocks | None = None,
    softcap: float | None = None,
) -> dict[str, str | None]:
    """Every backend of `path` -> why it would refuse this call (None: it would serve it). For debugging."""
    probe = Probe(query, key_cache, mask, sealed, softcap)
    return {name: (b.refuses(probe) if b.refuses else None) for name, b in sorted(_registry(path).items())}


def _choose(
    registry: dict[str, Backend],
    query: torch.Tensor,
    key_cache: torch.Tensor | None,
    mask: torch.Tensor | None,
    sealed: SealedBlocks | None,
    softcap: float | None = None,
    ragged: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[str, str]:
    """(backend name, why) for one call."""
    probe = None if key_cache is None else Probe(query, key_cache, mask, sealed, softcap, ragged, sinks)
    if _forced is not None:
        return _forced_choice(registry, probe)
    why = "automatic choice"
    candidates = [b for b in registry.values() if query.device.type in b.auto_devices]
    for backend in sorted(candidates, key=lambda b: -b.priority):
        reason = _refusal(backend, probe)
        if reason is None:
            return backend.name, why
        why = f"{why}; {backend.name} refused: {reason}"
    return "torch", why


def _forced_choice(registry: dict[str, Backend], probe: Probe | None) -> tuple[str, str]:
    assert _forced is not None
    backend = registry.get(_forced)
    if backend is None:
        return "torch", f"forced {_forced!r} has no implementation on this path"
    reason = _refusal(backend, probe)
    if reason is None:
        return backend.name, f"forced {_forced!r}"
    return "torch", f"forced {_forced!r} refused: {reason}"


def _refusal(backend: Backend, probe: Probe | None) -> str | None:
    if probe is not None and probe.sinks is not None and not backend.takes_sinks:
        return "it does not compute learned sink logits (s_aux)"
    if backend.refuses is None:
        return None
    if probe is None:
        return "the call's key_cache was not given"
    return backend.refuses(probe)


def _record(path: str, name: str, why: str) -> None:
    global _last
    _last = name
    _counts[f"{path}/{name}"] += 1
    if _serving.get(path) != name:
        _serving[path] = name
        logger.debug("%s attention is now served by %r (%s).", path, name, why)


def last_backend() -> str | None:
    """The backend that served the latest call, on either path (for stats and debugging)."""
    return _last


def backend_counts() -> dict[str, int]:
    """Calls served since the last reset, keyed "path/backend" (e.g. "quantized/triton")."""
    return dict(_counts)


def reset_backend_counts() -> None:
    """Forget the counts, and which backend served each path (the next call of each path logs again)."""
    _counts.clear()
    _serving.clear()


# ---------------------------------------------------------------- the calls


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    seq_lens: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `paged_attention_reference` for shapes (and `sinks`); returns `[batch, q_len, q_heads, head_dim]`.

    `seq_lens` (long `[batch]`) and `window` say what `mask` is, when it is only this: row b attends causally,
    bottom-right aligned, to its first `seq_lens[b]` keys (`kv_length` without it), within the last `window`. A
    backend that `takes_lengths` (flash-attn: `cache_seqlens`, `window_size`) reads them instead of the mask.
    """
    registry = _registry(PAGED)
    ragged = seq_lens is not None or window is not None
    name, why = _choose(registry, query, key_cache, mask, None, softcap, ragged, sinks)
    _record(PAGED, name, why)
    backend = registry[name]
    args = (query, key_cache, value_cache, block_table, kv_length, scale)
    if ragged and backend.takes_lengths:
        return backend.attend(*args, softcap=softcap, seq_lens=seq_lens, window=window)
    if sinks is not None:
        return backend.attend(*args, mask=mask, softcap=softcap, sinks=sinks)
    return backend.attend(*args, mask=mask, softcap=softcap)


def quantized_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    read_sealed: SealedReader,
    sealed: SealedBlocks | None = None,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `quantized_paged_attention_reference` for shapes (and `sinks`); `sealed` (the layer's sealed pieces)
    lets a kernel read codes in place, `read_sealed` decodes them for the reference. Returns `[batch, q_len,
    q_heads, head_dim]`."""
    registry = _registry(QUANTIZED)
    name, why = _choose(registry, query, key_cache, mask, sealed, softcap, sinks=sinks)
    _record(QUANTIZED, name, why)
    args = (query, key_cache, value_cache, block_table, kv_length, scale)
    extra = {} if sinks is None else {"sinks": sinks}
    return registry[name].attend(*args, read_sealed=read_sealed, sealed=sealed, mask=mask, softcap=softcap, **extra)
