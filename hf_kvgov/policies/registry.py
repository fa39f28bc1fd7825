"""Names to policy factories, so callers build a policy from a string without branching on its type."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hf_kvgov.policies.base import EvictionPolicy
from hf_kvgov.policies.expected_attention import ExpectedAttention, running_expected_attention
from hf_kvgov.policies.heavy_hitter import H2O
from hf_kvgov.policies.key_norm import KeyNorm
from hf_kvgov.policies.mean_mass import MeanMass
from hf_kvgov.policies.sink_window import SinkWindow
from hf_kvgov.policies.snapkv import SnapKV
from hf_kvgov.policies.tova import TOVA

PolicyFactory = Callable[..., EvictionPolicy]

_FACTORIES: dict[str, PolicyFactory] = {
    "expected_attention": ExpectedAttention,
    "expected_attention_running": running_expected_attention,
    "h2o": H2O,
    "key_norm": KeyNorm,
    "mean_mass": MeanMass,
    "sink": SinkWindow,
    "snapkv": SnapKV,
    "tova": TOVA,
}


def available_policies() -> tuple[str, ...]:
    """The registered policy names, sorted."""
    return tuple(sorted(_FACTORIES))


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make ``make_policy(name, **config)`` call ``factory(**config)``.

    Raises ``ValueError`` if ``name`` is taken, unless ``replace`` is True.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"A policy name must be a non-empty string; got {name!r}.")
    if name in _FACTORIES and not replace:
        raise ValueError(
            f"A policy named {name!r} is already registered ({_FACTORIES[name]!r}); pass replace=True to override it."
        )
    _FACTORIES[name] = factory


def make_policy(name: str, **config: Any) -> EvictionPolicy:
    """Build the policy registered under ``name`` with ``config``.

    Example: ``make_policy("sink", n_sink=4, window=60)``. Unknown names raise ``ValueError``.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        accepted = ", ".join(repr(n) for n in available_policies())
        raise ValueError(f"Unknown eviction policy {name!r}; the accepted names are {accepted}.")
    signature = inspect.signature(factory)
    try:
        signature.bind(**config)
    except TypeError as error:  # a setting missing or unknown: say which, and what the policy takes
        given = ", ".join(f"{key}={value!r}" for key, value in config.items()) or "no settings"
        takes = ", ".join(
            p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
            for p in signature.parameters.values()
        )
        raise ValueError(
            f"The eviction policy {name!r} cannot be built from {given}: {error}; it takes ({takes})."
        ) from None
    return factory(**config)
